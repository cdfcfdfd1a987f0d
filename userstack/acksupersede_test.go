package userstack

import (
	"bytes"
	"io"
	"net/netip"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// flat is o as the receive loop sees it: one IP packet.
func (o outgoing) flat() []byte {
	pkt := o.build()
	defer pkt.DecRef()
	v := pkt.ToView()
	defer v.Release()
	return bytes.Clone(v.AsSlice())
}

// superseded runs the superseder over pkts and reports which it drops.
func superseded(pkts [][]byte, meta []uint32) []bool {
	if meta == nil {
		meta = make([]uint32, len(pkts))
	}
	var s ackSuperseder
	skip, verdicts := make([]bool, len(pkts)), make([]verdict, len(pkts))
	s.mark(pkts, meta, verdicts, skip, len(pkts))
	return skip
}

func TestSupersededAckRules(t *testing.T) {
	const ack = header.TCPFlagAck
	pure := outgoing{port: 80, seq: 1000, ack: 5000, flags: ack, tsVal: 10, tsEcr: 20}
	request := pure
	request.flags, request.payload = ack|header.TCPFlagPsh, 120
	with := func(o outgoing, change func(*outgoing)) outgoing { change(&o); return o }
	for _, c := range []struct {
		name        string
		first, next outgoing
		want        bool
	}{
		{"request behind the ACK", pure, request, true},
		{"request behind the ACK, IPv6", with(pure, func(o *outgoing) { o.v6 = true }), with(request, func(o *outgoing) { o.v6 = true }), true},
		{"request acknowledging more", pure, with(request, func(o *outgoing) { o.ack += 3000 }), true},
		{"later timestamps", pure, with(request, func(o *outgoing) { o.tsVal, o.tsEcr = 11, 21 }), true},
		{"a FIN behind the ACK", pure, with(pure, func(o *outgoing) { o.flags |= header.TCPFlagFin }), true},
		{"a pure ACK acknowledging more", pure, with(pure, func(o *outgoing) { o.ack += 1448 }), true},
		{"a duplicate ACK behind it", pure, pure, false},
		{"a request acknowledging less", pure, with(request, func(o *outgoing) { o.ack -= 1 }), false},
		{"an earlier timestamp", pure, with(request, func(o *outgoing) { o.tsVal = 9 }), false},
		{"an earlier echoed timestamp", pure, with(request, func(o *outgoing) { o.tsEcr = 19 }), false},
		{"an ACK with SACK blocks", with(pure, func(o *outgoing) { o.sack = true }), with(request, func(o *outgoing) { o.sack = true }), false},
		{"a request with SACK blocks", pure, with(request, func(o *outgoing) { o.sack = true }), false},
		{"an ACK with ECE", with(pure, func(o *outgoing) { o.flags |= header.TCPFlagEce }), request, false},
		{"a request with CWR", pure, with(request, func(o *outgoing) { o.flags |= header.TCPFlagCwr }), false},
		{"a reset behind the ACK", pure, with(pure, func(o *outgoing) { o.flags |= header.TCPFlagRst; o.ack += 1 }), false},
		{"a segment without ACK behind it", pure, with(request, func(o *outgoing) { o.flags = header.TCPFlagPsh }), false},
		{"a keep-alive probe (one byte back)", with(pure, func(o *outgoing) { o.seq-- }), request, false},
		{"data carried by the first", with(pure, func(o *outgoing) { o.payload = 1 }), with(request, func(o *outgoing) { o.seq++ }), false},
		{"another flow", pure, with(request, func(o *outgoing) { o.port = 81 }), false},
		{"another TOS", pure, with(request, func(o *outgoing) { o.tos = 0x10 }), false},
		{"another IP version", pure, with(request, func(o *outgoing) { o.v6 = true }), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			skip := superseded([][]byte{c.first.flat(), c.next.flat()}, nil)
			if skip[0] != c.want || skip[1] {
				t.Fatalf("dropped %v; want the first dropped: %v, the second never", skip, c.want)
			}
		})
	}

	t.Run("only the flow's next segment counts", func(t *testing.T) {
		less := with(request, func(o *outgoing) { o.ack--; o.payload = 0; o.flags = ack })
		skip := superseded([][]byte{pure.flat(), less.flat(), request.flat()}, nil)
		if skip[0] || !skip[1] || skip[2] {
			t.Fatalf("dropped %v; want only the second, which the third supersedes", skip)
		}
	})
	t.Run("a corrupt request supersedes nothing", func(t *testing.T) {
		bad := request.flat()
		bad[len(bad)-1] ^= 0xff
		if skip := superseded([][]byte{pure.flat(), bad}, nil); skip[0] || skip[1] {
			t.Fatalf("dropped %v", skip)
		}
	})
	t.Run("segments the bridge may take back", func(t *testing.T) {
		pkts := [][]byte{pure.flat(), request.flat()}
		for _, meta := range [][]uint32{{fabric.MarkMayReturn, 0}, {0, fabric.MarkMayReturn}} {
			if skip := superseded(pkts, meta); skip[0] || skip[1] {
				t.Fatalf("words %#x: dropped %v", meta, skip)
			}
		}
	})
	t.Run("a batch of 32 connections", func(t *testing.T) {
		// Every connection's ACK first, then every request: the table
		// holds all 32 flows at once.
		var pkts [][]byte
		for i := range uint16(32) {
			pkts = append(pkts, with(pure, func(o *outgoing) { o.port = 1000 + i; o.v6 = i%2 == 1 }).flat())
		}
		for i := range uint16(32) {
			pkts = append(pkts, with(request, func(o *outgoing) { o.port = 1000 + i; o.v6 = i%2 == 1 }).flat())
		}
		skip := superseded(pkts, nil)
		for i, s := range skip {
			if s != (i < 32) {
				t.Fatalf("packet %d dropped: %v; want the 32 ACKs dropped and nothing else", i, s)
			}
		}
	})
}

// The receive loop delivers none of the superseded ACKs, counts them, and
// still allocates nothing.
func TestReceiveDropsSupersededAcks(t *testing.T) {
	var pkts [][]byte
	for i := range uint16(32) {
		from := netip.AddrPortFrom(src4, 40000+i)
		pkts = append(pkts,
			ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 111, 4400, false, true, false, nil),
			ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 111, 4400, false, true, false, pattern(110)))
	}
	ep, d, r := receiveBatch(t, pkts, LinkConfig{MTU: 1500, MaxPacket: 2040})
	if st := ep.Stats(); d.packets != 32 || d.bytes != 32*(20+20+110) || st.RxAcksSuperseded != 32 || st.RxPackets != 64 {
		t.Fatalf("delivered %d packets of %d bytes; stats %+v; want the 32 requests, 32 ACKs superseded", d.packets, d.bytes, st)
	}
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector (sync.Pool drops items)")
	}
	if allocs := testing.AllocsPerRun(200, func() { r.once() }); allocs != 0 {
		t.Fatalf("%.1f allocations per batch", allocs)
	}
}

// A real stack over a stream: an ACK that completes the handshake and one
// that acknowledges an answer, each followed in its batch by the next
// request, are dropped, and the connection goes on as if they had arrived:
// accepted, both requests read, the answer never sent again.
func TestSupersededAcksOnAConnection(t *testing.T) {
	s, l, b := listenerOnPair(t)
	from := netip.AddrPortFrom(netip.MustParseAddr("198.18.9.9"), 40000)
	local := netip.AddrPortFrom(addrA[0], 80)
	together := func(pkts ...[]byte) {
		t.Helper()
		if n, err := b.br.SendMeta(pkts, make([]uint32, len(pkts))); n != len(pkts) || err != nil {
			t.Fatalf("deliver: %d, %v", n, err)
		}
	}

	b.send(ippkt.TCP(from, local, 100, 0, true, false, false, nil), 0)
	synAck, _ := b.next(2 * time.Second)
	if synAck == nil || !tcpOf(t, synAck).SYN {
		t.Fatalf("no SYN-ACK: %x", synAck)
	}
	isn := tcpOf(t, synAck).Seq
	together(ippkt.TCP(from, local, 101, isn+1, false, true, false, nil),
		ippkt.TCP(from, local, 101, isn+1, false, true, false, []byte("first")))
	conn := acceptRead(t, l, "first")
	answer := pattern(4000)
	if _, err := conn.Write(answer); err != nil {
		t.Fatal(err)
	}
	var sent int
	for sent < len(answer) {
		pkt, _ := b.next(2 * time.Second)
		if pkt == nil {
			t.Fatalf("the answer stopped after %d bytes", sent)
		}
		sent += len(tcpOf(t, pkt).Payload)
	}
	acked := isn + 1 + uint32(len(answer))
	together(ippkt.TCP(from, local, 106, acked, false, true, false, nil),
		ippkt.TCP(from, local, 106, acked, false, true, false, []byte("second")))
	got := make([]byte, 6)
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "second" {
		t.Fatalf("the second request read %q, %v", got, err)
	}
	// The request's ACK alone must have freed the answer: nothing of it
	// comes again, though its retransmission timer (1 s at first) runs out.
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if pkt, _ := b.next(100 * time.Millisecond); pkt != nil && len(tcpOf(t, pkt).Payload) > 0 {
			t.Fatalf("the answer was sent again (%d bytes at %d): the request's ACK was not taken", len(tcpOf(t, pkt).Payload), tcpOf(t, pkt).Seq)
		}
	}
	if st := s.LinkStats(); st.RxAcksSuperseded != 2 {
		t.Fatalf("%d ACKs superseded; want 2 (the handshake's and the answer's)", st.RxAcksSuperseded)
	}
}
