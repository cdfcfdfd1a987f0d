package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra/doc"
)

// The manual pages in docs/man are made from the command tree's help text
// (fabricbridge(8) and a page per command) and from the configuration
// reference, configs/README.md (fabricbridge.yaml(5)). `go generate
// ./cmd/fabricbridge` runs TestManPages with -update to write them.

var updateMan = flag.Bool("update", false, "write the manual pages into "+manDir)

const (
	manDir       = "../../docs/man"
	configSource = "configs/README.md"
)

// manDate is the date the pages carry: fixed, so that they change only
// when what they say changes.
var manDate = time.Date(2026, time.November, 1, 0, 0, 0, 0, time.UTC)

// writeManPages writes every page into dir.
func writeManPages(dir string) error {
	root := commandTree()
	header := &doc.GenManHeader{Section: "8", Date: &manDate, Source: "fabricbridge", Manual: "fabricbridge manual"}
	if err := doc.GenManTree(root, header, dir); err != nil {
		return err
	}
	md, err := os.ReadFile(filepath.Join("../..", configSource))
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "fabricbridge.yaml.5"), configPage(md), 0o644)
}

// TestManPages: the committed pages are what the command tree and the
// configuration reference make now.
func TestManPages(t *testing.T) {
	dir := t.TempDir()
	if err := writeManPages(dir); err != nil {
		t.Fatal(err)
	}
	made, _ := filepath.Glob(filepath.Join(dir, "*.[58]"))
	committed, _ := filepath.Glob(filepath.Join(manDir, "*.[58]"))
	if *updateMan {
		for _, p := range committed {
			os.Remove(p)
		}
		os.MkdirAll(manDir, 0o755)
		for _, p := range made {
			b, _ := os.ReadFile(p)
			if err := os.WriteFile(filepath.Join(manDir, filepath.Base(p)), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return
	}
	if len(made) < 17 {
		t.Errorf("only %d pages made", len(made))
	}
	names := func(paths []string) (n []string) {
		for _, p := range paths {
			n = append(n, filepath.Base(p))
		}
		return n
	}
	if !slices.Equal(names(made), names(committed)) {
		t.Errorf("pages made:\n%v\ncommitted in %s:\n%v\n(go generate ./cmd/fabricbridge writes them)", names(made), manDir, names(committed))
	}
	for _, p := range made {
		want, _ := os.ReadFile(p)
		got, err := os.ReadFile(filepath.Join(manDir, filepath.Base(p)))
		if err == nil && !bytes.Equal(got, want) {
			t.Errorf("%s/%s is not what the source makes now (go generate ./cmd/fabricbridge writes it)", manDir, filepath.Base(p))
		}
	}
}

// TestManPagesRender: every page formats without a warning from groff,
// and man reads it.
func TestManPagesRender(t *testing.T) {
	pages, _ := filepath.Glob(filepath.Join(manDir, "*.[58]"))
	if len(pages) == 0 {
		t.Fatal("no pages in " + manDir)
	}
	groff, err := exec.LookPath("groff")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("groff is not installed (apt-get install groff-base)")
		}
		t.Skip("groff is not installed")
	}
	man, _ := exec.LookPath("man")
	for _, p := range pages {
		var stderr bytes.Buffer
		c := exec.Command(groff, "-man", "-Tutf8", "-ww", "-z", p)
		c.Stderr = &stderr
		if err := c.Run(); err != nil || stderr.Len() > 0 {
			t.Errorf("groff %s: %v\n%s", filepath.Base(p), err, stderr.String())
		}
		if man == "" {
			continue
		}
		c = exec.Command(man, "--warnings", "-l", p)
		c.Env = append(os.Environ(), "MANWIDTH=80", "MANPAGER=cat", "PAGER=cat")
		stderr.Reset()
		c.Stderr = &stderr
		out, err := c.Output()
		if err != nil || stderr.Len() > 0 || !bytes.Contains(out, []byte("NAME")) {
			t.Errorf("man -l %s: %v\n%s\n%s", filepath.Base(p), err, stderr.String(), out)
		}
	}
	if man == "" {
		t.Log("no man; groff alone checked the pages")
	}
}

// TestConfigPageCoversReference: every field of the reference's tables is
// a tagged paragraph of fabricbridge.yaml(5), and every section a heading.
func TestConfigPageCoversReference(t *testing.T) {
	md, err := os.ReadFile(filepath.Join("../..", configSource))
	if err != nil {
		t.Fatal(err)
	}
	page := string(configPage(md))
	fields := regexp.MustCompile("(?m)^\\| `([a-z_.]+)`").FindAllStringSubmatch(string(md), -1)
	if len(fields) < 50 {
		t.Fatalf("only %d fields in the reference's tables", len(fields))
	}
	for _, f := range fields {
		if !strings.Contains(page, ".TP\n\\fB\\%"+roffEscape(f[1])+"\\fR") {
			t.Errorf("no tagged paragraph for %s", f[1])
		}
	}
	for _, h := range regexp.MustCompile("(?m)^## (.*)$").FindAllStringSubmatch(string(md), -1) {
		if !strings.Contains(page, ".SH "+roffInline(strings.ToUpper(h[1]))+"\n") {
			t.Errorf("no section %q", h[1])
		}
	}
	for _, h := range regexp.MustCompile("(?m)^### (.*)$").FindAllStringSubmatch(string(md), -1) {
		if !strings.Contains(page, ".SS "+roffInline(h[1])+"\n") {
			t.Errorf("no subsection %q", h[1])
		}
	}
	for _, want := range []string{".TH \"FABRICBRIDGE.YAML\" \"5\"", ".SH NAME\nfabricbridge.yaml \\- ", ".SH SEE ALSO\n"} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.ContainsFunc(page, func(r rune) bool { return r > 0x7e }) {
		t.Error("the page holds characters beyond ASCII: groff reads them as Latin-1")
	}
}

// configPage renders the configuration reference, the Markdown of
// configs/README.md, as the manual page fabricbridge.yaml(5). It knows
// what that file uses: headings, paragraphs, code blocks, tables (each
// row becomes a tagged paragraph: the first cell the tag, with the
// default, the last the text), `code` and **bold**.
func configPage(md []byte) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, ".\\\" Made from %s by go generate ./cmd/fabricbridge; do not edit.\n", configSource)
	fmt.Fprintf(&b, ".TH \"FABRICBRIDGE.YAML\" \"5\" \"%s\" \"fabricbridge\" \"fabricbridge manual\"\n", manDate.Format("Jan 2006"))
	b.WriteString(".SH NAME\nfabricbridge.yaml \\- configuration of the fabricbridge daemon\n")
	b.WriteString(".SH SYNOPSIS\n.B " + roffEscape(DefaultConfig) + "\n.SH DESCRIPTION\n")
	lines := strings.Split(strings.TrimRight(string(md), "\n"), "\n")
	var table [][]string
	flushTable := func() {
		if len(table) == 0 {
			return
		}
		header := table[0]
		for _, row := range table[1:] {
			tag := roffInline(row[0])
			for i := 1; i < len(row)-1 && i < len(header); i++ {
				switch {
				case row[i] == "":
				case header[i] == "default" && row[i] == "required":
					tag += " (required)"
				default:
					tag += " (" + roffInline(header[i]) + ": " + roffInline(row[i]) + ")"
				}
			}
			fmt.Fprintf(&b, ".TP\n%s\n%s\n", tag, roffInline(row[len(row)-1]))
		}
		table = nil
	}
	paragraph := false
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		if !strings.HasPrefix(line, "|") {
			flushTable()
		}
		switch {
		case strings.HasPrefix(line, "# "):
			// The title; NAME says it.
		case strings.HasPrefix(line, "## "):
			fmt.Fprintf(&b, ".SH %s\n", roffInline(strings.ToUpper(line[3:])))
			paragraph = false
		case strings.HasPrefix(line, "### "):
			fmt.Fprintf(&b, ".SS %s\n", roffInline(line[4:]))
			paragraph = false
		case strings.HasPrefix(line, "```"):
			b.WriteString(".PP\n.RS 4\n.nf\n")
			for i++; i < len(lines) && !strings.HasPrefix(lines[i], "```"); i++ {
				b.WriteString(roffLine(roffEscape(lines[i])) + "\n")
			}
			b.WriteString(".fi\n.RE\n")
			paragraph = false
		case strings.HasPrefix(line, "|"):
			cells := splitRow(line)
			if !slices.ContainsFunc(cells, func(c string) bool { return strings.Trim(c, "-:") != "" }) {
				continue // the line under the header
			}
			table = append(table, cells)
			paragraph = false
		case strings.TrimSpace(line) == "":
			paragraph = false
		default:
			if !paragraph {
				b.WriteString(".PP\n")
				paragraph = true
			}
			b.WriteString(roffLine(roffInline(line)) + "\n")
		}
	}
	flushTable()
	b.WriteString(".SH FILES\n.TP\n.B " + roffEscape(DefaultConfig) + "\nthe configuration fabricbridge run, check and stats read without \\-\\-config\n")
	b.WriteString(".SH SEE ALSO\n.BR fabricbridge (8),\n.BR fabricbridge\\-run (8),\n.BR fabricbridge\\-check (8)\n")
	return []byte(b.String())
}

// splitRow splits a table row at the pipes that are not escaped.
func splitRow(line string) []string {
	line = strings.TrimSpace(line)
	line = strings.TrimSuffix(strings.TrimPrefix(line, "|"), "|")
	var cells []string
	var cell strings.Builder
	for i := 0; i < len(line); i++ {
		switch {
		case line[i] == '\\' && i+1 < len(line) && line[i+1] == '|':
			cell.WriteByte('|')
			i++
		case line[i] == '|':
			cells = append(cells, strings.TrimSpace(cell.String()))
			cell.Reset()
		default:
			cell.WriteByte(line[i])
		}
	}
	return append(cells, strings.TrimSpace(cell.String()))
}

var (
	codeSpan = regexp.MustCompile("`([^`]*)`")
	strong   = regexp.MustCompile(`\*\*([^*]+)\*\*`)
	link     = regexp.MustCompile(`\[([^\]]+)\]\(([^)]+)\)`)
)

// roffInline renders a line of Markdown text: code and strong text in
// bold, a link as its text and its target.
func roffInline(s string) string {
	var b strings.Builder
	for {
		loc := codeSpan.FindStringSubmatchIndex(s)
		if loc == nil {
			break
		}
		b.WriteString(roffText(s[:loc[0]]))
		// \% keeps a name or a path from being hyphenated.
		b.WriteString(`\fB\%` + roffEscape(s[loc[2]:loc[3]]) + `\fR`)
		s = s[loc[1]:]
	}
	b.WriteString(roffText(s))
	return b.String()
}

// roffText renders Markdown text without code spans.
func roffText(s string) string {
	s = link.ReplaceAllString(s, "$1 ($2)")
	s = roffEscape(s)
	s = strings.ReplaceAll(s, `\-`, "-") // in prose a hyphen, not a minus
	return strong.ReplaceAllString(s, `\fB$1\fR`)
}

// roffEscape makes text literal in roff: backslashes, minus signs (for
// flags one can copy) and characters beyond ASCII, which groff would read
// as Latin-1.
func roffEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == '\\':
			b.WriteString(`\e`)
		case r == '-':
			b.WriteString(`\-`)
		case r > 0x7e:
			fmt.Fprintf(&b, `\[u%04X]`, r)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// roffLine keeps a line that starts with a control character from being
// read as a request.
func roffLine(s string) string {
	if strings.HasPrefix(s, ".") || strings.HasPrefix(s, "'") {
		return `\&` + s
	}
	return s
}
