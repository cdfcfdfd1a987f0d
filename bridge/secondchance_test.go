package bridge

import (
	"bytes"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// Streams of the second-chance tests: instances 1 and 2 of one application
// share the TCP listener on tcpPort1; stream 3 is another application.
const (
	scListener = 2 // the listener's rule id
	scSeed     = 0x5eed
)

// scSlots: slot 0 moved from 1 to 2, slot 1 is 1's alone, slot 2 moved
// from 2 to 1, slot 3 is 2's with itself as previous (no second chance).
var scSlots = []classifier.Slot{{Current: 2, Previous: 1}, {Current: 1}, {Current: 1, Previous: 2}, {Current: 2, Previous: 2}}

// secondChanceRig opens a rig whose tables spread tcpPort1 over streams 1
// and 2 by scSlots, and returns the application ends of streams 1, 2, 3.
func secondChanceRig(t *testing.T, cfg Config) (r *rig, apps [4]*fabric.Stream) {
	r = newRig(t, cfg)
	r.setTables(&classifier.RuleSet{Listeners: []classifier.Listener{
		{ID: scListener, Protocol: classifier.ProtoTCP, Port: tcpPort1, Stream: 1, Spread: &classifier.Spread{Seed: scSeed, Slots: scSlots}},
		{ID: 3, Protocol: classifier.ProtoUDP, Port: udpPort2, Stream: 3},
	}})
	for id := uint32(1); id <= 2; id++ {
		apps[id] = r.stream(id, r.ownership1(), fabric.Config{})
	}
	apps[3] = r.stream(3, classifier.Ownership{Addrs: []netip.Addr{r.local4}, Ports: []classifier.PortClaim{{Proto: classifier.ProtoUDP, Port: udpPort2}}}, fabric.Config{})
	return r, apps
}

// inboundIn returns an inbound TCP ACK to tcpPort1 whose flow the tables
// put in scSlots[slot], and its source.
func (r *rig) inboundIn(slot int, payload string) []byte {
	r.t.Helper()
	tab := r.b.Tables()
	for port := uint16(20000); port < 30000; port++ {
		p := ippkt.TCP(netip.AddrPortFrom(r.remote4, port), netip.AddrPortFrom(r.local4, tcpPort1), 1000, 2000, false, true, false, []byte(payload))
		if s, ok := tab.SecondChance(p); ok && s == scSlots[slot] {
			return p
		}
	}
	r.t.Fatalf("no port in 20000-29999 hashes to slot %d", slot)
	return nil
}

// recvMeta reads n packets with their words from an application's end.
func recvMeta(t *testing.T, app *fabric.Stream, n int, wait time.Duration) ([][]byte, []uint32) {
	t.Helper()
	var got [][]byte
	var words []uint32
	bufs, meta := make([][]byte, 8), make([]uint32, 8)
	for deadline := time.Now().Add(wait); len(got) < n && time.Now().Before(deadline); {
		for i := range bufs {
			bufs[i] = make([]byte, 2048)
		}
		k, err := app.TryRecvMeta(bufs, meta)
		if err != nil {
			t.Fatal(err)
		}
		if k == 0 {
			time.Sleep(time.Millisecond)
		}
		got, words = append(got, bufs[:k]...), append(words, meta[:k]...)
	}
	return got, words
}

// A packet steered by a slot with a previous owner reaches its current
// owner with MarkMayReturn next to the rule id; other packets carry the
// rule id alone, on both paths: the XDP program and the reference
// classifier steer and flag by the slots alike.
func TestSecondChanceMarksDelivery(t *testing.T) {
	forEachPath(t, func(t *testing.T, cfg Config) {
		r, apps := secondChanceRig(t, cfg)
		moved, kept, same := r.inboundIn(0, "moved"), r.inboundIn(1, "kept"), r.inboundIn(3, "same")
		eth := func(p []byte) []byte { return ippkt.Ether(r.v.A.MAC, r.v.B.MAC, p) }
		injector(t, r.out, r.v.B.Index)(eth(moved), eth(kept), eth(same))
		for _, c := range []struct {
			app  *fabric.Stream
			pkts [][]byte
			want []uint32
		}{
			{apps[2], [][]byte{moved, same}, []uint32{scListener | fabric.MarkMayReturn, scListener}},
			{apps[1], [][]byte{kept}, []uint32{scListener}},
		} {
			got, words := recvMeta(t, c.app, len(c.pkts), 3*time.Second)
			if len(got) != len(c.pkts) {
				t.Fatalf("got %d of %d packets: %+v", len(got), len(c.pkts), r.b.Stats())
			}
			for i := range got {
				if !bytes.Equal(got[i], c.pkts[i]) || words[i] != c.want[i] {
					t.Errorf("packet %d: word %#x, want %#x\n%s", i, words[i], c.want[i], r.describe(got[i]))
				}
			}
		}
	})
}

// A packet handed back with MarkNotMine goes from a slot's current owner to
// its previous one, marked, and from the previous owner back to the current
// one, unmarked, exactly as it came; nothing handed back ever reaches the
// wire, and no stream can pass a packet into a stream that does not share
// its slot: another application's stream, a slot without a previous owner,
// a packet no Spread steers. Each refusal is counted.
func TestSecondChanceHandsOn(t *testing.T) {
	forEachPath(t, func(t *testing.T, cfg Config) {
		r, apps := secondChanceRig(t, cfg)
		capt := newCapture(t, r.out, r.v.B.Index)
		toCurrent, toPrevious := r.inboundIn(0, "handback-to-2"), r.inboundIn(0, "handback-to-1")
		refused := map[uint32][][]byte{
			1: {
				r.inboundIn(1, "handback-no-previous"),
				r.inboundIn(3, "handback-previous-is-current"),
				ippkt.UDP(netip.AddrPortFrom(r.remote4, 20000), netip.AddrPortFrom(r.local4, udpPort2), []byte("handback-udp")),
				ippkt.TCP(netip.AddrPortFrom(r.remote4, 20000), netip.AddrPortFrom(r.local4, tcpPort1+1), 1, 2, false, true, false, []byte("handback-no-listener")),
			},
			3: {r.inboundIn(0, "handback-from-a-stranger"), r.inboundIn(2, "handback-from-a-stranger")},
		}
		notMine := func(n int) []uint32 {
			w := make([]uint32, n)
			for i := range w {
				w[i] = fabric.MarkNotMine | 0xffff // the rule id is the bridge's to give
			}
			return w
		}
		if _, err := apps[1].SendMeta([][]byte{toCurrent}, notMine(1)); err != nil {
			t.Fatal(err)
		}
		if _, err := apps[2].SendMeta([][]byte{toPrevious}, notMine(1)); err != nil {
			t.Fatal(err)
		}
		for id, pkts := range refused {
			if _, err := apps[id].SendMeta(pkts, notMine(len(pkts))); err != nil {
				t.Fatal(err)
			}
		}
		// A plain packet after them all: once it is out, they were handled.
		marker := ippkt.UDP(netip.AddrPortFrom(r.local4, udpPort2), netip.AddrPortFrom(r.remote4, remotePort), []byte("marker"))
		if _, err := apps[3].Send([][]byte{marker}); err != nil {
			t.Fatal(err)
		}
		frames, ok := capt.until(3*time.Second, func(f []byte) bool { return bytes.Contains(f, []byte("marker")) })
		if !ok {
			t.Fatalf("the plain packet never left: %+v", r.b.Stats())
		}
		if containsBytes(frames, []byte("handback-")) {
			t.Fatal("a handed-back packet reached the wire")
		}

		for _, c := range []struct {
			id   uint32
			pkt  []byte
			word uint32
		}{{2, toCurrent, 0}, {1, toPrevious, fabric.MarkMayReturn}} {
			got, words := recvMeta(t, apps[c.id], 1, 3*time.Second)
			if len(got) != 1 || !bytes.Equal(got[0], c.pkt) || words[0] != c.word {
				t.Fatalf("stream %d got %d packets (words %#x), want the handed-on one with word %#x", c.id, len(got), words, c.word)
			}
		}
		// Stream 3 may get the outside's ICMP error about the marker.
		if got, _ := recvMeta(t, apps[3], 2, 100*time.Millisecond); containsBytes(got, []byte("handback-")) {
			t.Fatal("stream 3 got a packet handed to it")
		}
		for _, id := range []uint32{1, 2} {
			if got, _ := recvMeta(t, apps[id], 1, 50*time.Millisecond); len(got) != 0 {
				t.Fatalf("stream %d got a refused packet:\n%s", id, r.describe(got[0]))
			}
		}
		s := r.eventually(func(s Stats) bool {
			return s.Streams[0].TxRejects.SecondChance+s.Streams[2].TxRejects.SecondChance >= 6
		})
		for i, want := range []struct{ handedOn, refused uint64 }{{1, 4}, {1, 0}, {0, 2}} {
			st := s.Streams[i]
			if st.TxHandedOn != want.handedOn || st.TxRejects.SecondChance != want.refused || st.TxRejects.Total() != want.refused {
				t.Errorf("stream %d: handed on %d, rejects %+v; want %d handed on, %d refused", st.ID, st.TxHandedOn, st.TxRejects, want.handedOn, want.refused)
			}
		}
		var queued uint64
		for _, q := range s.Queues {
			queued += q.TxRejects.SecondChance
		}
		if queued != 6 {
			t.Errorf("queues count %d second-chance rejects, want 6", queued)
		}
	})
}

// Handing a packet on allocates nothing.
func TestSecondChanceHandOnAllocatesNothing(t *testing.T) {
	r, apps := secondChanceRig(t, Config{Path: PathAFPacket, Mode: ModeStrict})
	p := r.inboundIn(0, "x")
	// A TX side of its own, so as not to share the loop's buffers; the
	// epoch it enters is the loop's, which only delays a RemoveStream.
	tx := &txSide{b: r.b, q: r.b.queueList()[0]}
	from := (*r.b.streams.Load())[1]
	bufs := [][]byte{make([]byte, 2048)}
	if n := testing.AllocsPerRun(100, func() {
		if !tx.handOn(from, p) {
			t.Fatal("not handed on")
		}
		apps[2].TryRecv(bufs)
	}); n != 0 {
		t.Errorf("handOn allocates %v times per packet", n)
	}
}
