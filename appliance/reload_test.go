package appliance

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/userstack"
)

// TestReloadKeepsConnections: a TCP connection from the outside kernel to
// an application on a user-space stack keeps working across reloads that
// replace every static rule, and so does its listener.
func TestReloadKeepsConnections(t *testing.T) {
	tp := newTopo(t)
	before := "rules:\n  - {id: 3, name: blocked, match: {protocol: udp, dst_port: 6666}, action: drop}\n  - {id: 4, name: ssh, match: {protocol: tcp, dst_port: 22}, action: pass}\n"
	d := tp.start(t, tp.config(t, before), io.Discard)
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := userstack.Open(ctx, userstack.Options{App: "echo", Control: d.Config().Control.Socket})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ln, err := st.Listen("tcp", ":7")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	dial := func() net.Conn {
		var c net.Conn
		if err := tp.outside.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", netip.AddrPortFrom(tp.v.A.Addr4.Addr(), 7).String(), 5*time.Second)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return c
	}
	roundTrip := func(c net.Conn, msg string) {
		t.Helper()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatalf("%s: write: %v", msg, err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("%s: read %q, %v", msg, buf, err)
		}
	}
	c := dial()
	defer c.Close()
	roundTrip(c, "before the reloads")

	// Reload while data flows: every static rule replaced, twice.
	stop := make(chan struct{})
	errs := make(chan error, 1)
	go func() {
		defer close(errs)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			next := fmt.Sprintf("rules:\n  - {id: %d, name: r%d, match: {protocol: udp, dst_port: %d}, action: drop}\n", 100+i%2, i, 7000+i)
			if i%2 == 1 {
				next = before
			}
			if err := d.Reload(tp.config(t, next)); err != nil {
				errs <- err
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for i := range 200 {
		roundTrip(c, fmt.Sprintf("during reloads %d", i))
	}
	close(stop)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	roundTrip(c, "after the reloads")
	c2 := dial()
	defer c2.Close()
	roundTrip(c2, "a new connection")
	s := tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_reloads_total", "result", "ok"); v < 2 {
		t.Errorf("only %v reloads happened", v)
	}
}
