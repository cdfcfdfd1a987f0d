package internal_test

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/fabricbridge/fabricbridge"

// TestTestHelpersStayOutOfShippedCode holds the split README.md describes:
// no non-test code outside internal/testing imports it, only the demo (and
// test tooling) imports topology, and a package directly under internal/
// is there because non-test code needs it.
func TestTestHelpersStayOutOfShippedCode(t *testing.T) {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command lists the imports: %v", err)
	}
	// Imports lists what a package's non-test files import.
	out, err := exec.Command(goCmd, "list", "-e", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", module+"/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	under := func(pkg, dir string) bool {
		return pkg == module+"/"+dir || strings.HasPrefix(pkg, module+"/"+dir+"/")
	}
	shippedUsers := map[string]bool{} // internal packages that code outside internal/testing imports
	for line := range strings.Lines(strings.TrimSpace(string(out))) {
		f := strings.Fields(line)
		pkg, imports := f[0], f[1:]
		if under(pkg, "internal/testing") {
			continue
		}
		for _, imp := range imports {
			switch {
			case under(imp, "internal/testing"):
				t.Errorf("%s imports the test helper %s", pkg, imp)
			case under(imp, "internal/topology") && !under(pkg, "internal/topology") && pkg != module+"/cmd/fabricbridge":
				t.Errorf("%s imports %s, which only the demo may ship", pkg, imp)
			}
			if !under(pkg, "internal") || under(pkg, "internal/topology") {
				shippedUsers[imp] = true
			}
		}
	}
	pkgs, err := exec.Command(goCmd, "list", module+"/internal/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, pkg := range strings.Fields(string(pkgs)) {
		if under(pkg, "internal/testing") || pkg == module+"/internal" {
			continue
		}
		if !shippedUsers[pkg] {
			t.Errorf("nothing outside internal/testing needs %s: it belongs under internal/testing", pkg)
		}
	}
}
