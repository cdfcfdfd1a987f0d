package bridge

import (
	"bytes"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// TestFlowDeltasSteer: a flow added by AddFlows steers its datagrams to its
// stream at once, with no SetTables, and after RemoveFlows the kernel gets
// them again; other tuples stay the kernel's throughout.
func TestFlowDeltasSteer(t *testing.T) {
	forEachPath(t, func(t *testing.T, cfg Config) {
		r := newRig(t, cfg)
		r.setTables(&classifier.RuleSet{})
		app := r.stream(1, classifier.Ownership{Addrs: []netip.Addr{r.local4}}, fabric.Config{})
		ks := udpSocket(t, r.br, netip.AddrPortFrom(r.local4, kernelPort))
		c := udpSocket(t, r.out, netip.AddrPortFrom(r.remote4, remotePort))
		flow := classifier.Flow{ID: 7, Protocol: classifier.ProtoUDP, Stream: 1,
			Remote: netip.AddrPortFrom(r.remote4, remotePort), Local: netip.AddrPortFrom(r.local4, kernelPort)}
		kernelGets := func(n int, what string) {
			t.Helper()
			buf := make([]byte, 2048)
			for i := range n {
				ks.SetReadDeadline(time.Now().Add(2 * time.Second))
				if _, err := ks.Read(buf); err != nil {
					t.Fatalf("%s: the kernel socket got %d of %d: %v", what, i, n, err)
				}
			}
		}
		sendTo(t, c, flow.Local, payloads(5, "before"))
		kernelGets(5, "before the flow")

		if err := r.b.AddFlows([]classifier.Flow{flow}); err != nil {
			t.Fatal(err)
		}
		if err := r.b.OwnPort(1, classifier.PortClaim{Proto: classifier.ProtoUDP, Port: kernelPort}, true); err != nil {
			t.Fatal(err)
		}
		// On the AF_PACKET path the tap copies every frame and the loop
		// classifies the copy a moment later, with the tables of that
		// moment: a "before" datagram may reach the stream too once the
		// flow exists (the kernel had it already). Count by content.
		sendTo(t, c, flow.Local, payloads(10, "steered"))
		if got := recvTagged(t, app, "steered", 10, 3*time.Second); got != 10 {
			ks.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			_, kerr := ks.Read(make([]byte, 2048))
			t.Fatalf("the stream got %d of 10 datagrams of the added flow (the kernel socket got one: %v); bridge %s, stats %+v",
				got, kerr == nil, r.b.Path(), r.b.Stats())
		}
		ks.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if n, err := ks.Read(make([]byte, 2048)); err == nil {
			t.Fatalf("the kernel got a %d-byte datagram of a steered flow", n)
		}

		if err := r.b.RemoveFlows([]classifier.Flow{flow}); err != nil {
			t.Fatal(err)
		}
		sendTo(t, c, flow.Local, payloads(5, "after"))
		kernelGets(5, "after the flow went")
		if got := recvTagged(t, app, "after", 1, 300*time.Millisecond); got != 0 {
			t.Fatal("the stream got a datagram of a removed flow")
		}
	})
}

// recvTagged receives from app for up to wait, until n packets whose
// payload holds tag have come, and returns how many did.
func recvTagged(t *testing.T, app *fabric.Stream, tag string, n int, wait time.Duration) int {
	t.Helper()
	deadline, got := time.Now().Add(wait), 0
	for got < n && time.Now().Before(deadline) {
		for _, p := range recvN(t, app, 1, time.Until(deadline)) {
			if bytes.Contains(p, []byte(tag)) {
				got++
			}
		}
	}
	return got
}
