package userstack

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// hang makes box i look like a box whose daemon is stopped: its control
// connection takes no requests (the stack's pings, through
// Options.ping) and what its bridge sends never reaches the outside host.
// The routers have moved the traffic for the service to the other box.
type hang struct {
	g    *twoBoxes
	i    int
	hung atomic.Bool
}

// ping is Options.ping: the bridge of box i answers nothing while hung.
func (h *hang) ping(ctx context.Context, bridge string, c *control.Client) error {
	if h.hung.Load() && bridge == h.g.boxes[h.i].path {
		<-ctx.Done()
		return ctx.Err()
	}
	return c.Ping(ctx)
}

func (h *hang) set(hung bool) {
	h.g.t.Helper()
	wire := h.g.boxes[h.i].wire.A.Name
	cmds := [][]string{{"nft", "add", "table", "netdev", "hang"},
		{"nft", "add", "chain", "netdev", "hang", "in", "{ type filter hook ingress device " + wire + " priority 0; policy drop; }"}}
	if !hung {
		cmds = [][]string{{"nft", "delete", "table", "netdev", "hang"}}
	}
	for _, c := range cmds {
		if out, err := h.g.out.Exec(testCtx(h.g.t, 5*time.Second), c[0], c[1:]...); err != nil {
			h.g.t.Fatalf("%v: %v\n%s", c, err, out)
		}
	}
	h.hung.Store(hung)
}

// TestInstancePassesOverAHungBox: box a, the first of the instance's
// bridges, hangs with its control connection and its stream still open
// (issue 18). Within about a second the instance's packets leave through
// box b, which keeps answering an established connection and new ones;
// once box a answers again, they leave through it again.
func TestInstancePassesOverAHungBox(t *testing.T) {
	g := newTwoBoxes(t)
	h := &hang{g: g, i: 0}
	events := &bridgeEvents{}
	s := g.openWith(Options{App: "web", Instance: "web-1", Events: events.add, ping: h.ping})
	serveEcho(t, s, ":8080")
	stay := g.dial(8080)
	if err := roundTrip(stay, "through a"); err != nil {
		t.Fatal(err)
	}
	if st := s.Bridges(); !st[0].Sending || !st[0].Responsive || !st[1].Responsive {
		t.Fatalf("before the hang: %+v", st)
	}

	h.set(true)
	g.via(1)
	hungAt := time.Now()
	if !eventually(3*time.Second, func() bool { st := s.Bridges(); return st[1].Sending && !st[0].Responsive }) {
		t.Fatalf("box a hangs and b does not send: %+v", s.Bridges())
	}
	// probeInterval + probeTimeout, and slack for a loaded machine.
	if d := time.Since(hungAt); d > 2*time.Second {
		t.Errorf("box b sends %v after box a hung", d)
	}
	events.await(t, BridgeUnresponsive, 1)
	txB := s.Bridges()[1].TxPackets
	if err := roundTrip(stay, "a hung"); err != nil {
		t.Fatalf("an established connection while box a hangs: %v", err)
	}
	if err := roundTrip(g.dial(8080), "new, a hung"); err != nil {
		t.Fatalf("a new connection while box a hangs: %v", err)
	}
	if st := s.Bridges(); st[1].TxPackets <= txB || !st[0].Up || st[0].Unresponsive != 1 {
		t.Fatalf("while box a hangs: %+v", st)
	}

	h.set(false)
	if !eventually(3*time.Second, func() bool { st := s.Bridges(); return st[0].Sending && st[0].Responsive }) {
		t.Fatalf("box a answers again and does not send: %+v", s.Bridges())
	}
	events.await(t, BridgeResponsive, 1)
	txA := s.Bridges()[0].TxPackets
	if err := roundTrip(stay, "a answers again"); err != nil {
		t.Fatalf("the established connection once box a answers again: %v", err)
	}
	g.via(0)
	if err := roundTrip(g.dial(8080), "new through a, answering"); err != nil {
		t.Fatalf("a new connection through box a once it answers again: %v", err)
	}
	if st := s.Bridges(); st[0].TxPackets <= txA || st[0].Losses != 0 {
		t.Fatalf("once box a answers again: %+v", st)
	}
}
