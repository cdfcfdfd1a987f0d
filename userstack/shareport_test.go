package userstack

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// TestDialOnASharedPort: an application at its ports quota gets a port its
// own connection already holds for a connection to another remote (the
// control plane shares it, the whole tuple tells the flows apart), and the
// stack binds it alongside the first: both connections carry data.
func TestDialOnASharedPort(t *testing.T) {
	w := newWorld(t)
	w.srv.Close()
	w.ln.Close()
	w.cfg.Apps = map[string]control.Policy{"a": {Addrs: addrA, MaxPorts: 1}, "b": {Addrs: addrB}}
	w.srv = w.serve(t, w.path)
	a, b := w.open(t, "a"), w.open(t, "b")
	var conns []net.Conn
	for _, port := range []string{"80", "81"} {
		l, err := b.Listen("tcp", ":"+port)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			c, err := l.Accept()
			if err != nil {
				return
			}
			io.Copy(c, c)
			c.Close()
		}()
		c, err := a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:"+port)
		if err != nil {
			t.Fatalf("dial :%s: %v", port, err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	la, lb := conns[0].LocalAddr().(*net.TCPAddr), conns[1].LocalAddr().(*net.TCPAddr)
	if la.Port != lb.Port {
		t.Fatalf("local ports %d and %d: the quota of one port was not shared", la.Port, lb.Port)
	}
	for i, c := range conns {
		msg := []byte{'x', byte('0' + i)}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != string(msg) {
			t.Fatalf("connection %d echoed %q, %v", i, got, err)
		}
	}
}
