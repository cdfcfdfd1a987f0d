package metrics

import (
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

var (
	rulePkts = Family{"fb_rule_packets_total", "Packets counted per rule.", Counter}
	mode     = Family{"fb_attach_mode", "1 for the mode in use.", Gauge}
	lat      = Family{"fb_latency_seconds", "Latency\\with a backslash\nand a newline.", Histogram}
)

func TestExposition(t *testing.T) {
	w := NewWriter()
	w.AddUint(rulePkts, 18446744073709551615, L("id", "1", "name", `a "quoted" \ name`+"\nline")...)
	w.Add(mode, 1, L("interface", "eth1", "mode", "native")...)
	w.AddUint(rulePkts, 7, L("id", "2", "name", "plain")...) // interleaved: still grouped
	w.AddHistogram(lat, []float64{1e-5, 0.0001, 0.001}, []uint64{3, 2, 0, 1}, 0.25, L("ring", "l0")...)
	w.Add(Family{"fb_up", "", Gauge}, math.Inf(1))
	var b strings.Builder
	if _, err := w.WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	want := `# HELP fb_rule_packets_total Packets counted per rule.
# TYPE fb_rule_packets_total counter
fb_rule_packets_total{id="1",name="a \"quoted\" \\ name\nline"} 18446744073709551615
fb_rule_packets_total{id="2",name="plain"} 7
# HELP fb_attach_mode 1 for the mode in use.
# TYPE fb_attach_mode gauge
fb_attach_mode{interface="eth1",mode="native"} 1
# HELP fb_latency_seconds Latency\\with a backslash\nand a newline.
# TYPE fb_latency_seconds histogram
fb_latency_seconds_bucket{ring="l0",le="1e-05"} 3
fb_latency_seconds_bucket{ring="l0",le="0.0001"} 5
fb_latency_seconds_bucket{ring="l0",le="0.001"} 5
fb_latency_seconds_bucket{ring="l0",le="+Inf"} 6
fb_latency_seconds_sum{ring="l0"} 0.25
fb_latency_seconds_count{ring="l0"} 6
# TYPE fb_up gauge
fb_up +Inf
`
	if b.String() != want {
		t.Errorf("got:\n%s\nwant:\n%s", b.String(), want)
	}

	// Parse reads it back, escapes undone.
	samples, err := Parse(strings.NewReader(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	if len(samples) != 10 {
		t.Fatalf("%d samples, want 10", len(samples))
	}
	if s := samples[0]; s.Label("name") != `a "quoted" \ name`+"\nline" || s.Value != 18446744073709551615 {
		t.Errorf("first sample: %+v", s)
	}
	if got := Find(samples, "fb_latency_seconds_bucket", Label{"le", "0.0001"}); len(got) != 1 || got[0].Value != 5 {
		t.Errorf("bucket: %+v", got)
	}
	if got := Find(samples, "fb_up"); len(got) != 1 || !math.IsInf(got[0].Value, 1) {
		t.Errorf("fb_up: %+v", got)
	}
}

func TestInvalidNamesFail(t *testing.T) {
	for _, tc := range []struct {
		name string
		fill func(*Writer)
	}{
		{"metric name", func(w *Writer) { w.Add(Family{"fb-rule", "", Gauge}, 1) }},
		{"metric name digit", func(w *Writer) { w.Add(Family{"1fb", "", Gauge}, 1) }},
		{"label name", func(w *Writer) { w.Add(mode, 1, Label{"if-name", "x"}) }},
		{"reserved label", func(w *Writer) { w.Add(mode, 1, Label{"__name", "x"}) }},
		{"type clash", func(w *Writer) { w.Add(mode, 1); w.Add(Family{mode.Name, "", Counter}, 1) }},
		{"histogram shape", func(w *Writer) { w.AddHistogram(lat, []float64{1}, []uint64{1}, 1) }},
	} {
		w := NewWriter()
		tc.fill(w)
		if _, err := w.WriteTo(io.Discard); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

func TestParseErrors(t *testing.T) {
	for _, in := range []string{
		"fb_x{a=\"1} 2\n",
		"fb_x{a=1} 2\n",
		"fb_x{a=\"\\q\"} 2\n",
		"fb_x two\n",
		"fb_x\n",
		"fb-x 1\n",
		"fb_x 1 2 3\n",
	} {
		if s, err := Parse(strings.NewReader(in)); err == nil {
			t.Errorf("%q parsed as %+v", in, s)
		}
	}
	s, err := Parse(strings.NewReader("# comment\n\nfb_x{a=\"1\", b=\"2\",} 3 1700000000000\n"))
	if err != nil || len(s) != 1 || s[0].Label("b") != "2" || s[0].Value != 3 {
		t.Errorf("trailing comma and timestamp: %+v, %v", s, err)
	}
}

func TestHandler(t *testing.T) {
	n := 0
	srv := httptest.NewServer(Handler(func(w *Writer) {
		n++
		w.AddUint(rulePkts, uint64(n), L("id", "1")...)
	}))
	defer srv.Close()
	for want := 1; want <= 2; want++ {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if ct := resp.Header.Get("Content-Type"); ct != ContentType {
			t.Errorf("content type %q", ct)
		}
		s, err := Parse(strings.NewReader(string(body)))
		if err != nil || len(s) != 1 || s[0].Value != float64(want) {
			t.Errorf("scrape %d: %+v %v", want, s, err)
		}
	}
	bad := httptest.NewServer(Handler(func(w *Writer) { w.Add(Family{"bad name", "", Gauge}, 1) }))
	defer bad.Close()
	resp, err := http.Get(bad.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError {
		t.Errorf("invalid metrics served with status %d", resp.StatusCode)
	}
}
