package appliance

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// startPinned starts a daemon in the topology that pins its data path in
// bpffs.
func (tp *topo) startPinned(t *testing.T, c *config.Config, bpffs string, log *testenv.Output) *Daemon {
	t.Helper()
	var d *Daemon
	if err := tp.bridge.Do(func() (err error) {
		d, err = Start(c, Options{Log: log, BPFFS: bpffs})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return d
}

// dialOutcome dials addr from ns and says how it went: "connected",
// "refused" (the kernel reset the SYN) or "dropped" (no answer).
func dialOutcome(t *testing.T, ns *topology.NS, addr netip.AddrPort) string {
	t.Helper()
	var err error
	ns.Do(func() error {
		var c net.Conn
		if c, err = net.DialTimeout("tcp", addr.String(), 300*time.Millisecond); err == nil {
			c.Close()
		}
		return nil
	})
	var ne net.Error
	switch {
	case err == nil:
		return "connected"
	case errors.As(err, &ne) && ne.Timeout():
		return "dropped"
	case strings.Contains(err.Error(), "refused"):
		return "refused"
	}
	return err.Error()
}

// TestHandoverHoldsClaimsForTheNextDaemon: a daemon that hands over leaves
// its program steering with every claim; the next one takes the claims
// over as held, so that neither the kernel (which would reset) nor an
// application that now has the previous owner's stream id gets their
// packets; what no application claims again is released after the grace,
// and the kernel answers for it again. Close removes the pins.
func TestHandoverHoldsClaimsForTheNextDaemon(t *testing.T) {
	tp := newTopo(t)
	bpffs := testenv.BPFFS(t)
	defer func(g time.Duration) { holdGrace = g }(holdGrace)
	holdGrace = time.Second
	cfg := tp.config(t, "")
	listen := netip.AddrPortFrom(tp.v.A.Addr4.Addr(), 8080)

	log1 := &testenv.Output{}
	d1 := tp.startPinned(t, cfg, bpffs, log1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gone, err := userstack.Open(ctx, userstack.Options{App: "gone", Control: cfg.Control.Socket})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := gone.Listen("tcp", ":8080")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	if got := dialOutcome(t, tp.outside, listen); got != "connected" {
		t.Fatalf("dial the application: %s", got)
	}
	prog := tp.bridge.XDPProgram(t, tp.v.A.Name)
	if err := d1.Handover(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log1.String(), "its data path keeps steering for the next daemon") {
		t.Errorf("the daemon did not say it left its data path steering:\n%s", log1)
	}
	// The application does not come back.
	cancel()
	gone.Close()
	if id := tp.bridge.XDPProgram(t, tp.v.A.Name); id != prog {
		t.Errorf("no daemon: XDP program %d attached, want %d (the one left)", id, prog)
	}
	if got := dialOutcome(t, tp.outside, listen); got != "dropped" {
		t.Errorf("no daemon: a SYN to the application was %s, want dropped", got)
	}

	// A start that fails after taking the data path over leaves it
	// steering for the next try.
	var busy net.Listener
	if err := tp.bridge.Do(func() (err error) {
		busy, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	text, err := os.ReadFile(cfg.File)
	if err != nil {
		t.Fatal(err)
	}
	bad := loadConfigText(t, filepath.Join(tp.dir, "busy.yaml"), strings.Replace(string(text), "127.0.0.1:0", busy.Addr().String(), 1))
	if err := tp.bridge.Do(func() error {
		_, err := Start(bad, Options{Log: io.Discard, BPFFS: bpffs})
		return err
	}); err == nil {
		t.Fatal("a daemon started on a metrics address in use")
	}
	if id := tp.bridge.XDPProgram(t, tp.v.A.Name); id == 0 {
		t.Error("a failed start detached the program its predecessor left steering")
	}
	if got := dialOutcome(t, tp.outside, listen); got != "dropped" {
		t.Errorf("after a failed start: a SYN to the application was %s, want dropped", got)
	}

	log2 := &testenv.Output{}
	d2 := tp.startPinned(t, cfg, bpffs, log2)
	defer d2.Close()
	if l := log2.String(); !strings.Contains(l, "took over the data path the previous daemon left steering") || !strings.Contains(l, "held_listeners=") {
		t.Fatalf("the second daemon did not take over:\n%s", l)
	}
	// Another application gets the stream id the first one had.
	other, err := userstack.Open(context.Background(), userstack.Options{App: "other", Control: cfg.Control.Socket})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	oln, err := other.Listen("tcp", ":8081")
	if err != nil {
		t.Fatal(err)
	}
	defer oln.Close()
	if got := dialOutcome(t, tp.outside, listen); got != "dropped" {
		t.Errorf("held: a SYN to the gone application was %s, want dropped", got)
	}
	s := tp.scrape(t, d2)
	if rx := metrics.Find(s, "fabricbridge_stream_rx_packets_total", metrics.L("app", "other")...); len(rx) != 1 || rx[0].Value != 0 {
		t.Errorf("the other application received %v: the held listener misrouted", rx)
	}

	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(log2.String(), "released the held flows and listeners no application claimed again") {
		if time.Now().After(deadline) {
			t.Fatalf("the held entries were never released:\n%s", log2)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := dialOutcome(t, tp.outside, listen); got != "refused" {
		t.Errorf("released: a SYN to the gone application was %s, want refused by the kernel", got)
	}

	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}
	if id := tp.bridge.XDPProgram(t, tp.v.A.Name); id != 0 {
		t.Errorf("XDP program %d attached after Close", id)
	}
	if left, _ := filepath.Glob(filepath.Join(bpffs, "fabricbridge", "*", "*")); len(left) != 0 {
		t.Errorf("pins left after Close: %v", left)
	}
}

// TestSweepPinsOfDeletedInterfaces: at start, pins whose link attaches to
// nothing (their interface was deleted) go; those of live interfaces stay.
func TestSweepPinsOfDeletedInterfaces(t *testing.T) {
	testenv.RequirePrivileged(t)
	root := filepath.Join(testenv.BPFFS(t), "fabricbridge")
	bridge, _, live := topology.Pair(t, topology.VethOptions{})
	_, _, dead := topology.Pair(t, topology.VethOptions{})
	dirs := map[*topology.Veth]string{}
	for _, v := range []*topology.Veth{live, dead} {
		dirs[v] = filepath.Join(root, "1", v.A.Name)
		p, err := ebpf.LoadWith(ebpf.Options{PinDir: dirs[v], FlowCapacity: 1024})
		if err != nil {
			t.Fatal(err)
		}
		if err := v.A.NS.Do(func() error { _, err := p.Attach(v.A.Index, ebpf.ModeNative); return err }); err != nil {
			t.Fatal(err)
		}
		if err := p.Leave(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { ebpf.RemovePins(dirs[live]) })
	dead.A.NS.DeleteLink(t, dead.A.Name)
	removed, err := sweepPins(root)
	if err != nil || len(removed) != 1 || removed[0] != dirs[dead] {
		t.Errorf("swept %v, %v; want only %s", removed, err, dirs[dead])
	}
	if _, ok, _ := ebpf.PinnedLink(dirs[live]); !ok {
		t.Error("the live interface's pins were swept")
	}
	if id := bridge.XDPProgram(t, live.A.Name); id == 0 {
		t.Error("the live interface lost its program")
	}
}
