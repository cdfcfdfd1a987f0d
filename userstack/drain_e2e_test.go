package userstack

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// answeredBy sends a line on c and says which instance echoed it (echoAs).
func answeredBy(c net.Conn, in *bufio.Reader, msg string) (string, error) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	line, err := in.ReadString('\n')
	if err != nil {
		return "", err
	}
	name, echoed, ok := strings.Cut(strings.TrimSuffix(line, "\n"), ":")
	if !ok || echoed != msg {
		return "", fmt.Errorf("sent %q, came back %q", msg, line)
	}
	return name, nil
}

// drainRig is two instances, A and B, that share a listener on port 8080
// (echoAs), and B's connection that outlives B's drain.
type drainRig struct {
	t      *testing.T
	dial   func() net.Conn // from the outside host to the listener
	stacks map[string]*Stack
	events map[string]*bridgeEvents
	onB    struct {
		c  net.Conn
		in *bufio.Reader
	}
}

// newDrainRig opens the instances with open, has them listen, and finds a
// connection that B takes.
func newDrainRig(t *testing.T, open func(instance string, events func(Event)) *Stack, dial func() net.Conn) *drainRig {
	r := &drainRig{t: t, dial: dial, stacks: map[string]*Stack{}, events: map[string]*bridgeEvents{}}
	for name, instance := range map[string]string{"A": "web-1", "B": "web-2"} {
		r.events[name] = &bridgeEvents{}
		s := open(instance, r.events[name].add)
		r.stacks[name] = s
		l, err := s.Listen("tcp", ":8080")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go echoAs(l, name)
	}
	for i := range 24 {
		c := dial()
		in := bufio.NewReader(c)
		name, err := answeredBy(c, in, fmt.Sprintf("before the drain %d", i))
		if err != nil {
			t.Fatalf("before the drain: new connection %d: %v", i, err)
		}
		if name == "B" {
			r.onB.c, r.onB.in = c, in
			return r
		}
	}
	t.Fatal("24 connections and none went to B")
	return nil
}

// stillB checks that B's connection is still answered by B.
func (r *drainRig) stillB(what string) {
	r.t.Helper()
	if name, err := answeredBy(r.onB.c, r.onB.in, what); err != nil || name != "B" {
		r.t.Fatalf("%s: B's established connection: answered by %q, %v", what, name, err)
	}
}

// onlyA checks that 16 new connections all go to A.
func (r *drainRig) onlyA(what string) {
	r.t.Helper()
	toB := 0
	for i := range 16 {
		c := r.dial()
		name, err := answeredBy(c, bufio.NewReader(c), fmt.Sprintf("%s %d", what, i))
		if err != nil {
			r.t.Fatalf("%s: new connection %d: %v", what, i, err)
		}
		if name == "B" {
			toB++
		}
		c.Close()
	}
	if toB > 0 {
		r.t.Fatalf("%s: %d of 16 new connections went to B, which drains", what, toB)
	}
}

// settle lets the segments still in flight (delayed ACKs, the closing
// handshakes of onlyA's connections) arrive before a bridge restarts: one
// that arrives while the restarted control plane has no claim installed
// yet reaches the bridge host's kernel, which resets its connection,
// drain or not.
func (r *drainRig) settle() { time.Sleep(300 * time.Millisecond) }

// drain drains B and checks that no bridge refused.
func (r *drainRig) drain() {
	r.t.Helper()
	if err := r.stacks["B"].Drain(testCtx(r.t, 5*time.Second)); err != nil {
		r.t.Fatal(err)
	}
}

// backAfterRestart waits for both instances to be back with a restarted
// bridge (BridgeBack: after B drained again there) and checks that B's
// bridges refused nothing.
func (r *drainRig) backAfterRestart() {
	r.t.Helper()
	for _, name := range []string{"A", "B"} {
		r.events[name].await(r.t, BridgeLost, 1)
		r.events[name].await(r.t, BridgeBack, 1)
	}
	for _, st := range r.stacks["B"].Bridges() {
		if st.DrainFailures != 0 || st.ClaimFailures != 0 {
			r.t.Errorf("B's bridge %+v; events %v", st, r.events["B"].events)
		}
	}
}

// TestDrainedInstanceKeepsItsConnections: two instances of one application,
// both registered with both boxes, share a listener. Once B drains, its
// established connection keeps reaching it through either box, and every
// new connection goes to A, through either box; a box that restarts while
// B drains gets B's claims back and drains it again, and sends it nothing
// new either.
func TestDrainedInstanceKeepsItsConnections(t *testing.T) {
	g := newTwoBoxes(t)
	r := newDrainRig(t, g.openInstance, func() net.Conn { return g.dial(8080) })
	r.drain()
	r.stillB("drained, through a")
	r.onlyA("drained, through a")
	g.via(1)
	r.stillB("drained, through b")
	r.onlyA("drained, through b")

	r.settle()
	g.boxes[1].stop()
	for _, name := range []string{"A", "B"} {
		r.events[name].await(t, BridgeLost, 1)
	}
	g.boxes[1].start(t)
	r.backAfterRestart()
	r.onlyA("box b restarted")
	r.stillB("box b restarted")
	g.via(0)
	r.stillB("box b restarted, through a")
	r.onlyA("box b restarted, through a")
}

// TestDrainedInstanceOneBridge: the same with one bridge, whose control
// plane restarts while B drains.
func TestDrainedInstanceOneBridge(t *testing.T) {
	e := newE2E(t)
	open := func(instance string, events func(Event)) *Stack {
		s, err := Open(testCtx(t, 10*time.Second), Options{App: "web", Instance: instance, Control: e.path, Events: events})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	dial := func() net.Conn {
		c, err := e.dialOutside(testCtx(t, 5*time.Second), "tcp", netip.AddrPortFrom(e.local4, 8080).String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	r := newDrainRig(t, open, dial)
	r.drain()
	r.stillB("drained")
	r.onlyA("drained")
	r.settle()
	e.restart(t)
	r.backAfterRestart()
	r.stillB("restarted")
	r.onlyA("restarted")
}
