package userstack

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// twoBoxes is a scale-out group of two bridge boxes in front of one
// outside host, which reaches the service address through either box (its
// route says which, as a router's ECMP would pick). The application runs
// on box a: shared memory to a's bridge, GENEVE over a backplane link to
// b's. The outside host talks from a client address of its own, which
// each box routes back over its wire.
type twoBoxes struct {
	t       *testing.T
	out     *topology.NS
	boxes   [2]*box
	service netip.Addr
	client  netip.Addr
	secret  []byte
	logger  *slog.Logger
}

// box is one bridge box: its namespace, its wire to the outside host, its
// bridge and the control server whose configuration a restart reuses.
type box struct {
	ns     *topology.NS
	wire   *topology.Veth // A: the outside host's end
	b      *bridge.Bridge
	cfg    control.Config
	srv    *control.Server
	path   string // the control socket (box a)
	tcp    string // the control address (box b)
	listen func() (net.Listener, error)
}

func newTwoBoxes(t *testing.T) *twoBoxes {
	testenv.RequirePrivileged(t)
	g := &twoBoxes{t: t, out: topology.New(t), secret: []byte("two-boxes-shared-secret"),
		service: netip.MustParseAddr("198.18.200.1"), client: netip.MustParseAddr("198.18.201.1"),
		logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	ctx := testCtx(t, 20*time.Second)
	run := func(ns *topology.NS, args ...string) {
		t.Helper()
		if out, err := ns.Exec(ctx, args[0], args[1:]...); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out)
		}
	}
	run(g.out, "ip", "addr", "add", g.client.String()+"/32", "dev", "lo")
	for i := range g.boxes {
		ns := topology.New(t)
		wire := topology.Connect(t, g.out, ns, topology.VethOptions{})
		if err := ethtool.DisableTxChecksum(g.out, wire.A.Name); err != nil {
			t.Fatal(err)
		}
		// Replies leave through whichever box sends: the outside host
		// must take them on either wire.
		if err := g.out.Do(func() error {
			for _, dev := range []string{"all", wire.A.Name} {
				if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+dev+"/rp_filter", []byte("0"), 0); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		run(ns, "ip", "addr", "add", g.service.String()+"/32", "dev", "lo")
		run(ns, "ip", "route", "add", g.client.String()+"/32", "via", wire.A.Addr4.Addr().String())
		if err := ns.Do(func() error {
			return os.WriteFile("/proc/sys/net/ipv4/ip_local_reserved_ports", fmt.Appendf(nil, "%d-%d", e2ePorts.Lo, e2ePorts.Hi), 0)
		}); err != nil {
			t.Fatal(err)
		}
		g.boxes[i] = &box{ns: ns, wire: wire}
	}
	a, b := g.boxes[0], g.boxes[1]
	back := topology.Connect(t, a.ns, b.ns, topology.VethOptions{MTU: 1600})
	var remote *fabric.Remote
	for _, x := range g.boxes {
		if err := x.ns.Do(func() (err error) {
			x.b, err = bridge.Open(bridge.Config{Interface: x.wire.B.Name, Logger: g.logger})
			if err != nil || x != b {
				return err
			}
			remote, err = fabric.ListenRemote(netip.AddrPortFrom(back.B.Addr4.Addr(), 0), fabric.RemoteConfig{})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { x.b.Close() })
		x.cfg = control.Config{
			Dataplane: &bridgePlane{b: x.b},
			Addrs:     []netip.Addr{g.service},
			Ephemeral: e2ePorts,
			Stream:    fabric.Config{RxSlots: 1024, TxSlots: 1024},
			Secret:    g.secret,
			Logger:    g.logger,
		}
	}
	t.Cleanup(func() { remote.Close() })
	b.cfg.Remote = remote
	a.path = filepath.Join(t.TempDir(), "control.sock")
	a.listen = func() (net.Listener, error) {
		return net.ListenUnix("unix", &net.UnixAddr{Name: a.path, Net: "unix"})
	}
	b.tcp = netip.AddrPortFrom(back.B.Addr4.Addr(), 7700).String()
	b.listen = func() (l net.Listener, err error) {
		err = b.ns.Do(func() error { l, err = net.Listen("tcp", b.tcp); return err })
		return l, err
	}
	for _, x := range g.boxes {
		x.start(t)
	}
	g.via(0)
	return g
}

// start runs a control server for the box, a new one after stop.
func (x *box) start(t *testing.T) {
	t.Helper()
	srv, err := control.NewServer(x.cfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := x.listen()
	if err != nil {
		t.Fatal(err)
	}
	if x.path != "" {
		go srv.ServeLocal(l.(*net.UnixListener))
	} else {
		go srv.ServeRemote(l)
	}
	t.Cleanup(func() { srv.Close() })
	x.srv = srv
}

// stop ends the box's control server, and with it every lease: what an
// application sees of a box that dies.
func (x *box) stop() { x.srv.Close() }

// via routes the outside host's packets for the service through box i.
func (g *twoBoxes) via(i int) {
	g.t.Helper()
	hop := g.boxes[i].wire.B.Addr4.Addr().String()
	if out, err := g.out.Exec(testCtx(g.t, 5*time.Second), "ip", "route", "replace", g.service.String()+"/32", "via", hop, "src", g.client.String()); err != nil {
		g.t.Fatalf("route via box %d: %v\n%s", i, err, out)
	}
}

// open starts the application on box a, registered with both boxes.
func (g *twoBoxes) open(events func(Event)) *Stack {
	g.t.Helper()
	return g.openInstance("web-1", events)
}

// openInstance is open for instance name of the application.
func (g *twoBoxes) openInstance(name string, events func(Event)) *Stack {
	g.t.Helper()
	return g.openWith(Options{App: "web", Instance: name, Events: events})
}

// openWith starts the application on box a with opts, registered with
// both boxes.
func (g *twoBoxes) openWith(opts Options) *Stack {
	g.t.Helper()
	opts.Bridges = []Bridge{
		{Control: g.boxes[0].path},
		{Remote: &RemoteOptions{Control: g.boxes[1].tcp, Secret: g.secret}},
	}
	var s *Stack
	if err := g.boxes[0].ns.Do(func() (err error) {
		s, err = Open(testCtx(g.t, 10*time.Second), opts)
		return err
	}); err != nil {
		g.t.Fatal(err)
	}
	g.t.Cleanup(func() { s.Close() })
	return s
}

func (g *twoBoxes) dial(port int) net.Conn {
	g.t.Helper()
	var c net.Conn
	if err := g.out.Do(func() (err error) {
		d := net.Dialer{Timeout: 5 * time.Second}
		c, err = d.Dial("tcp", netip.AddrPortFrom(g.service, uint16(port)).String())
		return err
	}); err != nil {
		g.t.Fatal(err)
	}
	g.t.Cleanup(func() { c.Close() })
	return c
}

// serveEcho has s listen on addr and echo every connection until the test
// ends.
func serveEcho(t *testing.T, s *Stack, addr string) {
	t.Helper()
	l, err := s.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go echo(l)
}

// roundTrip writes msg on c and expects it echoed, leaving c open.
func roundTrip(c net.Conn, msg string) error {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if !bytes.Equal(got, []byte(msg)) {
		return fmt.Errorf("sent %q, came back %q", msg, got)
	}
	return nil
}

// TestInstanceServesThroughEitherBox: an application registered with both
// boxes of a group serves connections that arrive through either box and
// carries a connection whose packets move from one box to the other; its
// Dial'd connection gets its return traffic through the box that did not
// send its SYN; and when the box it sends through dies, it serves on
// through the other, and sends through the first again once it is back.
func TestInstanceServesThroughEitherBox(t *testing.T) {
	g := newTwoBoxes(t)
	events := &bridgeEvents{}
	s := g.open(events.add)
	for i, st := range s.Bridges() {
		if !st.Up || st.Sending != (i == 0) {
			t.Fatalf("after Open: %+v", s.Bridges())
		}
	}
	serveEcho(t, s, ":8080")

	// Through box a, then through box b: the connection made through a
	// lives on when its packets arrive through b.
	stay := g.dial(8080)
	if err := roundTrip(stay, "through a"); err != nil {
		t.Fatalf("a connection through box a: %v", err)
	}
	g.via(1)
	rxB := s.Bridges()[1].Link.RxPackets
	if err := roundTrip(g.dial(8080), "through b"); err != nil {
		t.Fatalf("a connection through box b: %v", err)
	}
	if err := roundTrip(stay, "moved to b"); err != nil {
		t.Fatalf("the connection made through box a, its packets now through b: %v", err)
	}
	if got := s.Bridges()[1].Link.RxPackets; got <= rxB {
		t.Fatalf("nothing arrived through box b's stream: %+v", s.Bridges())
	}

	// Dial: box a (the first, sending) grants the port and sends the SYN;
	// the SYN-ACK returns through box b, which steers it here only if the
	// flow was claimed there too.
	ol, err := func() (l net.Listener, err error) {
		err = g.out.Do(func() error { l, err = net.Listen("tcp", netip.AddrPortFrom(g.client, 9090).String()); return err })
		return l, err
	}()
	if err != nil {
		t.Fatal(err)
	}
	defer ol.Close()
	go echo(ol)
	dialOut := func(what string) {
		t.Helper()
		c, err := s.Dial(testCtx(t, 10*time.Second), "tcp", netip.AddrPortFrom(g.client, 9090).String())
		if err != nil {
			t.Fatalf("%s: dial: %v", what, err)
		}
		defer c.Close()
		if err := roundTrip(c, what); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	dialOut("dialled, the return through box b")

	// Box a dies: b sends, and serves old and new connections.
	g.boxes[0].stop()
	events.await(t, BridgeLost, 1)
	if !eventually(5*time.Second, func() bool { st := s.Bridges(); return !st[0].Up && st[1].Sending }) {
		t.Fatalf("box a is gone and b does not send: %+v", s.Bridges())
	}
	txB := s.Bridges()[1].TxPackets
	if err := roundTrip(stay, "a dead"); err != nil {
		t.Fatalf("an established connection after box a died: %v", err)
	}
	if err := roundTrip(g.dial(8080), "new, a dead"); err != nil {
		t.Fatalf("a new connection after box a died: %v", err)
	}
	dialOut("dialled, a dead")
	if got := s.Bridges()[1].TxPackets; got <= txB {
		t.Fatalf("nothing left through box b: %+v", s.Bridges())
	}

	// Box a is back: it is asked for the claims again and sends again.
	g.boxes[0].start(t)
	events.await(t, BridgeBack, 1)
	if !eventually(5*time.Second, func() bool { st := s.Bridges(); return st[0].Up && st[0].Sending }) {
		t.Fatalf("box a is back and does not send: %+v", s.Bridges())
	}
	txA := s.Bridges()[0].TxPackets
	if err := roundTrip(stay, "a back"); err != nil {
		t.Fatalf("an established connection after box a came back: %v", err)
	}
	g.via(0)
	if err := roundTrip(g.dial(8080), "new through a, back"); err != nil {
		t.Fatalf("a new connection through box a after it came back: %v", err)
	}
	if got := s.Bridges()[0].TxPackets; got <= txA {
		t.Fatalf("nothing left through box a once back: %+v", s.Bridges())
	}
	for _, st := range s.Bridges() {
		if st.ClaimFailures != 0 {
			t.Errorf("claims refused: %+v; events %v", st, events.events)
		}
	}
}

// TestInstanceJoinsABoxThatWasDown: a box that is down when the
// application opens its stack does not keep it from serving through the
// other; once the box is up, the stack registers with it in the
// background, asks it for the listener made meanwhile, and sends through
// it, the first of the list.
func TestInstanceJoinsABoxThatWasDown(t *testing.T) {
	g := newTwoBoxes(t)
	g.boxes[0].stop()
	events := &bridgeEvents{}
	s := g.open(events.add)
	if st := s.Bridges(); st[0].Up || !st[1].Up || !st[1].Sending {
		t.Fatalf("after Open with box a down: %+v", st)
	}
	serveEcho(t, s, ":8080")
	g.via(1)
	if err := roundTrip(g.dial(8080), "through b, a down"); err != nil {
		t.Fatalf("through box b while box a is down: %v", err)
	}
	g.boxes[0].start(t)
	events.await(t, BridgeBack, 1)
	if !eventually(5*time.Second, func() bool { st := s.Bridges(); return st[0].Up && st[0].Sending }) {
		t.Fatalf("box a is up and does not send: %+v", s.Bridges())
	}
	g.via(0)
	if err := roundTrip(g.dial(8080), "through a, joined"); err != nil {
		t.Fatalf("through box a after it joined: %v", err)
	}
	if st := s.Bridges(); st[0].Link.RxPackets == 0 || st[0].TxPackets == 0 {
		t.Fatalf("box a's stream carried nothing: %+v", st)
	}
}

// TestClaimRefusedByOneBoxIsReported: a port that another application
// holds on box b does not fail a Listen that box a granted; the refusal is
// a ClaimLost event naming box b and counted in its state, and the
// listener serves through box a.
func TestClaimRefusedByOneBoxIsReported(t *testing.T) {
	g := newTwoBoxes(t)
	var other *Stack
	if err := g.boxes[0].ns.Do(func() (err error) {
		other, err = Open(testCtx(t, 10*time.Second), Options{App: "other", Remote: &RemoteOptions{Control: g.boxes[1].tcp, Secret: g.secret}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ol, err := other.Listen("tcp", ":8081")
	if err != nil {
		t.Fatal(err)
	}
	defer ol.Close()

	events := &bridgeEvents{}
	s := g.open(events.add)
	l, err := s.Listen("tcp", ":8081")
	if err != nil {
		t.Fatalf("Listen failed for box b's refusal: %v", err)
	}
	defer l.Close()
	go echo(l)
	events.await(t, ClaimLost, 1)
	events.mu.Lock()
	lost := events.events[0]
	events.mu.Unlock()
	if lost.Kind != ClaimLost || lost.Bridge != g.boxes[1].tcp || !errors.Is(lost.Err, control.ErrPortInUse) {
		t.Fatalf("event %v, want box b's ClaimLost for a port in use", lost)
	}
	if st := s.Bridges(); st[0].ClaimFailures != 0 || st[1].ClaimFailures != 1 {
		t.Fatalf("states %+v", st)
	}
	if err := roundTrip(g.dial(8081), "through a"); err != nil {
		t.Fatalf("through box a, which granted the listener: %v", err)
	}
}
