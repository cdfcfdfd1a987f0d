package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestAppBridgeList: --bridge, once for each bridge of a scale-out group,
// becomes the stack's bridge list in order, "local" the socket --control
// names, HOST:PORT a remote bridge with the shared secret; --instance goes
// with it.
func TestAppBridgeList(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o := appOptions{kind: "http", name: "web", control: "/run/a.sock", secretFile: secret,
		bridges: []string{"local", "198.18.0.1:7070", "/run/other.sock"}}
	o.stack.Instance = "web-1"
	if err := o.resolve(); err != nil {
		t.Fatal(err)
	}
	b := o.stack.Bridges
	if len(b) != 3 || b[0].Control != "/run/a.sock" || b[1].Remote == nil || b[1].Remote.Control != "198.18.0.1:7070" ||
		string(b[1].Remote.Secret) != "s3cret" || b[2].Control != "/run/other.sock" {
		t.Fatalf("bridges %+v", b)
	}
	if o.stack.Control != "" || o.stack.Remote != nil || o.stack.Instance != "web-1" || o.stack.App != "web" {
		t.Fatalf("options %+v", o.stack)
	}

	for what, o := range map[string]appOptions{
		"neither local, path nor HOST:PORT": {bridges: []string{"local", "box-b"}, control: "/run/a.sock"},
		"remote without a secret":           {bridges: []string{"local", "198.18.0.1:7070"}, control: "/run/a.sock"},
		"--remote besides --bridge":         {bridges: []string{"local"}, remote: "198.18.0.1:7070", secretFile: secret, control: "/run/a.sock"},
		"a secret and only local bridges":   {bridges: []string{"local", "/run/b.sock"}, secretFile: secret, control: "/run/a.sock"},
	} {
		o.kind = "http"
		if err := o.resolve(); err == nil {
			t.Errorf("%s: accepted: %+v", what, o.stack.Bridges)
		}
	}
}
