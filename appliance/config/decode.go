package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Error is one problem with a configuration file, located at the line and
// column of the offending field so that it can be fixed without searching.
type Error struct {
	File         string
	Line, Column int
	Field        string // dotted path such as rules[2].match.dst_port; empty for syntax errors
	Msg          string
	// Reason says which bound or rule of the input the file broke
	// (ReasonSyntax, ReasonNotText, ...); empty for a field's value.
	Reason string
}

func (e *Error) Error() string {
	loc := e.File
	switch {
	case e.Line > 0 && e.Column > 0:
		loc = fmt.Sprintf("%s:%d:%d", e.File, e.Line, e.Column)
	case e.Line > 0:
		loc = fmt.Sprintf("%s:%d", e.File, e.Line)
	}
	if e.Field == "" {
		return loc + ": " + e.Msg
	}
	return loc + ": " + e.Field + ": " + e.Msg
}

// Errors is every problem found in one file, in file order, so that a bad
// configuration can be fixed in one pass.
type Errors []*Error

func (es Errors) Error() string {
	var b strings.Builder
	for i, e := range es {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(e.Error())
	}
	return b.String()
}

// scalar is implemented by pointers to field types that parse themselves from
// one YAML scalar: ports, prefixes, sizes, enumerations. The returned error's
// text becomes the message after the field path.
type scalar interface {
	parseScalar(s string) error
}

// defaulter is implemented by pointers to structs that have defaults other
// than their zero value; the decoder calls it on every new element of a list
// before decoding the element into it.
type defaulter interface {
	setDefaults()
}

// pos is where a field or list element starts in the file.
type pos struct{ line, col int }

// decoder walks a yaml.Node tree into Go values by the `yaml` struct tags,
// refusing unknown and duplicate keys, and remembers where every field was
// written so later checks can point at it.
type decoder struct {
	file  string
	errs  Errors
	where map[string]pos

	// Bounds (see MaxExpansion, MaxErrors): inAlias is how many aliases
	// the walk is inside, expanded how many values they stood for;
	// stopped ends the walk; dropped counts problems beyond MaxErrors,
	// firstDropped is where the first of them is.
	inAlias, expanded int
	stopped           bool
	dropped           int
	firstDropped      pos
}

func (d *decoder) errorf(n *yaml.Node, field, format string, args ...any) {
	var p pos
	if n != nil {
		p = pos{n.Line, n.Column}
	}
	d.add(p, field, "", fmt.Sprintf(format, shortArgs(args)...))
}

// errorAt reports a problem with a field by its path, located where the
// field (or, when it was not written, its nearest written parent) is.
func (d *decoder) errorAt(field, format string, args ...any) {
	d.add(d.lookup(field), field, "", fmt.Sprintf(format, shortArgs(args)...))
}

// add records a problem, the first MaxErrors of them and the bound that
// ended the walk, if one did; a problem with no position of its own (a
// check on an empty file) is put on line 1.
func (d *decoder) add(p pos, field, reason, msg string) {
	if p.line == 0 {
		p = pos{1, 0}
	}
	if len(d.errs) >= MaxErrors && reason != ReasonAliasBomb && reason != ReasonTooBig {
		if d.dropped == 0 {
			d.firstDropped = p
		}
		d.dropped++
		return
	}
	if len(field) > 2*maxQuote {
		field = head(field) + "…"
	}
	d.errs = append(d.errs, &Error{File: d.file, Line: p.line, Column: p.col, Field: field, Msg: msg, Reason: reason})
}

// finish adds the count of problems beyond MaxErrors.
func (d *decoder) finish() {
	if d.dropped > 0 {
		d.errs = append(d.errs, &Error{File: d.file, Line: d.firstDropped.line, Column: d.firstDropped.col, Reason: ReasonTooMany,
			Msg: fmt.Sprintf("%d more problem(s) from here on, not listed: fix the ones above first", d.dropped)})
	}
}

func (d *decoder) lookup(field string) pos {
	for f := field; ; {
		if p, ok := d.where[f]; ok {
			return p
		}
		i := strings.LastIndexAny(f, ".[")
		if i <= 0 {
			return d.where[""]
		}
		f = f[:i]
	}
}

// written reports whether the file set the field.
func (d *decoder) written(field string) bool {
	_, ok := d.where[field]
	return ok
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func resolve(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return excerpt(n.Value)
	}
	return "something else"
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

var scalarType = reflect.TypeFor[scalar]()

// decode stores n into v (addressable). A null leaves v as it is, so that
// `key:` with nothing after it keeps the default.
func (d *decoder) decode(path string, n *yaml.Node, v reflect.Value) {
	if d.stopped || n == nil {
		return
	}
	if n.Kind == yaml.AliasNode {
		d.inAlias++
		defer func() { d.inAlias-- }()
	}
	if d.inAlias > 0 {
		if d.expanded++; d.expanded > MaxExpansion {
			d.add(pos{n.Line, n.Column}, path, ReasonAliasBomb, fmt.Sprintf("aliases (*name) stand for more than %d values in all; write the values out", MaxExpansion))
			d.stopped = true
			return
		}
	}
	n = resolve(n)
	if n == nil || isNull(n) {
		return
	}
	if n.Kind == yaml.ScalarNode && len(n.Value) > MaxScalar {
		d.add(pos{n.Line, n.Column}, path, ReasonTooLong, fmt.Sprintf("a value of %d bytes, more than the %d a value may have: %s", len(n.Value), MaxScalar, excerpt(n.Value)))
		return
	}
	if v.Addr().Type().Implements(scalarType) {
		if n.Kind != yaml.ScalarNode {
			d.errorf(n, path, "want a single value, got %s", kindName(n))
			return
		}
		if len(n.Value) > maxQuote {
			// Ports, addresses, sizes, durations and names of choices
			// are short: a long one is wrong, and is not echoed whole.
			d.errorf(n, path, "want a single short value, got %s", kindName(n))
			return
		}
		if err := v.Addr().Interface().(scalar).parseScalar(n.Value); err != nil {
			d.errorf(n, path, "%v", err)
		}
		return
	}
	switch v.Kind() {
	case reflect.Struct:
		d.decodeStruct(path, n, v)
	case reflect.Slice:
		d.decodeSlice(path, n, v)
	case reflect.String:
		if n.Kind != yaml.ScalarNode {
			d.errorf(n, path, "want a string, got %s", kindName(n))
			return
		}
		v.SetString(n.Value)
	case reflect.Bool:
		b, err := strconv.ParseBool(n.Value)
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!bool" || err != nil {
			d.errorf(n, path, "want true or false, got %s", kindName(n))
			return
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int64, reflect.Int32:
		i, err := strconv.ParseInt(n.Value, 0, v.Type().Bits())
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" || err != nil {
			d.errorf(n, path, "want an integer, got %s", kindName(n))
			return
		}
		v.SetInt(i)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		u, err := strconv.ParseUint(n.Value, 0, v.Type().Bits())
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" || err != nil {
			d.errorf(n, path, "want an integer from 0 to %d, got %s", uint64(1)<<v.Type().Bits()-1, kindName(n))
			return
		}
		v.SetUint(u)
	default:
		panic(fmt.Sprintf("config: field %s has unsupported type %s", path, v.Type()))
	}
}

func (d *decoder) decodeSlice(path string, n *yaml.Node, v reflect.Value) {
	if n.Kind != yaml.SequenceNode {
		d.errorf(n, path, "want a list, got %s", kindName(n))
		return
	}
	s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
	for i, item := range n.Content {
		p := fmt.Sprintf("%s[%d]", path, i)
		d.where[p] = pos{item.Line, item.Column}
		e := s.Index(i)
		if df, ok := e.Addr().Interface().(defaulter); ok {
			df.setDefaults()
		}
		d.decode(p, item, e)
	}
	v.Set(s)
}

// fields lists the yaml keys of a struct type with their field indices.
func fields(t reflect.Type) (keys []string, index map[string]int) {
	index = map[string]int{}
	for i := range t.NumField() {
		tag := t.Field(i).Tag.Get("yaml")
		if tag == "" || tag == "-" {
			continue
		}
		keys = append(keys, tag)
		index[tag] = i
	}
	return keys, index
}

func (d *decoder) decodeStruct(path string, n *yaml.Node, v reflect.Value) {
	if n.Kind != yaml.MappingNode {
		d.errorf(n, path, "want a mapping of fields, got %s", kindName(n))
		return
	}
	keys, index := fields(v.Type())
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := resolve(n.Content[i]), n.Content[i+1]
		if k.Kind != yaml.ScalarNode || len(k.Value) > maxQuote {
			d.errorf(k, path, "a field name must be a plain word, got %s", kindName(k))
			continue
		}
		field := join(path, k.Value)
		if k.Value == "<<" {
			d.errorf(k, path, "merge keys (<<) are not supported; write the fields out")
			continue
		}
		fi, ok := index[k.Value]
		if !ok {
			d.errorf(k, field, "unknown field%s; known fields here: %s", suggest(k.Value, keys), schemaText(strings.Join(keys, ", ")))
			continue
		}
		if line, dup := seen[k.Value]; dup {
			d.errorf(k, field, "set twice (first on line %d)", line)
			continue
		}
		seen[k.Value] = k.Line
		d.where[field] = pos{k.Line, k.Column}
		d.decode(field, val, v.Field(fi))
	}
}

// suggest names the known key closest to a misspelt one, if any is close.
func suggest(key string, known []string) string {
	best, bestD := "", 3
	for _, k := range known {
		if dd := distance(strings.ToLower(key), k); dd < bestD {
			best, bestD = k, dd
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

// distance is the Levenshtein distance.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// parseYAML parses the file's one YAML document into its root node,
// turning the parser's errors into located Errors. The file must be within
// the bounds prescan checks; a second document is an error.
func (d *decoder) parseYAML(data []byte) *yaml.Node {
	if d.tooBig(data) || !d.prescan(data) {
		return nil
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc, next yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if err != io.EOF {
			d.errs = append(d.errs, syntaxError(d.file, err))
		}
		return nil
	}
	switch err := dec.Decode(&next); {
	case err == io.EOF:
	case err != nil:
		d.errs = append(d.errs, syntaxError(d.file, err))
		return nil
	default:
		d.errs = append(d.errs, &Error{File: d.file, Line: max(next.Line, 1), Reason: ReasonDocuments,
			Msg: "a second YAML document (after ---): a configuration file holds one"})
		return nil
	}
	if doc.Kind == 0 || len(doc.Content) == 0 {
		return nil // empty file: all defaults
	}
	return doc.Content[0]
}

// syntaxError converts "yaml: line N: msg" into a located Error.
func syntaxError(file string, err error) *Error {
	msg := err.Error()
	var te *yaml.TypeError
	if errors.As(err, &te) && len(te.Errors) > 0 {
		msg = te.Errors[0]
	}
	msg = strings.TrimPrefix(msg, "yaml: ")
	// Where the parser names no line, the file as a whole is meant.
	e := &Error{File: file, Line: 1, Msg: "invalid YAML: " + msg, Reason: ReasonSyntax}
	if rest, ok := strings.CutPrefix(msg, "line "); ok {
		if num, text, ok := strings.Cut(rest, ": "); ok {
			if line, err := strconv.Atoi(num); err == nil {
				// The parser names a line but no column, and for
				// some errors the line where the construct began.
				e.Line, e.Msg = line, "invalid YAML: "+text
			}
		}
	}
	return e
}

// sortErrors puts errors in file order; decoding and the semantic checks
// find them in different orders.
func (es Errors) sort() {
	slices.SortStableFunc(es, func(a, b *Error) int {
		if a.Line != b.Line {
			return a.Line - b.Line
		}
		return a.Column - b.Column
	})
}
