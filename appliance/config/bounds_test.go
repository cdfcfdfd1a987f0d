package config

import (
	"bytes"
	"errors"
	"io/fs"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/configs"
)

// refused parses data and returns its problems, failing the test unless
// every one is located at a line of the file and quotes at most a short
// excerpt of it, and unless the whole allocated at most 128 MiB.
func refused(t *testing.T, data []byte) Errors {
	t.Helper()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	_, err := Parse("t.yaml", data)
	took := time.Since(start)
	runtime.ReadMemStats(&after)
	// The bound is on memory, which a loaded machine or -race does not
	// change: the alias flood cost 4.8 GB before decoding was bounded, and
	// about 56 MB since.
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 128<<20 {
		t.Errorf("refusing %d bytes allocated %d MB (in %v)", len(data), alloc>>20, took)
	}
	var es Errors
	if !errors.As(err, &es) {
		t.Fatalf("error %v (%T), want Errors", err, err)
	}
	checkErrors(t, es)
	return es
}

// checkErrors fails t unless every problem has a line and a short message.
func checkErrors(t testing.TB, es Errors) {
	t.Helper()
	if len(es) > MaxErrors+2 {
		t.Errorf("%d problems listed, more than %d and a count", len(es), MaxErrors)
	}
	for _, e := range es {
		if e.Line < 1 {
			t.Errorf("no line: %v", e)
		}
		if n := len(e.Error()); n > 400 {
			t.Errorf("a %d-byte message: %.200s…", n, e.Error())
		}
	}
}

func TestHostileInput(t *testing.T) {
	rules := "rules:\n  - &bad {id: 1, action: bogus}\n"
	for _, c := range []struct {
		name   string
		data   []byte
		want   string // the first problem's text, from its position on
		reason string
	}{
		{"alias flood", []byte(base + rules + "  " + strings.Repeat("- *bad\n  ", 100_000)), "", ReasonAliasBomb},
		{"second document", []byte(base + "---\nlog: {level: debug}\n"), "t.yaml:3: a second YAML document (after ---): a configuration file holds one", ReasonDocuments},
		{"empty second document", []byte(base + "---\n"), "t.yaml:3: a second YAML document", ReasonDocuments},
		{"NUL", []byte(base + "log: {level: de\x00bug}\n"), "t.yaml:3:16: NUL byte", ReasonNotText},
		{"control character", []byte(base + "log:\n  level: \x1b[31mdebug\n"), "t.yaml:4:10: control character U+001B", ReasonNotText},
		{"invalid UTF-8", []byte(base + "applications: [{name: caf\xe9}]\n"), "t.yaml:3:26: byte 0xe9 is not UTF-8", ReasonNotText},
		{"binary", []byte("\x7fELF\x02\x01\x01\x00\x00\x00"), "t.yaml:1:1: control character U+007F", ReasonNotText},
		{"UTF-16", []byte("\xff\xfei\x00n\x00"), "t.yaml:1:1: byte 0xff is not UTF-8", ReasonNotText},
		{"deep flow nesting", []byte(base + "rules: " + strings.Repeat("[", 50_000) + strings.Repeat("]", 50_000) + "\n"), "t.yaml:3:72: nested too deeply", ReasonTooDeep},
		{"deep block nesting", []byte(base + "rules:\n" + strings.Repeat("- ", 50_000) + "x\n"), "t.yaml:4:257: nested too deeply", ReasonTooDeep},
		{"10 MB scalar", []byte(base + "log: {level: " + strings.Repeat("x", 10<<20) + "}\n"), "t.yaml:3: the file goes on past", ReasonTooBig},
		{"100 KB scalar", []byte(base + "log: {level: " + strings.Repeat("x", 100<<10) + "}\n"), "t.yaml:3:14: log.level: a value of 102400 bytes", ReasonTooLong},
		{"long typed value", []byte(base + "metrics: {address: " + strings.Repeat("9", 4000) + "}\n"), `t.yaml:3:20: metrics.address: want a single short value, got "9999`, ""},
		{"long name", []byte(base + "applications: [{name: web}]\nlisteners: [{id: 1, protocol: tcp, port: 80, app: " + strings.Repeat("w", 4000) + "}]\n"), `t.yaml:4:46: listeners[0].app: application "wwww`, ""},
		{"long key", []byte(base + strings.Repeat("k", 1000) + ": 1\n"), "t.yaml:3:1: a field name must be a plain word", ""},
		{"many problems", []byte(base + "rules:\n" + strings.Repeat("  - {id: 1, action: bogus}\n", 1000)), "t.yaml:4:", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			es := refused(t, c.data)
			if first := es[0].Error(); !strings.HasPrefix(first, c.want) {
				t.Errorf("first problem:\n%.300s\nwant it to start with:\n%s", first, c.want)
			}
			reasons := map[string]bool{}
			for _, e := range es {
				reasons[e.Reason] = true
			}
			if c.reason != "" && !reasons[c.reason] {
				t.Errorf("no problem with reason %q: %v", c.reason, es)
			}
			if c.reason != "" && c.reason != ReasonAliasBomb && len(es) != 1 {
				t.Errorf("%d problems, want the one:\n%v", len(es), es)
			}
		})
	}
}

// TestManyProblemsCounted: beyond MaxErrors problems, one line counts the
// rest, located at the first of them.
func TestManyProblemsCounted(t *testing.T) {
	es := refused(t, []byte(base+"rules:\n"+strings.Repeat("  - {id: 1, action: bogus}\n", 1000)))
	last := es[len(es)-1]
	if len(es) != MaxErrors+1 || last.Reason != ReasonTooMany || !strings.Contains(last.Msg, "more problem(s)") {
		t.Fatalf("%d problems, the last %v", len(es), last)
	}
}

// FuzzDecode: no input makes Parse panic, hang or answer with anything
// but a configuration or located, short problems.
func FuzzDecode(f *testing.F) {
	fs.WalkDir(configs.Files, ".", func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			data, _ := fs.ReadFile(configs.Files, path)
			f.Add(data)
		}
		return nil
	})
	f.Add([]byte(base + "rules:\n  - &r {id: 1, action: drop}\n  - *r\n"))
	f.Add([]byte(base + "---\n"))
	f.Add([]byte("{a: [b, {c: 'd''e', \"f\\\"\": # g\n h}]}"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("f.yaml", data)
		if err == nil {
			if c == nil {
				t.Fatal("no configuration and no error")
			}
			return
		}
		var es Errors
		if !errors.As(err, &es) || len(es) == 0 {
			t.Fatalf("error %v (%T), want Errors", err, err)
		}
		checkErrors(t, es)
		// The parser may place a problem just past the last line.
		lines := 1
		for _, r := range string(bytes.ReplaceAll(data, []byte("\r\n"), []byte("\n"))) {
			if isBreak(r) {
				lines++
			}
		}
		for _, e := range es {
			if e.Line > lines+1 {
				t.Errorf("line %d of a %d-line file: %v", e.Line, lines, e)
			}
		}
	})
}
