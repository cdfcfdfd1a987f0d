// Package metrics writes and reads the Prometheus text exposition format
// (version 0.0.4), the small part of it fabricbridge needs: counters,
// gauges and histograms with labels.
//
// It is written here rather than imported from client_golang because the
// daemon's metrics are snapshots it already holds (BPF counters, stream and
// queue stats) read once per scrape: a collector that writes samples
// straight into the response is all that is needed, without registries,
// descriptors or a dependency tree. Parse reads the same format back, for
// `fabricbridge stats` and for tests.
package metrics

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// Type is a metric family's type.
type Type string

const (
	Counter   Type = "counter"
	Gauge     Type = "gauge"
	Histogram Type = "histogram"
)

// Family describes one metric family; Name must match
// [a-zA-Z_:][a-zA-Z0-9_:]* and counters should end in _total.
type Family struct {
	Name, Help string
	Type       Type
}

// Label is one label pair.
type Label struct{ Name, Value string }

// L builds labels from alternating names and values.
func L(pairs ...string) []Label {
	if len(pairs)%2 != 0 {
		panic("metrics: L needs name, value pairs")
	}
	ls := make([]Label, 0, len(pairs)/2)
	for i := 0; i < len(pairs); i += 2 {
		ls = append(ls, Label{pairs[i], pairs[i+1]})
	}
	return ls
}

// Writer gathers samples during one scrape and writes them grouped by
// family, in the order families were first used, with HELP and TYPE lines
// once each: the exposition format requires a family's samples to be
// contiguous, and collectors need not care about that.
type Writer struct {
	order []*family
	byKey map[string]*family
	err   error
}

type family struct {
	Family
	lines []string
}

// NewWriter returns an empty writer.
func NewWriter() *Writer { return &Writer{byKey: map[string]*family{}} }

func (w *Writer) family(f Family) *family {
	fam := w.byKey[f.Name]
	if fam == nil {
		if !validName(f.Name, true) && w.err == nil {
			w.err = fmt.Errorf("metrics: invalid metric name %q", f.Name)
		}
		fam = &family{Family: f}
		w.byKey[f.Name] = fam
		w.order = append(w.order, fam)
	} else if fam.Type != f.Type && w.err == nil {
		w.err = fmt.Errorf("metrics: %s used as %s and %s", f.Name, fam.Type, f.Type)
	}
	return fam
}

// Add writes one sample of a counter or gauge.
func (w *Writer) Add(f Family, value float64, labels ...Label) {
	fam := w.family(f)
	fam.lines = append(fam.lines, w.sample(f.Name, labels, "", "", value))
}

// AddUint writes one integer sample; counters are integers, and large ones
// would lose precision through float64 formatting.
func (w *Writer) AddUint(f Family, value uint64, labels ...Label) {
	fam := w.family(f)
	fam.lines = append(fam.lines, w.labels(f.Name, labels, "", "")+" "+strconv.FormatUint(value, 10))
}

// AddHistogram writes one histogram: upper bounds (ascending, without +Inf),
// the count of observations in each bucket (not cumulative; len(bounds)+1
// entries, the last for observations above every bound), and their sum.
func (w *Writer) AddHistogram(f Family, bounds []float64, counts []uint64, sum float64, labels ...Label) {
	fam := w.family(f)
	if len(counts) != len(bounds)+1 && w.err == nil {
		w.err = fmt.Errorf("metrics: histogram %s has %d bounds and %d counts", f.Name, len(bounds), len(counts))
		return
	}
	var cum uint64
	for i, c := range counts {
		cum += c
		le := "+Inf"
		if i < len(bounds) {
			le = formatFloat(bounds[i])
		}
		fam.lines = append(fam.lines, w.labels(f.Name+"_bucket", labels, "le", le)+" "+strconv.FormatUint(cum, 10))
	}
	fam.lines = append(fam.lines, w.sample(f.Name+"_sum", labels, "", "", sum))
	fam.lines = append(fam.lines, w.labels(f.Name+"_count", labels, "", "")+" "+strconv.FormatUint(cum, 10))
}

func (w *Writer) sample(name string, labels []Label, extra, extraValue string, v float64) string {
	return w.labels(name, labels, extra, extraValue) + " " + formatFloat(v)
}

func (w *Writer) labels(name string, labels []Label, extra, extraValue string) string {
	if len(labels) == 0 && extra == "" {
		return name
	}
	var b strings.Builder
	b.WriteString(name)
	b.WriteByte('{')
	n := 0
	write := func(k, v string) {
		if !validName(k, false) && w.err == nil {
			w.err = fmt.Errorf("metrics: invalid label name %q on %s", k, name)
		}
		if n > 0 {
			b.WriteByte(',')
		}
		n++
		b.WriteString(k)
		b.WriteString(`="`)
		b.WriteString(escapeLabel(v))
		b.WriteByte('"')
	}
	for _, l := range labels {
		write(l.Name, l.Value)
	}
	if extra != "" {
		write(extra, extraValue)
	}
	b.WriteByte('}')
	return b.String()
}

// WriteTo writes the exposition. It fails if any family or label name was
// invalid, so that a mistake shows up in tests instead of in Prometheus.
func (w *Writer) WriteTo(out io.Writer) (int64, error) {
	if w.err != nil {
		return 0, w.err
	}
	var b strings.Builder
	for _, f := range w.order {
		if f.Help != "" {
			fmt.Fprintf(&b, "# HELP %s %s\n", f.Name, escapeHelp(f.Help))
		}
		fmt.Fprintf(&b, "# TYPE %s %s\n", f.Name, f.Type)
		for _, l := range f.lines {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	}
	n, err := io.WriteString(out, b.String())
	return int64(n), err
}

// ContentType is the exposition format's media type.
const ContentType = "text/plain; version=0.0.4; charset=utf-8"

// Handler serves the samples that collect writes, fresh on every request.
func Handler(collect func(*Writer)) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w := NewWriter()
		collect(w)
		var b strings.Builder
		if _, err := w.WriteTo(&b); err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError)
			return
		}
		rw.Header().Set("Content-Type", ContentType)
		io.WriteString(rw, b.String())
	})
}

func validName(s string, colon bool) bool {
	if s == "" {
		return false
	}
	for i, c := range s {
		ok := c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (colon && c == ':') || (i > 0 && c >= '0' && c <= '9')
		if !ok {
			return false
		}
	}
	return !strings.HasPrefix(s, "__") || colon
}

// escapeLabel escapes a label value: backslash, double quote and line feed.
func escapeLabel(s string) string {
	if !strings.ContainsAny(s, "\\\"\n") {
		return s
	}
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(s)
}

// escapeHelp escapes HELP text: backslash and line feed only.
func escapeHelp(s string) string {
	return strings.NewReplacer(`\`, `\\`, "\n", `\n`).Replace(s)
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

// Sample is one parsed sample line.
type Sample struct {
	Name   string
	Labels []Label
	Value  float64
}

// Label returns the value of the named label, or "".
func (s Sample) Label(name string) string {
	for _, l := range s.Labels {
		if l.Name == name {
			return l.Value
		}
	}
	return ""
}

// Parse reads samples in the text format, skipping comments. Timestamps
// after the value are accepted and ignored.
func Parse(r io.Reader) ([]Sample, error) {
	var out []Sample
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		t := strings.TrimSpace(sc.Text())
		if t == "" || t[0] == '#' {
			continue
		}
		s, err := parseLine(t)
		if err != nil {
			return out, fmt.Errorf("metrics: line %d: %v", line, err)
		}
		out = append(out, s)
	}
	return out, sc.Err()
}

func parseLine(t string) (Sample, error) {
	var s Sample
	i := strings.IndexAny(t, "{ ")
	if i < 0 {
		return s, fmt.Errorf("no value in %q", t)
	}
	s.Name, t = t[:i], t[i:]
	if !validName(s.Name, true) {
		return s, fmt.Errorf("invalid metric name %q", s.Name)
	}
	if t[0] == '{' {
		t = t[1:]
		for {
			t = strings.TrimLeft(t, " ")
			if strings.HasPrefix(t, "}") {
				t = t[1:]
				break
			}
			eq := strings.IndexByte(t, '=')
			if eq < 0 || len(t) < eq+2 || t[eq+1] != '"' {
				return s, fmt.Errorf("bad label in %s", s.Name)
			}
			name := strings.TrimSpace(t[:eq])
			val, rest, err := unquote(t[eq+2:])
			if err != nil {
				return s, fmt.Errorf("%s label %s: %v", s.Name, name, err)
			}
			s.Labels = append(s.Labels, Label{name, val})
			t = strings.TrimLeft(rest, " ")
			t = strings.TrimPrefix(t, ",")
		}
	}
	fields := strings.Fields(t)
	if len(fields) < 1 || len(fields) > 2 {
		return s, fmt.Errorf("%s: want a value (and an optional timestamp), got %q", s.Name, t)
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, fmt.Errorf("%s: bad value %q", s.Name, fields[0])
	}
	s.Value = v
	return s, nil
}

// unquote reads an escaped label value up to its closing quote.
func unquote(t string) (val, rest string, err error) {
	var b strings.Builder
	for i := 0; i < len(t); i++ {
		switch c := t[i]; c {
		case '"':
			return b.String(), t[i+1:], nil
		case '\\':
			if i+1 == len(t) {
				return "", "", fmt.Errorf("unterminated escape")
			}
			i++
			switch t[i] {
			case 'n':
				b.WriteByte('\n')
			case '\\', '"':
				b.WriteByte(t[i])
			default:
				return "", "", fmt.Errorf("unknown escape \\%c", t[i])
			}
		default:
			b.WriteByte(c)
		}
	}
	return "", "", fmt.Errorf("unterminated value")
}

// Find returns the samples with the given name whose labels include every
// given pair, in exposition order.
func Find(samples []Sample, name string, labels ...Label) []Sample {
	var out []Sample
	for _, s := range samples {
		if s.Name == name && !slices.ContainsFunc(labels, func(l Label) bool { return s.Label(l.Name) != l.Value }) {
			out = append(out, s)
		}
	}
	return out
}
