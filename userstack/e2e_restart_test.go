package userstack

import (
	"net"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// restart replaces the control server with a new one of the same
// configuration on the same socket and TCP address, the bridge and its
// XDP program staying: what the applications see of a daemon restart.
func (e *e2e) restart(t *testing.T) {
	t.Helper()
	e.srv.Close()
	srv, err := control.NewServer(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: e.path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var tl net.Listener
	if err := e.br.Do(func() (err error) {
		tl, err = net.Listen("tcp", e.ctlAddr)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	go srv.ServeLocal(ul)
	go srv.ServeRemote(tl)
	t.Cleanup(func() { srv.Close() })
	e.srv = srv
}

// serveGated serves want on each connection: the first MiB at once, the
// rest once gate is closed.
func serveGated(l net.Listener, want []byte, gate <-chan struct{}) {
	serveConns(l, func(c net.Conn) {
		if _, err := c.Write(want[:1<<20]); err != nil {
			return
		}
		<-gate
		c.Write(want[1<<20:])
	})
}

// TestRemoteStackOutlivesItsBridge: an application on another host, over
// GENEVE, carries a download from the outside host across a restart of
// the bridge's control plane, registering again from its own namespace.
//
// The connection is quiet while the control plane is away: what a peer
// sends before the application has claimed its flows again reaches the
// bridge host's kernel and is reset (docs/restart.md), so a download that
// kept flowing through the restart survived it or not by chance (under
// -race on a loaded VM, about one run in five, before and after delayed
// ACKs alike).
func TestRemoteStackOutlivesItsBridge(t *testing.T) {
	e := newE2E(t)
	events := &bridgeEvents{}
	var s *Stack
	if err := e.appNS.Do(func() (err error) {
		s, err = Open(testCtx(t, 10*time.Second), Options{App: "far", Remote: &RemoteOptions{Control: e.ctlAddr, Secret: e.secret}, Events: events.add})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	l, err := s.Listen("tcp", ":9000")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	want := body(16 << 20)
	gate := make(chan struct{})
	go serveGated(l, want, gate)
	addr := net.JoinHostPort(e.local4.String(), "9000")
	c, err := e.dialOutside(testCtx(t, 10*time.Second), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	x := transferStarted(t, c, want, false) // reads the first MiB, all there is
	// The client's last ACK (delayed by up to 200 ms) reaches the stack.
	time.Sleep(300 * time.Millisecond)
	e.restart(t)
	events.await(t, BridgeLost, 1)
	events.await(t, BridgeBack, 1)
	close(gate)
	x.readRest()
	x.survived(t, e.dialOutside, addr)
}
