package configs

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/config"
)

// TestExamplesPassCheck parses every example as `fabricbridge check` does.
func TestExamplesPassCheck(t *testing.T) {
	names, err := fs.Glob(Files, "*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	// The embedded set must be exactly the directory's files, so no
	// example escapes the check.
	onDisk, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(names, " ") != strings.Join(onDisk, " ") || len(names) < 3 {
		t.Fatalf("embedded %v, on disk %v", names, onDisk)
	}
	for _, name := range names {
		data, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := config.Parse(name, data); err != nil {
			t.Errorf("%v", err)
		}
	}
}

// TestSystemdUnit checks that the unit runs the daemon on the installed
// configuration and reloads with SIGHUP.
func TestSystemdUnit(t *testing.T) {
	data, err := os.ReadFile("fabricbridge.service")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"ExecStartPre=/usr/local/bin/fabricbridge check --config /etc/fabricbridge/fabricbridge.yaml",
		"ExecStart=/usr/local/bin/fabricbridge run --config /etc/fabricbridge/fabricbridge.yaml",
		"ExecReload=/bin/kill -HUP $MAINPID",
		"KillSignal=SIGTERM",
	} {
		if !strings.Contains(string(data), want+"\n") {
			t.Errorf("fabricbridge.service lacks %q", want)
		}
	}
}
