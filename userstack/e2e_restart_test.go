package userstack

import (
	"bytes"
	"io"
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
	got := make([]byte, len(want))
	c.SetReadDeadline(time.Now().Add(60 * time.Second))
	if _, err := io.ReadFull(c, got[:1<<20]); err != nil {
		t.Fatal(err)
	}
	e.restart(t)
	events.await(t, BridgeLost, 1)
	events.await(t, BridgeBack, 1)
	if _, err := io.ReadFull(c, got[1<<20:]); err != nil {
		t.Fatalf("the download did not survive the restart: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the download survived the restart with other bytes than were sent")
	}
	c2, err := e.dialOutside(testCtx(t, time.Second), "tcp", addr)
	if err != nil {
		t.Fatalf("a new connection after the restart: %v", err)
	}
	c2.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c2, got[:1000]); err != nil || !bytes.Equal(got[:1000], want[:1000]) {
		t.Fatalf("a new connection after the restart: %v", err)
	}
	c2.Close()
}
