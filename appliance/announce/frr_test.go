package announce

import (
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/birdtest"
	"github.com/fabricbridge/fabricbridge/internal/testing/frrtest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestAnnounceToFRR is TestAnnounceToBird with FRR as the router, running
// the configuration docs/scale-out.md gives for it: ECMP over both boxes in
// both families, a box that is not ready withdrawn, a frozen box taken out
// by the 3 s hold time (FRR's BFD and GoBGP's do not get along: see
// frrtest.Config).
func TestAnnounceToFRR(t *testing.T) {
	const frrHoldBound = 4500 * time.Millisecond
	testenv.RequirePrivileged(t)
	frrtest.Require(t)

	rns, ans, bns := topology.New(t), topology.New(t), topology.New(t)
	la := topology.Connect(t, rns, ans, topology.VethOptions{})
	lb := topology.Connect(t, rns, bns, topology.VethOptions{})
	r := frrtest.Start(t, rns, birdtest.Config{
		RouterID: la.A.Addr4.Addr(), ASN: routerASN,
		Peers: []birdtest.Peer{
			{Addr4: la.B.Addr4.Addr(), Addr6: la.B.Addr6.Addr(), ASN: boxASN},
			{Addr4: lb.B.Addr4.Addr(), Addr6: lb.B.Addr6.Addr(), ASN: boxASN},
		},
	})
	a := startBox(t, "a", ans, la)
	b := startBox(t, "b", bns, lb)
	a6, b6 := la.B.Addr6.Addr(), lb.B.Addr6.Addr()
	hops := func(v4, v6 []netip.Addr) map[netip.Addr][]netip.Addr {
		return map[netip.Addr][]netip.Addr{service4: v4, service6: v6}
	}
	both := hops([]netip.Addr{a.link, b.link}, []netip.Addr{a6, b6})

	r.WaitHops(t, convergeWait, "both boxes announce: ECMP over both", both)
	for _, peer := range []netip.Addr{a.link, b6} {
		if !r.Established(t, peer) {
			t.Fatalf("the BGP session with %v is not established", peer)
		}
	}

	a.do(t, "unready")
	r.WaitHops(t, unreadyBound, "box a not ready: withdrawn", hops([]netip.Addr{b.link}, []netip.Addr{b6}))
	a.do(t, "ready")
	r.WaitHops(t, unreadyBound, "box a ready again", both)

	if err := b.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	r.WaitHops(t, frrHoldBound, "box b frozen: the hold time takes it out", hops([]netip.Addr{a.link}, []netip.Addr{a6}))
	_ = b.cmd.Process.Kill()
	a.do(t, "stop")
}
