package userstack

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gopacket/gopacket/layers"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// outgoing describes a segment as gVisor's TCP would hand it to the link.
type outgoing struct {
	v6      bool
	port    uint16 // the local port (the remote one is 40000)
	seq     uint32
	ack     uint32
	flags   header.TCPFlags
	payload int
	sack    bool // a SACK block in the options
	// tsVal and tsEcr are the timestamp option's values; 0 and 0: 1 and 2.
	tsVal, tsEcr uint32
	tos          uint8 // the IPv4 TOS or IPv6 traffic class
}

// build makes the packet, complete with checksums.
func (o outgoing) build() *stack.PacketBuffer {
	tsVal, tsEcr := o.tsVal, o.tsEcr
	if tsVal == 0 && tsEcr == 0 {
		tsVal, tsEcr = 1, 2
	}
	opts := []byte{header.TCPOptionNOP, header.TCPOptionNOP, header.TCPOptionTS, 10, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(opts[4:], tsVal)
	binary.BigEndian.PutUint32(opts[8:], tsEcr)
	if o.sack {
		opts = append(opts, header.TCPOptionNOP, header.TCPOptionNOP, header.TCPOptionSACK, 10, 0, 0, 1, 0, 0, 0, 2, 0)
	}
	hlen := header.TCPMinimumSize + len(opts)
	pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{
		ReserveHeaderBytes: header.IPv6MinimumSize + hlen,
		Payload:            buffer.MakeWithData(pattern(o.payload)),
	})
	tcp := header.TCP(pkt.TransportHeader().Push(hlen))
	tcp.Encode(&header.TCPFields{SrcPort: o.port, DstPort: 40000, SeqNum: o.seq, AckNum: o.ack, DataOffset: uint8(hlen), Flags: o.flags, WindowSize: 512})
	copy(tcp[header.TCPMinimumSize:], opts)
	pkt.TransportProtocolNumber = header.TCPProtocolNumber
	var src, dst tcpip.Address
	if o.v6 {
		src, dst = tcpip.AddrFromSlice(src6.AsSlice()), tcpip.AddrFromSlice(dst6.AsSlice())
		ip := header.IPv6(pkt.NetworkHeader().Push(header.IPv6MinimumSize))
		ip.Encode(&header.IPv6Fields{PayloadLength: uint16(hlen + o.payload), TransportProtocol: header.TCPProtocolNumber,
			HopLimit: 64, SrcAddr: src, DstAddr: dst, TrafficClass: o.tos})
		pkt.NetworkProtocolNumber = header.IPv6ProtocolNumber
	} else {
		src, dst = tcpip.AddrFromSlice(src4.AsSlice()), tcpip.AddrFromSlice(dst4.AsSlice())
		ip := header.IPv4(pkt.NetworkHeader().Push(header.IPv4MinimumSize))
		ip.Encode(&header.IPv4Fields{TotalLength: uint16(header.IPv4MinimumSize + hlen + o.payload), Flags: header.IPv4FlagDontFragment, TTL: 64, TOS: o.tos,
			Protocol: uint8(header.TCPProtocolNumber), SrcAddr: src, DstAddr: dst})
		ip.SetChecksum(^ip.CalculateChecksum())
		pkt.NetworkProtocolNumber = header.IPv4ProtocolNumber
	}
	xsum := header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(hlen+o.payload))
	tcp.SetChecksum(^tcp.CalculateChecksum(checksum.Combine(xsum, pkt.Data().Checksum())))
	return pkt
}

// delackLink is a link endpoint over a recording sink, and what it sent.
type delackLink struct {
	t    *testing.T
	ep   *LinkEndpoint
	sink *sinkLink
}

func newDelackLink(t *testing.T) *delackLink {
	sink := &sinkLink{keep: true}
	ep, err := NewLinkEndpoint(sink, LinkConfig{MTU: 1500})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.tx.acks.timer.Stop() })
	return &delackLink{t: t, ep: ep, sink: sink}
}

// freeze stops the hold timer, so that the test decides when holds end
// however slowly it runs; thaw starts it again.
func (d *delackLink) freeze() {
	d.ep.tx.Lock()
	defer d.ep.tx.Unlock()
	d.ep.tx.acks.timer.Stop()
	d.ep.tx.acks.armed = true // nothing rearms it
}

func (d *delackLink) thaw() {
	d.ep.tx.Lock()
	defer d.ep.tx.Unlock()
	d.ep.tx.acks.armed = true
	d.ep.tx.acks.timer.Reset(ackHold)
}

// send writes o and returns what the sink has received since.
func (d *delackLink) send(o outgoing) [][]byte {
	d.t.Helper()
	before := d.sent()
	pkt := o.build()
	defer pkt.DecRef()
	var list stack.PacketBufferList
	list.PushBack(pkt)
	if n, err := d.ep.WritePackets(list); n != 1 || err != nil {
		d.t.Fatalf("WritePackets: %d, %v", n, err)
	}
	return d.since(before)
}

func (d *delackLink) sent() int {
	d.ep.tx.Lock()
	defer d.ep.tx.Unlock()
	return len(d.sink.got)
}

func (d *delackLink) since(n int) [][]byte {
	d.ep.tx.Lock()
	defer d.ep.tx.Unlock()
	return append([][]byte(nil), d.sink.got[n:]...)
}

// ackOf reads a sent packet's acknowledgment number and payload length.
func ackOf(t *testing.T, p []byte) (ack uint32, payload int) {
	t.Helper()
	q, err := ippkt.Parse(p)
	if err != nil || !q.ChecksumOK {
		t.Fatalf("sent packet: %v, checksums ok %v", err, q.ChecksumOK)
	}
	l4 := p[header.IPv4MinimumSize:]
	if p[0]>>4 == 6 {
		l4 = p[header.IPv6MinimumSize:]
	}
	return header.TCP(l4).AckNumber(), len(q.Payload)
}

// wantSent checks that got is exactly the segments with these
// acknowledgment numbers and payload lengths, in order.
func (d *delackLink) wantSent(what string, got [][]byte, want ...[2]uint32) {
	d.t.Helper()
	var have [][2]uint32
	for _, p := range got {
		ack, n := ackOf(d.t, p)
		have = append(have, [2]uint32{ack, uint32(n)})
	}
	if fmt.Sprint(have) != fmt.Sprint(want) {
		d.t.Fatalf("%s: sent (ack, payload) %v, want %v", what, have, want)
	}
}

// waitExpiry waits for the hold timer to send n more packets.
func (d *delackLink) waitExpiry(before, n int) [][]byte {
	d.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if got := d.since(before); len(got) >= n {
			time.Sleep(3 * ackHold) // and no more
			return d.since(before)
		}
		time.Sleep(ackHold / 4)
	}
	d.t.Fatalf("the hold timer sent %d packets in 5 s, want %d", len(d.since(before)), n)
	return nil
}

func TestDelayedAckRules(t *testing.T) {
	const mss = 1500 - header.IPv6MinimumSize - header.TCPMinimumSize
	ack := header.TCPFlagAck
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprint("v6=", v6), func(t *testing.T) {
			d := newDelackLink(t)
			d.freeze()
			seg := func(ackNo uint32, flags header.TCPFlags, payload int) outgoing {
				return outgoing{v6: v6, port: 80, seq: 5000, ack: ackNo, flags: flags, payload: payload}
			}
			// A connection the table has no history for: sent.
			d.wantSent("first segment", d.send(seg(100, ack, 0)), [2]uint32{100, 0})
			// A request's ACK waits, and the answer carries it.
			d.wantSent("ACK of a request", d.send(seg(200, ack, 0)))
			d.wantSent("the answer", d.send(seg(200, ack|header.TCPFlagPsh, 1000)), [2]uint32{200, 1000})
			if s := d.ep.Stats(); s.AcksDelayed != 1 || s.AcksAbsorbed != 1 {
				t.Fatalf("after an absorbed ACK: delayed %d absorbed %d", s.AcksDelayed, s.AcksAbsorbed)
			}
			// Two full segments or more: at once (a bulk sender's ACK clock).
			d.wantSent("ACK of bulk data", d.send(seg(200+2*mss, ack, 0)), [2]uint32{200 + 2*mss, 0})
			// No advance (a window update or a duplicate): at once.
			d.wantSent("window update", d.send(seg(200+2*mss, ack, 0)), [2]uint32{200 + 2*mss, 0})
			// SACK blocks report loss: at once.
			base := uint32(200 + 2*mss)
			sack := seg(base+50, ack, 0)
			sack.sack = true
			d.wantSent("ACK with SACK blocks", d.send(sack), [2]uint32{base + 50, 0})
			base += 50
			// A second ACK that acknowledges more replaces the first.
			d.wantSent("held", d.send(seg(base+10, ack, 0)))
			d.wantSent("replacing", d.send(seg(base+20, ack, 0)))
			// One that acknowledges no more: both go, in order.
			d.wantSent("duplicate of the held", d.send(seg(base+20, ack, 0)), [2]uint32{base + 20, 0}, [2]uint32{base + 20, 0})
			// A FIN carries the held ACK.
			d.wantSent("held before FIN", d.send(seg(base+30, ack, 0)))
			d.wantSent("FIN", d.send(seg(base+31, ack|header.TCPFlagFin, 0)), [2]uint32{base + 31, 0})
			// An RST sends the held one first.
			d.wantSent("held before RST", d.send(seg(base+40, ack, 0)))
			d.wantSent("RST", d.send(seg(base+40, ack|header.TCPFlagRst, 0)), [2]uint32{base + 40, 0}, [2]uint32{base + 40, 0})
			// A held ACK nothing carries leaves on the timer, unchanged.
			plain := seg(base+60, ack, 0)
			want := plain.build()
			wantBytes := flatten(want, make([]byte, 1500))
			want.DecRef()
			before := d.sent()
			d.wantSent("held for the timer", d.send(plain))
			d.thaw()
			got := d.waitExpiry(before, 1)
			if len(got) != 1 || !bytes.Equal(got[0], wantBytes) {
				t.Fatalf("the timer sent %d packets; first equal to the held ACK: %v", len(got), len(got) > 0 && bytes.Equal(got[0], wantBytes))
			}
			if s := d.ep.Stats(); s.AcksDelayed != 6 || s.AcksAbsorbed != 3 || s.TxPackets != uint64(d.sent()) {
				t.Fatalf("stats %+v after %d packets sent", s, d.sent())
			}
		})
	}
}

// TestDelayedAckFullSet checks that a connection new to a set whose
// entries all hold an ACK sends one of them before its own segment, and
// that one holding nothing is taken first.
func TestDelayedAckFullSet(t *testing.T) {
	d := newDelackLink(t)
	d.freeze()
	keyOf := func(o outgoing) ackFlow {
		pkt := o.build()
		defer pkt.DecRef()
		s, ok := parseOut(pkt)
		if !ok {
			t.Fatal("parseOut refused a TCP segment")
		}
		return s.key
	}
	// ackWays+1 connections that share a set.
	var conns []outgoing
	home := setOf(new(keyOf(outgoing{port: 80})))
	for port := uint16(80); len(conns) <= ackWays; port++ {
		o := outgoing{port: port, ack: 100, flags: header.TCPFlagAck}
		if setOf(new(keyOf(o))) == home {
			conns = append(conns, o)
		}
	}
	for i := range conns[:ackWays] {
		d.wantSent("first", d.send(conns[i]), [2]uint32{100, 0})
		conns[i].ack = 150
		if i > 0 { // the first holds nothing
			d.wantSent("held", d.send(conns[i]))
		}
	}
	last := conns[ackWays]
	d.wantSent("new to the set: takes the entry holding nothing", d.send(last), [2]uint32{100, 0})
	if got := d.send(conns[0]); len(got) != 1 {
		t.Fatalf("the evicted connection's ACK: %d packets sent, want 1 (no history: not held)", len(got))
	}
	conns[0].ack = 200
	d.wantSent("held again", d.send(conns[0]))
	// Every entry now holds: the next newcomer must release the first.
	last.port, last.ack = 0, 7
	for port := conns[ackWays].port + 1; ; port++ {
		last.port = port
		if setOf(new(keyOf(last))) == home {
			break
		}
	}
	got := d.send(last)
	if len(got) != 2 {
		t.Fatalf("a newcomer to a full set sent %d packets, want a released ACK and its own", len(got))
	}
	if ack, _ := ackOf(t, got[0]); ack != 200 || header.TCP(got[0][header.IPv4MinimumSize:]).SourcePort() != conns[0].port {
		t.Fatalf("released ACK acknowledges %d, want conns[0]'s 200", ack)
	}
}

// TestDelayedAckDroppedOnceLinkGone checks that the timer sends nothing
// after the receive loop has ended.
func TestDelayedAckDroppedOnceLinkGone(t *testing.T) {
	d := newDelackLink(t)
	d.send(outgoing{port: 80, ack: 100, flags: header.TCPFlagAck})
	d.wantSent("held", d.send(outgoing{port: 80, ack: 200, flags: header.TCPFlagAck}))
	before := d.sent()
	close(d.ep.done)
	time.Sleep(4 * ackHold)
	if got := d.since(before); len(got) != 0 {
		t.Fatalf("%d packets sent after the link ended", len(got))
	}
}

// TestRequestAckRidesOnTheAnswer runs request/response exchanges between
// two stacks and counts the server's pure ACKs: with delayed ACKs the
// answer carries nearly every one.
func TestRequestAckRidesOnTheAnswer(t *testing.T) {
	var pureAcks, answers atomic.Int64
	tap := func(from *peer, pkt []byte) bool {
		if from.addrs[0] != addrB[0] { // not the server
			return true
		}
		p, err := ippkt.Parse(pkt)
		if err == nil && p.Proto == layers.IPProtocolTCP {
			if tcp := header.TCP(pkt[header.IPv4MinimumSize:]); tcp.Flags() == header.TCPFlagAck && len(p.Payload) == 0 {
				pureAcks.Add(1)
			} else if len(p.Payload) > 0 {
				answers.Add(1)
			}
		}
		return true
	}
	a, b := wiredPair(t, tap)
	client, conn := connBetween(t, a.s, b.s, 8080)
	go func() {
		req := make([]byte, 100)
		answer := pattern(4096)
		for {
			if _, err := io.ReadFull(conn, req); err != nil {
				return
			}
			if _, err := conn.Write(answer); err != nil {
				return
			}
		}
	}()
	const n = 200
	req, got := pattern(100), make([]byte, 4096)
	time.Sleep(10 * ackHold) // the handshake's ACKs are out of the way
	acksBefore := pureAcks.Load()
	for i := range n {
		if _, err := client.Write(req); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(client, got); err != nil {
			t.Fatalf("exchange %d: %v", i, err)
		}
	}
	acks := pureAcks.Load() - acksBefore
	st := b.s.LinkStats()
	t.Logf("%d exchanges: the server sent %d pure ACKs and %d data segments; delayed %d, absorbed %d", n, acks, answers.Load(), st.AcksDelayed, st.AcksAbsorbed)
	if acks > n/4 || st.AcksAbsorbed < 3*n/4 {
		t.Fatalf("%d exchanges: %d pure ACKs from the server, %d absorbed; want at most %d and at least %d", n, acks, st.AcksAbsorbed, n/4, 3*n/4)
	}
}

func TestDelayedAckAllocatesNothing(t *testing.T) {
	d := newDelackLink(t)
	d.freeze()
	d.sink.keep = false
	pure := outgoing{port: 80, ack: 100, flags: header.TCPFlagAck}.build()
	data := outgoing{port: 80, ack: 100, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: 1000}.build()
	defer pure.DecRef()
	defer data.DecRef()
	ack := uint32(100)
	write := func(pkt *stack.PacketBuffer) {
		if err := (linkQDisc{d.ep}).WritePacket(pkt); err != nil {
			t.Fatal(err)
		}
	}
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector (sync.Pool drops items)")
	}
	allocs := testing.AllocsPerRun(1000, func() {
		ack += 100
		header.TCP(pure.TransportHeader().Slice()).SetAckNumber(ack)
		header.TCP(data.TransportHeader().Slice()).SetAckNumber(ack)
		write(pure) // held
		write(data) // carries it
	})
	if s := d.ep.Stats(); s.AcksAbsorbed < 1000 {
		t.Fatalf("only %d of the ACKs were absorbed: the test did not exercise the hold", s.AcksAbsorbed)
	}
	if allocs != 0 {
		t.Fatalf("%v allocations per held and absorbed ACK", allocs)
	}
}

// TestDelayedAckDueWithoutTheTimer checks that the receive loop's call
// sends a held ACK once it is due, and not before: under load the timer's
// goroutine may not run for a long time.
func TestDelayedAckDueWithoutTheTimer(t *testing.T) {
	d := newDelackLink(t)
	d.send(outgoing{port: 80, ack: 100, flags: header.TCPFlagAck})
	before := d.sent()
	d.freeze()
	start := time.Now()
	d.wantSent("held", d.send(outgoing{port: 80, ack: 200, flags: header.TCPFlagAck}))
	d.ep.expireDueAcks()
	if time.Since(start) < ackHold {
		d.wantSent("before it is due", d.since(before))
	}
	time.Sleep(2 * ackHold)
	d.ep.expireDueAcks()
	d.wantSent("once due", d.since(before), [2]uint32{200, 0})
	if next := d.ep.tx.acks.next.Load(); next != noneDue {
		t.Fatalf("nothing is held, yet the next due time is %d", next)
	}
}

// TestReceiveLoopSendsDueAcks stops the server's hold timer, as a
// scheduler that never runs its goroutine would, and checks that the
// server's receive loop sends the held ACK once packets arrive after it
// is due, before the client retransmits for want of it.
func TestReceiveLoopSendsDueAcks(t *testing.T) {
	var serverAcks, requests atomic.Int64
	var retransmittedFirst atomic.Bool
	tap := func(from *peer, pkt []byte) bool {
		p, err := ippkt.Parse(pkt)
		if err != nil || p.Proto != layers.IPProtocolTCP || p.Dst.Port() != 8081 && p.Src.Port() != 8081 {
			return true
		}
		switch {
		case from.addrs[0] == addrA[0] && len(p.Payload) > 0:
			requests.Add(1)
		case from.addrs[0] == addrB[0] && len(p.Payload) == 0 && header.TCP(pkt[header.IPv4MinimumSize:]).Flags() == header.TCPFlagAck:
			if serverAcks.Add(1) == 1 && requests.Load() > 1 {
				retransmittedFirst.Store(true)
			}
		}
		return true
	}
	a, b := wiredPair(t, tap)
	client, _ := connBetween(t, a.s, b.s, 8081)
	time.Sleep(10 * ackHold) // the handshake's ACKs are out of the way
	serverAcks.Store(0)
	for _, ep := range b.s.linkEndpoints() {
		(&delackLink{t: t, ep: ep}).freeze()
	}
	if _, err := client.Write([]byte("request nobody answers")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * ackHold)
	if serverAcks.Load() != 0 {
		t.Fatal("the server's ACK left with its timer stopped and no packet arriving")
	}
	// Any packet makes the server's receive loop run a batch: a second
	// connection's.
	connBetween(t, a.s, b.s, 8082)
	deadline := time.Now().Add(5 * time.Second)
	for serverAcks.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no ACK from the server in 5 s")
		}
		time.Sleep(ackHold)
	}
	if retransmittedFirst.Load() {
		t.Fatal("the client retransmitted before the server's ACK left: the receive loop did not send it when due")
	}
}

// TestSendHeldAcksSendsEverything checks what the claim watcher calls
// before it gives claims back: every held ACK leaves, due or not.
func TestSendHeldAcksSendsEverything(t *testing.T) {
	d := newDelackLink(t)
	d.freeze()
	for port := uint16(80); port < 83; port++ {
		d.send(outgoing{port: port, ack: 100, flags: header.TCPFlagAck})
	}
	before := d.sent()
	for port := uint16(80); port < 83; port++ {
		d.wantSent("held", d.send(outgoing{port: port, ack: 200, flags: header.TCPFlagAck}))
	}
	d.ep.sendHeldAcks()
	d.wantSent("all at once", d.since(before), [2]uint32{200, 0}, [2]uint32{200, 0}, [2]uint32{200, 0})
	if next := d.ep.tx.acks.next.Load(); next != noneDue {
		t.Fatalf("nothing is held, yet the next due time is %d", next)
	}
}

// TestDelayedAckQuickAfterExpiry checks the bulk receiver's case: once a
// held ACK has had to leave on its own, the connection's ACKs go at once,
// so that a sender that waits for them (Nagle's algorithm holding back a
// write's last partial segment) does not wait a hold each time; data the
// connection sends makes its ACKs wait again.
func TestDelayedAckQuickAfterExpiry(t *testing.T) {
	ack := header.TCPFlagAck
	d := newDelackLink(t)
	d.freeze()
	seg := func(ackNo uint32, flags header.TCPFlags, payload int) outgoing {
		return outgoing{port: 80, seq: 5000, ack: ackNo, flags: flags, payload: payload}
	}
	d.wantSent("first segment", d.send(seg(100, ack, 0)), [2]uint32{100, 0})
	before := d.sent()
	d.wantSent("held", d.send(seg(200, ack, 0)))
	time.Sleep(2 * ackHold)
	d.ep.expireDueAcks()
	d.wantSent("once due", d.since(before), [2]uint32{200, 0})
	d.wantSent("after an expiry", d.send(seg(300, ack, 0)), [2]uint32{300, 0})
	d.wantSent("and the next", d.send(seg(400, ack, 0)), [2]uint32{400, 0})
	d.wantSent("data", d.send(seg(400, ack|header.TCPFlagPsh, 100)), [2]uint32{400, 100})
	d.wantSent("after sending data", d.send(seg(500, ack, 0)))
	d.wantSent("carried by the answer", d.send(seg(500, ack|header.TCPFlagPsh, 100)), [2]uint32{500, 100})
	// A new connection on the same ports starts without the old one's
	// history.
	before = d.sent()
	d.wantSent("held again", d.send(seg(600, ack, 0)))
	time.Sleep(2 * ackHold)
	d.ep.expireDueAcks()
	d.wantSent("due again", d.since(before), [2]uint32{600, 0})
	d.wantSent("SYN of a new connection", d.send(seg(9000, ack|header.TCPFlagSyn, 0)), [2]uint32{9000, 0})
	d.wantSent("its first ACK", d.send(seg(9100, ack, 0)))
	if s := d.ep.Stats(); s.AcksDelayed != 4 || s.AcksAbsorbed != 1 {
		t.Fatalf("delayed %d absorbed %d, want 4 and 1", s.AcksDelayed, s.AcksAbsorbed)
	}
}
