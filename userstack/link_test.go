package userstack

import (
	"bytes"
	"net/netip"
	"reflect"
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// sinkLink accepts everything; keep, when set, records copies.
type sinkLink struct {
	keep    bool
	got     [][]byte
	batches int
	packets int
}

func (l *sinkLink) Send(pkts [][]byte) (int, error) {
	l.batches++
	l.packets += len(pkts)
	if l.keep {
		for _, p := range pkts {
			l.got = append(l.got, bytes.Clone(p))
		}
	}
	return len(pkts), nil
}

func (l *sinkLink) Recv([][]byte) (int, error) { select {} }

var (
	src4 = netip.MustParseAddr("198.18.0.1")
	dst4 = netip.MustParseAddr("198.18.1.1")
	src6 = netip.MustParseAddr("2001:db8::1")
	dst6 = netip.MustParseAddr("2001:db8::99")
)

// offloadPacket builds what gVisor's TCP hands a host-GSO link: IP and TCP
// headers with a partial checksum in front of a payload larger than one
// segment.
func offloadPacket(t testing.TB, v6 bool, payload []byte, mss uint16, flags header.TCPFlags) *stack.PacketBuffer {
	return offloadPacketOf(t, v6, buffer.MakeWithData(payload), mss, flags)
}

// offloadPacketOf is offloadPacket with the payload in the views of data.
func offloadPacketOf(t testing.TB, v6 bool, data buffer.Buffer, mss uint16, flags header.TCPFlags) *stack.PacketBuffer {
	payload := data.Size()
	pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{
		ReserveHeaderBytes: header.IPv6MinimumSize + header.TCPMinimumSize,
		Payload:            data,
	})
	tcp := header.TCP(pkt.TransportHeader().Push(header.TCPMinimumSize))
	tcp.Encode(&header.TCPFields{SrcPort: 40000, DstPort: 80, SeqNum: 1000, AckNum: 77, DataOffset: 20, Flags: flags, WindowSize: 512})
	tcp.SetChecksum(0x1234) // partial: must be replaced
	pkt.GSOOptions = stack.GSO{Type: stack.GSOTCPv4, NeedsCsum: true, CsumOffset: 16, MSS: mss, L3HdrLen: 20, MaxSize: gsoMaxSize}
	if v6 {
		pkt.GSOOptions.Type = stack.GSOTCPv6
		ip := header.IPv6(pkt.NetworkHeader().Push(header.IPv6MinimumSize))
		ip.Encode(&header.IPv6Fields{PayloadLength: uint16(20 + payload), TransportProtocol: header.TCPProtocolNumber,
			HopLimit: 64, SrcAddr: tcpip.AddrFromSlice(src6.AsSlice()), DstAddr: tcpip.AddrFromSlice(dst6.AsSlice())})
		pkt.NetworkProtocolNumber = header.IPv6ProtocolNumber
	} else {
		ip := header.IPv4(pkt.NetworkHeader().Push(header.IPv4MinimumSize))
		ip.Encode(&header.IPv4Fields{TotalLength: uint16(40 + payload), ID: 100, Flags: header.IPv4FlagDontFragment, TTL: 64,
			Protocol: uint8(header.TCPProtocolNumber), SrcAddr: tcpip.AddrFromSlice(src4.AsSlice()), DstAddr: tcpip.AddrFromSlice(dst4.AsSlice())})
		ip.SetChecksum(^ip.CalculateChecksum())
		pkt.NetworkProtocolNumber = header.IPv4ProtocolNumber
	}
	return pkt
}

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i>>8)
	}
	return b
}

func TestSegmentationLikeTSO(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		sink := &sinkLink{keep: true}
		ep, err := NewLinkEndpoint(sink, LinkConfig{MTU: 1500, MaxPacket: 2040})
		if err != nil {
			t.Fatal(err)
		}
		payload := pattern(60000)
		const mss = 1440
		pkt := offloadPacket(t, v6, payload, mss, header.TCPFlagAck|header.TCPFlagPsh|header.TCPFlagFin|header.TCPFlagCwr)
		var list stack.PacketBufferList
		list.PushBack(pkt)
		if n, err := ep.WritePackets(list); n != 1 || err != nil {
			t.Fatalf("WritePackets: %d %v", n, err)
		}
		want := (len(payload) + mss - 1) / mss
		if len(sink.got) != want {
			t.Fatalf("v6=%v: %d segments, want %d", v6, len(sink.got), want)
		}
		if sink.batches != (want+63)/64 {
			t.Errorf("%d Send calls for %d segments: not batched", sink.batches, want)
		}
		var joined []byte
		for i, seg := range sink.got {
			p, err := ippkt.Parse(seg)
			if err != nil || !p.ChecksumOK {
				t.Fatalf("segment %d: %v, checksums ok=%v", i, err, p.ChecksumOK)
			}
			if len(seg) > 1500 {
				t.Fatalf("segment %d is %d bytes, over the MTU", i, len(seg))
			}
			var tcp *layers.TCP
			first := layers.LayerTypeIPv4
			if v6 {
				first = layers.LayerTypeIPv6
			}
			g := gopacket.NewPacket(seg, first, gopacket.Default)
			tcp = g.Layer(layers.LayerTypeTCP).(*layers.TCP)
			if tcp.Seq != 1000+uint32(len(joined)) {
				t.Fatalf("segment %d seq %d, want %d", i, tcp.Seq, 1000+len(joined))
			}
			last := i == len(sink.got)-1
			if tcp.FIN != last || tcp.PSH != last || tcp.CWR != (i == 0) || !tcp.ACK || tcp.Ack != 77 {
				t.Fatalf("segment %d flags FIN=%v PSH=%v CWR=%v ACK=%v", i, tcp.FIN, tcp.PSH, tcp.CWR, tcp.ACK)
			}
			if !v6 {
				ip := g.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
				if ip.Id != 100+uint16(i) {
					t.Fatalf("segment %d IPv4 id %d", i, ip.Id)
				}
			}
			joined = append(joined, tcp.Payload...)
		}
		if !bytes.Equal(joined, payload) {
			t.Fatalf("v6=%v: segments do not add up to the payload", v6)
		}
		if s := ep.Stats(); s.TxPackets != uint64(want) || s.TxSegmented != 1 {
			t.Fatalf("stats %+v", s)
		}
		pkt.DecRef()
	}
}

// TestSegmentationAcrossViews cuts an offload packet whose payload lies in
// views of odd sizes, as a send buffer built from many writes holds it:
// segments are copied straight from the views, across their edges.
func TestSegmentationAcrossViews(t *testing.T) {
	for _, v6 := range []bool{false, true} {
		sink := &sinkLink{keep: true}
		ep, err := NewLinkEndpoint(sink, LinkConfig{MTU: 1500, MaxPacket: 2040})
		if err != nil {
			t.Fatal(err)
		}
		payload := pattern(20000)
		var data buffer.Buffer
		for off, i := 0, 0; off < len(payload); i++ {
			n := min([]int{1, 1439, 3, 5000, 17, 2890}[i%6], len(payload)-off)
			data.Append(buffer.NewViewWithData(payload[off : off+n]))
			off += n
		}
		const mss = 1440
		pkt := offloadPacketOf(t, v6, data, mss, header.TCPFlagAck|header.TCPFlagPsh)
		var list stack.PacketBufferList
		list.PushBack(pkt)
		if n, err := ep.WritePackets(list); n != 1 || err != nil {
			t.Fatalf("WritePackets: %d %v", n, err)
		}
		var joined []byte
		for i, seg := range sink.got {
			p, err := ippkt.Parse(seg)
			if err != nil || !p.ChecksumOK {
				t.Fatalf("v6=%v segment %d: %v, checksums ok=%v", v6, i, err, p.ChecksumOK)
			}
			joined = append(joined, p.Payload...)
		}
		if want := (len(payload) + mss - 1) / mss; len(sink.got) != want || !bytes.Equal(joined, payload) {
			t.Fatalf("v6=%v: %d segments (want %d) adding up to %d bytes that match: %v", v6, len(sink.got), want, len(joined), bytes.Equal(joined, payload))
		}
		pkt.DecRef()
	}
}

func TestSmallOffloadPacketGetsItsChecksum(t *testing.T) {
	sink := &sinkLink{keep: true}
	ep, _ := NewLinkEndpoint(sink, LinkConfig{})
	pkt := offloadPacket(t, false, []byte("hello"), 1460, header.TCPFlagAck|header.TCPFlagPsh)
	defer pkt.DecRef()
	var list stack.PacketBufferList
	list.PushBack(pkt)
	ep.WritePackets(list)
	if len(sink.got) != 1 {
		t.Fatalf("%d packets", len(sink.got))
	}
	if p, err := ippkt.Parse(sink.got[0]); err != nil || !p.ChecksumOK || string(p.Payload) != "hello" {
		t.Fatalf("%+v %v", p, err)
	}
}

func TestMalformedOffloadPacketIsDroppedAlone(t *testing.T) {
	sink := &sinkLink{keep: true}
	ep, _ := NewLinkEndpoint(sink, LinkConfig{})
	bad := offloadPacket(t, false, pattern(5000), 1460, header.TCPFlagAck)
	defer bad.DecRef()
	bad.NetworkHeader().Slice()[9] = uint8(header.UDPProtocolNumber) // not TCP after all
	good := offloadPacket(t, false, []byte("ok"), 1460, header.TCPFlagAck)
	defer good.DecRef()
	var list stack.PacketBufferList
	list.PushBack(bad)
	list.PushBack(good)
	n, err := ep.WritePackets(list)
	if err != nil || n != 1 || len(sink.got) != 1 || ep.Stats().TxDropped != 1 {
		t.Fatalf("n=%d err=%v sent=%d stats=%+v", n, err, len(sink.got), ep.Stats())
	}
}

func TestWritePacketsAllocatesNothing(t *testing.T) {
	sink := &sinkLink{}
	ep, _ := NewLinkEndpoint(sink, LinkConfig{MTU: 1500, MaxPacket: 2040})
	var list stack.PacketBufferList
	big := offloadPacket(t, false, pattern(60000), 1448, header.TCPFlagAck)
	defer big.DecRef()
	list.PushBack(big)
	for range 8 {
		p := offloadPacket(t, true, pattern(100), 1440, header.TCPFlagAck)
		defer p.DecRef()
		list.PushBack(p)
	}
	ep.WritePackets(list) // warm up
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector (sync.Pool drops items)")
	}
	sent := sink.packets
	allocs := testing.AllocsPerRun(200, func() { ep.WritePackets(list) })
	perRun := sink.packets - sent
	if allocs != 0 {
		t.Fatalf("%.1f allocations per WritePackets of %d packets", allocs, perRun/201)
	}
}

// replayLink hands out the same batch of packets on every Recv.
type replayLink struct{ pkts [][]byte }

func (l *replayLink) Send(pkts [][]byte) (int, error) { return len(pkts), nil }
func (l *replayLink) Recv(bufs [][]byte) (int, error) {
	n := min(len(bufs), len(l.pkts))
	for i := range n {
		bufs[i] = bufs[i][:copy(bufs[i][:cap(bufs[i])], l.pkts[i])]
	}
	return n, nil
}

// countingDispatcher stands in for the stack.
type countingDispatcher struct{ packets, bytes int }

// receiveBatch has a receiver over cfg take pkts as one batch and hand it
// to a countingDispatcher; the receiver goes on replaying the same batch.
func receiveBatch(t testing.TB, pkts [][]byte, cfg LinkConfig) (*LinkEndpoint, *countingDispatcher, *receiver) {
	t.Helper()
	ep, err := NewLinkEndpoint(&replayLink{pkts: pkts}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d := &countingDispatcher{}
	ep.dispatcher = d
	r := newReceiver(ep)
	if err := r.once(); err != nil {
		t.Fatal(err)
	}
	return ep, d, r
}

func (d *countingDispatcher) DeliverNetworkPacket(_ tcpip.NetworkProtocolNumber, pkt *stack.PacketBuffer) {
	d.packets++
	d.bytes += pkt.Size()
}
func (d *countingDispatcher) DeliverLinkPacket(tcpip.NetworkProtocolNumber, *stack.PacketBuffer) {}

func TestReceiveAllocatesNothingAndCoalesces(t *testing.T) {
	// 48 in-order segments of one flow, 16 UDP datagrams.
	var pkts [][]byte
	seq := uint32(1)
	for range 48 {
		pkts = append(pkts, ippkt.TCP(netip.AddrPortFrom(dst4, 80), netip.AddrPortFrom(src4, 40000), seq, 1, false, true, false, pattern(1400)))
		seq += 1400
	}
	for range 16 {
		pkts = append(pkts, ippkt.UDP(netip.AddrPortFrom(dst6, 53), netip.AddrPortFrom(src6, 40001), pattern(300)))
	}
	ep, d, r := receiveBatch(t, pkts, LinkConfig{MTU: 1500, MaxPacket: 2040})
	// The stack's own addresses, as a stack's link has them: every packet
	// is checked against them.
	ep.local = newLocalAddrs([]netip.Addr{dst4, dst6})
	// GRO merges the TCP segments into packets of up to 64 KB; all bytes
	// arrive either way.
	wantBytes := 0
	for _, p := range pkts {
		wantBytes += len(p)
	}
	if d.packets >= len(pkts) || d.packets < 17 {
		t.Fatalf("%d packets reached the stack from %d: GRO did not coalesce", d.packets, len(pkts))
	}
	if d.bytes > wantBytes || d.bytes < 48*1400+16*(300+48) {
		t.Fatalf("%d bytes reached the stack, sent %d", d.bytes, wantBytes)
	}
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector (sync.Pool drops items)")
	}
	allocs := testing.AllocsPerRun(200, func() {
		if err := r.once(); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%.1f allocations per batch of %d received packets", allocs, len(pkts))
	}
}

func TestNotIPIsDropped(t *testing.T) {
	link := &replayLink{pkts: [][]byte{{0x00, 1, 2, 3}, {}}}
	ep, _ := NewLinkEndpoint(link, LinkConfig{})
	d := &countingDispatcher{}
	ep.dispatcher = d
	r := newReceiver(ep)
	r.once()
	if d.packets != 0 || ep.Stats().RxNotIP != 2 {
		t.Fatalf("delivered %d, stats %+v", d.packets, ep.Stats())
	}
}

func TestLinkConfigChecked(t *testing.T) {
	for _, cfg := range []LinkConfig{{MTU: 1000}, {MTU: 1500, MaxPacket: 1400}, {Batch: 65}} {
		if _, err := NewLinkEndpoint(&sinkLink{}, cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
	if _, err := NewLinkEndpoint(nil, LinkConfig{}); err == nil {
		t.Error("nil link accepted")
	}
	ep, _ := NewLinkEndpoint(&sinkLink{}, LinkConfig{MTU: 1500, MaxPacket: 2040})
	ep.SetMTU(9000)
	if ep.MTU() != 2040 {
		t.Errorf("MTU grew to %d beyond the slot", ep.MTU())
	}
}

// BenchmarkLinkTransmit: one 60 KB offload packet cut into 42 segments
// (checksums included) and sent, per iteration.
func BenchmarkLinkTransmit(b *testing.B) {
	ep, _ := NewLinkEndpoint(&sinkLink{}, LinkConfig{MTU: 1500, MaxPacket: 2040})
	pkt := offloadPacket(b, false, pattern(60000), 1448, header.TCPFlagAck)
	defer pkt.DecRef()
	var list stack.PacketBufferList
	list.PushBack(pkt)
	b.ReportAllocs()
	b.SetBytes(60000)
	for b.Loop() {
		ep.WritePackets(list)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*42), "ns/segment")
}

// BenchmarkLinkReceive: a batch of 64 packets (48 TCP segments of one flow,
// 16 UDP datagrams) checked, wrapped, coalesced and handed up.
func BenchmarkLinkReceive(b *testing.B) {
	// bulk: 48 full segments of one flow, which GRO coalesces, and 16
	// datagrams. requests: what a server of many keep-alive connections
	// receives, a request and a pure ACK from each of 32 flows. superseded:
	// the pure ACK of the last answer, then the next request, which makes
	// the ACK redundant (acksupersede.go).
	var bulk, requests, superseded [][]byte
	seq := uint32(1)
	for range 48 {
		bulk = append(bulk, ippkt.TCP(netip.AddrPortFrom(dst4, 80), netip.AddrPortFrom(src4, 40000), seq, 1, false, true, false, pattern(1448)))
		seq += 1448
	}
	for range 16 {
		bulk = append(bulk, ippkt.UDP(netip.AddrPortFrom(dst4, 53), netip.AddrPortFrom(src4, 40001), pattern(300)))
	}
	for i := range uint16(32) {
		from := netip.AddrPortFrom(src4, 40000+i)
		requests = append(requests,
			ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 1, 1, false, true, false, pattern(110)),
			ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 111, 4400, false, true, false, nil))
		superseded = append(superseded,
			ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 111, 4400, false, true, false, nil),
			ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 111, 4400, false, true, false, pattern(110)))
	}
	for _, bc := range []struct {
		name string
		pkts [][]byte
	}{{"bulk", bulk}, {"requests", requests}, {"superseded", superseded}} {
		b.Run(bc.name, func(b *testing.B) {
			ep, _ := NewLinkEndpoint(&replayLink{pkts: bc.pkts}, LinkConfig{MTU: 1500, MaxPacket: 2040})
			ep.dispatcher = &countingDispatcher{}
			r := newReceiver(ep)
			b.ReportAllocs()
			for b.Loop() {
				r.once()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(bc.pkts)), "ns/packet")
		})
	}
}

// A stack of several bridges sums its NICs' counters with LinkStats.add,
// which must not leave one out.
func TestLinkStatsAddCoversEveryCounter(t *testing.T) {
	var one LinkStats
	v := reflect.ValueOf(&one).Elem()
	for i := range v.NumField() {
		v.Field(i).SetUint(uint64(i + 1))
	}
	var sum LinkStats
	sum.add(one)
	sum.add(one)
	s := reflect.ValueOf(sum)
	for i := range s.NumField() {
		if got := s.Field(i).Uint(); got != 2*uint64(i+1) {
			t.Errorf("%s: sum %d, want %d", s.Type().Field(i).Name, got, 2*(i+1))
		}
	}
}

// Every segment of a batch reaches the stack with the batch, however many
// flows share one of GRO's buckets: gVisor's GRO.Flush alone hands up only
// one packet per bucket (see flushGRO).
func TestGROHoldsNothing(t *testing.T) {
	// gVisor picks a bucket from the sum of address and port bytes, modulo
	// 8: ports 8 apart share one. 24 flows, each a full segment (which GRO
	// holds for the next one) and none with PSH.
	var pkts [][]byte
	for i := range uint16(24) {
		from := netip.AddrPortFrom(src4, 40000+8*i)
		pkts = append(pkts, ippkt.TCP(from, netip.AddrPortFrom(dst4, 80), 1, 1, false, true, false, pattern(1400)))
	}
	_, d, _ := receiveBatch(t, pkts, LinkConfig{MTU: 1500, MaxPacket: 2040})
	if d.packets != len(pkts) {
		t.Fatalf("%d of the batch's %d segments reached the stack; GRO held the rest", d.packets, len(pkts))
	}
}
