package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestDrainFlagsNeedEachOther: --app without --instance, or the reverse,
// is refused before the daemon is asked anything, so that a typo never
// drains the whole box instead.
func TestDrainFlagsNeedEachOther(t *testing.T) {
	for _, args := range [][]string{{"--app", "web"}, {"--instance", "web-2"}} {
		_, stderr, status := runSelf(t, append([]string{"drain", "--admin", "/nonexistent/admin.sock"}, args...)...)
		if status != 1 || !strings.Contains(stderr, "drain: --app and --instance go together") {
			t.Errorf("drain %v: exit status %d, stderr %q", args, status, stderr)
		}
	}
}

// TestDrainInstance runs the daemon binary with two instances of web
// sharing a listener: `fabricbridge stats` shows both with their digest,
// `fabricbridge drain --app --instance` refuses an unknown instance with
// the reason and drains a known one, which stats then shows draining,
// while the box-wide drain is left alone (no bgp here: it would refuse).
func TestDrainInstance(t *testing.T) {
	testenv.RequirePrivileged(t)
	bridge, _, v := topology.Pair(t, topology.VethOptions{})
	dir := t.TempDir()
	path, sock, admin := filepath.Join(dir, "fb.yaml"), filepath.Join(dir, "control.sock"), filepath.Join(dir, "admin.sock")
	cfg := fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\ncontrol: {socket: %s, admin_socket: %s}\nmetrics: {address: \"\"}\n",
		v.A.Name, v.A.Addr4.Addr(), sock, admin)
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, bridge, "run", "--config", path)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(admin); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no admin socket:\n%s", d.out.String())
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, name := range []string{"web-1", "web-2"} {
		c, err := control.DialLocal(ctx, sock, "web")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetInstance(name)
		_, stream, err := c.RegisterLocal(ctx, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		if _, err := c.Listen(ctx, "tcp", netip.Addr{}, 8080); err != nil {
			t.Fatal(err)
		}
	}
	stats := func() string {
		t.Helper()
		out, stderr, status := runSelf(t, "stats", "--admin", admin, "--once", "--interval", "50ms")
		if status != 0 {
			t.Fatalf("stats: exit status %d: %s", status, stderr)
		}
		return out
	}
	group := regexp.MustCompile(`(?m)^ *web tcp/\*:8080 +(\S+) +(\S+) +([0-9a-f]{16})\s*$`)
	m := group.FindStringSubmatch(stats())
	if m == nil || m[1] != "web-1,web-2" || m[2] != "-" {
		t.Fatalf("stats before the drain: group %q", m)
	}
	before := m[3]

	for _, tc := range []struct {
		instance, says string
		status         int
	}{
		{"web-3", `drain: application "web" has no instance "web-3"; registered: web-1, web-2`, 1},
		{"web-2", "", 0},
	} {
		out, stderr, status := runSelf(t, "drain", "--config", path, "--app", "web", "--instance", tc.instance)
		if status != tc.status || !strings.Contains(stderr, tc.says) {
			t.Errorf("drain %s: exit status %d, stderr %q; want %d, %q", tc.instance, status, stderr, tc.status, tc.says)
		}
		if tc.status == 0 && !strings.Contains(out, "draining: instance web-2 of web") {
			t.Errorf("drain %s: %q", tc.instance, out)
		}
	}
	out := stats()
	m = group.FindStringSubmatch(out)
	if m == nil || m[1] != "web-1" || m[2] != "web-2" || m[3] == before {
		t.Errorf("stats after draining web-2: group %q (digest before %s):\n%s", m, before, out)
	}
	if !strings.Contains(out, "drains  1 started, 0 expired") {
		t.Errorf("stats does not count the drain:\n%s", out)
	}
}
