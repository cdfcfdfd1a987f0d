package config

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"unicode/utf8"
)

// Bounds on configuration input. A configuration is written by people and
// is small; these keep a hostile or broken file (an alias bomb, a binary,
// a 10 MB scalar, 50,000 levels of nesting) from costing the daemon or
// `check` more than milliseconds and a few megabytes, and keep every
// refusal short and located.
const (
	// MaxFileSize is the largest configuration file read.
	MaxFileSize = 1 << 20
	// MaxDepth is how deeply flow collections ([...], {...}) may nest;
	// MaxIndent is the column past which no line's content may start
	// (block collections nest by indentation). The schema needs 4 levels.
	MaxDepth  = 64
	MaxIndent = 256
	// MaxScalar is the longest single value or key, in bytes.
	MaxScalar = 4096
	// MaxExpansion is how many values aliases (*name) may stand for in
	// all: an alias is decoded as often as it is used, so a few nested
	// anchors could otherwise stand for billions.
	MaxExpansion = 10_000
	// MaxErrors is how many problems are reported; the rest are counted.
	MaxErrors = 50
	// maxQuote is how much of a value an error message quotes.
	maxQuote = 40
)

// Reasons a file is refused before its fields are looked at, for
// Error.Reason and the metrics of whoever loads it.
const (
	ReasonTooBig     = "too_big"
	ReasonNotText    = "not_text"
	ReasonTooDeep    = "too_deep"
	ReasonSyntax     = "syntax"
	ReasonDocuments  = "documents"
	ReasonTooLong    = "too_long"
	ReasonAliasBomb  = "aliases"
	ReasonTooMany    = "too_many_errors"
	ReasonValue      = "value" // a field's value or the file's semantics
	ReasonUnreadable = "unreadable"
)

// Load reads and checks a configuration file. Any file that can be read
// will do (a pipe or /dev/stdin too), up to MaxFileSize bytes.
func Load(path string) (*Config, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// tooBig refuses data longer than MaxFileSize, located at the line where
// it crosses the bound.
func (d *decoder) tooBig(data []byte) bool {
	if len(data) <= MaxFileSize {
		return false
	}
	line := 1 + bytes.Count(data[:MaxFileSize], []byte("\n"))
	d.add(pos{line, 0}, "", ReasonTooBig, fmt.Sprintf("the file goes on past %d bytes (this line); a configuration may have at most that", MaxFileSize))
	return true
}

// LoadContext is Load that gives up when ctx ends: a file that does not
// come (a pipe nobody writes) must not hold up a daemon told to stop.
// The read itself goes on in the background until it ends.
func LoadContext(ctx context.Context, path string) (*Config, error) {
	type result struct {
		c   *Config
		err error
	}
	done := make(chan result, 1)
	go func() {
		c, err := Load(path)
		done <- result{c, err}
	}()
	select {
	case r := <-done:
		return r.c, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("%s: not read: %w", path, context.Cause(ctx))
	}
}

// Reason is why a configuration was refused, for a metric's label: the
// reason of its first problem, or ReasonUnreadable for an error that is
// not an Errors (the file could not be read).
func Reason(err error) string {
	if es, ok := err.(Errors); ok && len(es) > 0 && es[0].Reason != "" {
		return es[0].Reason
	}
	if _, ok := err.(Errors); ok {
		return ReasonValue
	}
	return ReasonUnreadable
}

// prescan refuses what the YAML parser should never see: bytes that are
// not UTF-8 text (binary files, NULs, control characters) and nesting
// deeper than MaxDepth or MaxIndent, each located at its line and column.
// The parser's own messages for these name no line, and deep flow nesting
// costs it time that grows with the square of the depth.
//
// The nesting it measures is an upper bound that ignores what it cannot
// see without parsing (a bracket inside a plain scalar counts), which only
// a file far beyond any real configuration could reach.
func (d *decoder) prescan(data []byte) bool {
	line, col := 1, 0
	var (
		depth     int
		quote     rune // '\'' or '"' inside a quoted scalar, else 0
		comment   bool
		indent    = true // still in the line's leading spaces and "- "
		indentCol int
		prev      rune = '\n'
	)
	fail := func(reason, format string, args ...any) bool {
		d.errs = append(d.errs, &Error{File: d.file, Line: line, Column: col, Reason: reason, Msg: fmt.Sprintf(format, args...)})
		return false
	}
	for i := 0; i < len(data); {
		r, size := utf8.DecodeRune(data[i:])
		col++
		switch {
		case r == utf8.RuneError && size == 1:
			return fail(ReasonNotText, "byte 0x%02x is not UTF-8: a configuration is UTF-8 text", data[i])
		case r == 0:
			return fail(ReasonNotText, "NUL byte: a configuration is text (is this a binary or UTF-16 file?)")
		case r < 0x20 && r != '\t' && r != '\n' && r != '\r', r == 0x7f, r >= 0x80 && r <= 0x9f && r != 0x85:
			return fail(ReasonNotText, "control character U+%04X: a configuration is text", r)
		case r == 0xfeff && i > 0:
			return fail(ReasonNotText, "byte order mark (U+FEFF) inside the file")
		}
		i += size
		if r == '\r' && i < len(data) && data[i] == '\n' {
			continue // the \n ends the line
		}
		if isBreak(r) {
			line, col, comment, indent, indentCol = line+1, 0, false, true, 0
			prev = '\n'
			continue
		}
		if indent {
			switch {
			case r == ' ' || (r == '-' && (i == len(data) || data[i] == ' ' || data[i] == '\n')) || r == 0xfeff:
				indentCol = col
				if indentCol > MaxIndent {
					return fail(ReasonTooDeep, "nested too deeply: content past column %d", MaxIndent)
				}
			default:
				indent = false
			}
		}
		switch {
		case comment:
		case quote == '"':
			if r == '\\' && i < len(data) && data[i] != '\n' {
				_, n := utf8.DecodeRune(data[i:])
				i += n
				col++
			} else if r == '"' {
				quote = 0
			}
		case quote == '\'':
			if r == '\'' {
				if i < len(data) && data[i] == '\'' {
					i++
					col++
				} else {
					quote = 0
				}
			}
		case r == '#' && (prev == ' ' || prev == '\t' || prev == '\n'):
			comment = true
		case (r == '"' || r == '\'') && strings.ContainsRune(" \t\n[{,:-?", prev):
			quote = r
		case r == '[' || r == '{':
			if depth++; depth > MaxDepth {
				return fail(ReasonTooDeep, "nested too deeply: more than %d levels of [ ] and { }", MaxDepth)
			}
		case r == ']' || r == '}':
			depth = max(depth-1, 0)
		}
		prev = r
	}
	return true
}

// isBreak reports whether YAML ends a line at r: LF, a CR not followed by
// LF, and the Unicode breaks NEL, LS and PS.
func isBreak(r rune) bool {
	return r == '\n' || r == '\r' || r == 0x85 || r == 0x2028 || r == 0x2029
}

// excerpt is s as an error message quotes it: whole if short, else its
// beginning and its length.
func excerpt(s string) string {
	if len(s) <= maxQuote {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprintf("%q… (%d bytes)", head(s), len(s))
}

// head is the beginning of s that an error message quotes: at most
// maxQuote bytes, whole characters.
func head(s string) string {
	cut := min(len(s), maxQuote)
	for cut < len(s) && cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// schemaText is text of this package's own, not of the file, that an error
// message quotes whole however long it is.
type schemaText string

// shortArgs replaces long strings among an error's arguments by their
// beginning, so that no message echoes a huge value back; schemaText is
// left whole.
func shortArgs(args []any) []any {
	for i, a := range args {
		if s, ok := a.(string); ok && len(s) > maxQuote {
			args[i] = head(s) + "…"
		}
	}
	return args
}
