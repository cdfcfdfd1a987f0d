package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
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
	o := appOptions{kind: "http", name: "web", control: "/run/a.sock", secretFile: secret, stacks: 1,
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
		o.kind, o.stacks = "http", 1
		if err := o.resolve(); err == nil {
			t.Errorf("%s: accepted: %+v", what, o.stack.Bridges)
		}
	}
}

// TestAppServesThroughBothBoxes: `fabricbridge app http --bridge local
// --bridge HOST:PORT` on box a registers with box a's daemon over its
// socket and with box b's over TCP and GENEVE, and serves the outside
// host's requests whichever box its route to the service goes through.
func TestAppServesThroughBothBoxes(t *testing.T) {
	testenv.RequirePrivileged(t)
	service, client := netip.MustParseAddr("198.18.200.1"), netip.MustParseAddr("198.18.201.1")
	ctx := context.Background()
	run := func(ns *topology.NS, args ...string) {
		t.Helper()
		if out, err := ns.Exec(ctx, args[0], args[1:]...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	out := topology.New(t)
	run(out, "ip", "addr", "add", client.String()+"/32", "dev", "lo")
	var ns [2]*topology.NS
	var wires [2]*topology.Veth
	for i := range ns {
		ns[i] = topology.New(t)
		wires[i] = topology.Connect(t, out, ns[i], topology.VethOptions{})
		if err := ethtool.DisableTxChecksum(out, wires[i].A.Name); err != nil {
			t.Fatal(err)
		}
		// Answers leave through box a whichever box the request came by.
		if err := out.Do(func() error {
			return os.WriteFile("/proc/sys/net/ipv4/conf/"+wires[i].A.Name+"/rp_filter", []byte("0"), 0)
		}); err != nil {
			t.Fatal(err)
		}
		run(ns[i], "ip", "addr", "add", service.String()+"/32", "dev", "lo")
		run(ns[i], "ip", "route", "add", client.String()+"/32", "via", wires[i].A.Addr4.Addr().String())
	}
	if err := out.Do(func() error { return os.WriteFile("/proc/sys/net/ipv4/conf/all/rp_filter", []byte("0"), 0) }); err != nil {
		t.Fatal(err)
	}
	back := topology.Connect(t, ns[0], ns[1], topology.VethOptions{MTU: 1600}) // room for GENEVE
	ctl := netip.AddrPortFrom(back.B.Addr4.Addr(), 7070)
	dir := t.TempDir()
	secret := filepath.Join(dir, "shared.secret")
	if err := os.WriteFile(secret, []byte("0123456789abcdef-cluster\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	paths := [2]string{filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")}
	texts := [2]string{
		fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\nmetrics: {address: \"\"}\ncontrol: {socket: %s}\n",
			wires[0].B.Name, service, filepath.Join(dir, "a.sock")),
		fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\nmetrics: {address: \"\"}\ncontrol:\n  socket: %s\n  tcp: {address: %q, auth: secret, secret_file: %s}\n",
			wires[1].B.Name, service, filepath.Join(dir, "b.sock"), ctl, secret),
	}
	for i := range paths {
		if err := os.WriteFile(paths[i], []byte(texts[i]), 0o644); err != nil {
			t.Fatal(err)
		}
		cfg, err := config.Load(paths[i])
		if err != nil {
			t.Fatal(err)
		}
		var d *appliance.Daemon
		if err := ns[i].Do(func() (err error) { d, err = appliance.Start(cfg, appliance.Options{Log: io.Discard}); return err }); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
	}

	appCtx, cancel := context.WithCancel(ctx)
	defer cancel() // before runAppIn's cleanup waits for the application to end
	log := runAppIn(t, appCtx, ns[0], "http", "--name", "web", "--config", paths[0], "--size", "5",
		"--bridge", "local", "--bridge", ctl.String(), "--secret-file", secret, "--instance", "web-1")
	if s := log.String(); !strings.Contains(s, "bridge "+ctl.String()+" up true") || !strings.Contains(s, "sending through bridge "+filepath.Join(dir, "a.sock")) {
		t.Fatalf("the application does not report both bridges up, sending through box a:\n%s", s)
	}
	hc := newClient(out)
	defer hc.CloseIdleConnections()
	for i, w := range wires {
		run(out, "ip", "route", "replace", service.String()+"/32", "via", w.B.Addr4.Addr().String(), "src", client.String())
		resp, err := hc.Get("http://" + service.String() + "/")
		if err != nil {
			t.Fatalf("GET through box %d: %v\n%s", i, err, log.String())
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(body) != "fabri" {
			t.Fatalf("GET through box %d: %q, %v", i, body, err)
		}
	}
}
