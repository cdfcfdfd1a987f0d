package userstack

import (
	"bufio"
	"fmt"
	"io"
	"net"
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

// TestDrainedInstanceKeepsItsConnections: two instances of one application,
// both registered with both boxes, share a listener. Once B drains, its
// established connection keeps reaching it through either box, and every
// new connection goes to A, through either box; a box that restarts while
// B drains gets B's claims back and drains it again, and sends it nothing
// new either.
func TestDrainedInstanceKeepsItsConnections(t *testing.T) {
	g := newTwoBoxes(t)
	aEvents, bEvents := &bridgeEvents{}, &bridgeEvents{}
	stacks := map[string]*Stack{"A": g.openInstance("web-1", aEvents.add), "B": g.openInstance("web-2", bEvents.add)}
	for name, s := range stacks {
		l, err := s.Listen("tcp", ":8080")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go echoAs(l, name)
	}
	type conn struct {
		c  net.Conn
		in *bufio.Reader
	}
	// newConns makes n connections through the box the route names and
	// says which instance answered each.
	newConns := func(n int, what string) map[string][]conn {
		t.Helper()
		by := map[string][]conn{}
		for i := range n {
			c := g.dial(8080)
			in := bufio.NewReader(c)
			name, err := answeredBy(c, in, fmt.Sprintf("%s %d", what, i))
			if err != nil {
				t.Fatalf("%s: new connection %d: %v", what, i, err)
			}
			by[name] = append(by[name], conn{c, in})
		}
		return by
	}
	before := newConns(24, "before the drain")
	if len(before["A"]) == 0 || len(before["B"]) == 0 {
		t.Fatalf("24 connections did not spread over both instances: A %d, B %d", len(before["A"]), len(before["B"]))
	}
	onB := before["B"][0]
	stillB := func(what string) {
		t.Helper()
		if name, err := answeredBy(onB.c, onB.in, what); err != nil || name != "B" {
			t.Fatalf("%s: B's established connection: answered by %q, %v", what, name, err)
		}
	}
	onlyA := func(what string) {
		t.Helper()
		if by := newConns(16, what); len(by["B"]) != 0 {
			t.Fatalf("%s: %d of 16 new connections went to B, which drains", what, len(by["B"]))
		}
	}

	if err := stacks["B"].Drain(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	stillB("drained, through a")
	onlyA("drained, through a")
	g.via(1)
	stillB("drained, through b")
	onlyA("drained, through b")

	// Box b restarts: both instances register again and claim the
	// listener again; B drains again before its BridgeBack.
	g.boxes[1].stop()
	aEvents.await(t, BridgeLost, 1)
	bEvents.await(t, BridgeLost, 1)
	g.boxes[1].start(t)
	aEvents.await(t, BridgeBack, 1)
	bEvents.await(t, BridgeBack, 1)
	onlyA("box b restarted")
	g.via(0)
	stillB("box b restarted, through a")
	onlyA("box b restarted, through a")
	for _, st := range stacks["B"].Bridges() {
		if st.DrainFailures != 0 || st.ClaimFailures != 0 {
			t.Errorf("B's bridge %+v; events %v", st, bEvents.events)
		}
	}
}
