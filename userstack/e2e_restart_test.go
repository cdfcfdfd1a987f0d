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

// TestRemoteStackOutlivesItsBridge: an application on another host, over
// GENEVE, carries a download from the outside host across a restart of
// the bridge's control plane, registering again from its own namespace.
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
	go servePaced(l, want)
	addr := net.JoinHostPort(e.local4.String(), "9000")
	c, err := e.dialOutside(testCtx(t, 10*time.Second), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	x := transferStarted(t, c, want, false)
	e.restart(t)
	events.await(t, BridgeLost, 1)
	events.await(t, BridgeBack, 1)
	x.readRest()
	x.survived(t, e.dialOutside, addr)
}
