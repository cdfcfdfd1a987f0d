package userstack

import (
	"bytes"
	"net/netip"
	"testing"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// seg6 is an IPv6 TCP segment from src6:port to dst6:80 with the given
// flags and a valid checksum.
func seg6(port uint16, seq, ack uint32, flags header.TCPFlags, payload []byte) []byte {
	p := ippkt.TCP(netip.AddrPortFrom(src6, port), netip.AddrPortFrom(dst6, 80), seq, ack, false, true, false, payload)
	tcp := header.TCP(p[header.IPv6MinimumSize:])
	tcp.SetFlags(uint8(flags))
	tcp.SetChecksum(0)
	x := header.PseudoHeaderChecksum(header.TCPProtocolNumber, tcpip.AddrFromSlice(src6.AsSlice()), tcpip.AddrFromSlice(dst6.AsSlice()), uint16(len(tcp)))
	tcp.SetChecksum(^checksum.Checksum(tcp, x))
	return p
}

// keepingDispatcher keeps a flat copy of every packet delivered.
type keepingDispatcher struct{ pkts [][]byte }

func (d *keepingDispatcher) DeliverNetworkPacket(_ tcpip.NetworkProtocolNumber, pkt *stack.PacketBuffer) {
	d.pkts = append(d.pkts, flatten(pkt, make([]byte, pkt.Size())))
}
func (d *keepingDispatcher) DeliverLinkPacket(tcpip.NetworkProtocolNumber, *stack.PacketBuffer) {}

// TestIPv6SegmentsCoalesce feeds batches of IPv6 TCP segments through the
// receive loop and checks what reaches the stack: runs of one flow merged
// into one packet with the payload byte-exact, the length summed and PSH
// carried; everything that must not merge kept apart and in order.
func TestIPv6SegmentsCoalesce(t *testing.T) {
	const A, P = header.TCPFlagAck, header.TCPFlagAck | header.TCPFlagPsh
	type seg struct {
		port     uint16
		seq, ack uint32
		flags    header.TCPFlags
		size     int
	}
	for _, c := range []struct {
		name  string
		segs  []seg
		want  []int // payload bytes of each packet delivered, in order
		noGRO bool
	}{
		{"run ending in a short PSH", []seg{{1, 0, 9, A, 1000}, {1, 1000, 9, A, 1000}, {1, 2000, 9, A, 1000}, {1, 3000, 9, P, 300}}, []int{3300}, false},
		{"gap", []seg{{1, 0, 9, A, 1000}, {1, 1000, 9, A, 1000}, {1, 3000, 9, A, 1000}}, []int{2000, 1000}, false},
		// A pure ACK that the next segment supersedes never reaches GRO
		// (acksupersede.go); one that it does not ends the run.
		{"superseded pure ACK between", []seg{{1, 0, 9, A, 1000}, {1, 1000, 9, A, 0}, {1, 1000, 9, A, 1000}}, []int{2000}, false},
		{"pure ACK between", []seg{{1, 0, 9, A, 1000}, {1, 1000, 10, A, 0}, {1, 1000, 9, A, 1000}}, []int{1000, 0, 1000}, false},
		{"ACK number moves", []seg{{1, 0, 9, A, 1000}, {1, 1000, 10, A, 1000}}, []int{1000, 1000}, false},
		{"PSH ends", []seg{{1, 0, 9, P, 1000}, {1, 1000, 9, A, 1000}, {1, 2000, 9, A, 1000}}, []int{1000, 2000}, false},
		{"longer segment", []seg{{1, 0, 9, A, 500}, {1, 500, 9, A, 1000}}, []int{500, 1000}, false},
		{"two flows interleaved", []seg{{1, 0, 9, A, 1000}, {2, 0, 9, A, 1000}, {1, 1000, 9, A, 1000}, {2, 1000, 9, A, 1000}}, []int{1000, 1000, 1000, 1000}, false},
		{"no GRO", []seg{{1, 0, 9, A, 1000}, {1, 1000, 9, A, 1000}}, []int{1000, 1000}, true},
		{"64 KB cap", func() (s []seg) {
			for i := range 50 {
				s = append(s, seg{1, uint32(i * 1400), 9, A, 1400})
			}
			return s
		}(), []int{64400, 5600}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			var pkts [][]byte
			var payloads [][]byte
			for i, s := range c.segs {
				b := bytes.Repeat([]byte{byte(i + 1)}, s.size)
				pkts = append(pkts, seg6(40000+s.port, 1000+s.seq, s.ack, s.flags, b))
				payloads = append(payloads, b)
			}
			ep, _ := NewLinkEndpoint(&replayLink{pkts: pkts}, LinkConfig{MTU: 1500, MaxPacket: 2040, NoGRO: c.noGRO})
			d := &keepingDispatcher{}
			ep.dispatcher = d
			if err := newReceiver(ep).once(); err != nil {
				t.Fatal(err)
			}
			if len(d.pkts) != len(c.want) {
				t.Fatalf("%d packets reached the stack, want %d", len(d.pkts), len(c.want))
			}
			next := 0 // the next segment whose payload is due
			for i, p := range d.pkts {
				ip := header.IPv6(p)
				tcp := header.TCP(ip.Payload())
				data := tcp.Payload()
				if int(ip.PayloadLength()) != len(p)-header.IPv6MinimumSize || len(data) != c.want[i] {
					t.Fatalf("packet %d: IPv6 payload length %d for %d bytes, TCP payload %d, want %d", i, ip.PayloadLength(), len(p)-header.IPv6MinimumSize, len(data), c.want[i])
				}
				// Segments appear whole and in order.
				first := next
				var want []byte
				for len(want) < len(data) || (len(data) == 0 && next == first) {
					want = append(want, payloads[next]...)
					next++
				}
				if !bytes.Equal(data, want) {
					t.Fatalf("packet %d: payload is not segments %d..%d in order", i, first, next-1)
				}
				if tcp.SequenceNumber() != 1000+c.segs[first].seq {
					t.Fatalf("packet %d: sequence %d, want the first segment's", i, tcp.SequenceNumber())
				}
				last := c.segs[next-1]
				if psh := tcp.Flags()&header.TCPFlagPsh != 0; psh != (last.flags&header.TCPFlagPsh != 0) {
					t.Fatalf("packet %d: PSH %v, the last segment's %v", i, psh, !psh)
				}
			}
		})
	}
}

// TestIPv6ReceiveAllocatesNothing: coalescing IPv6 costs no allocation.
func TestIPv6ReceiveAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector (sync.Pool drops items)")
	}
	var pkts [][]byte
	for i := range 64 {
		pkts = append(pkts, seg6(40000, uint32(i*1400), 1, header.TCPFlagAck, pattern(1400)))
	}
	ep, _ := NewLinkEndpoint(&replayLink{pkts: pkts}, LinkConfig{MTU: 1500, MaxPacket: 2040})
	d := &countingDispatcher{}
	ep.dispatcher = d
	r := newReceiver(ep)
	r.once()
	if d.packets != 2 {
		t.Fatalf("64 segments reached the stack as %d packets, want 2", d.packets)
	}
	if allocs := testing.AllocsPerRun(200, func() { r.once() }); allocs != 0 {
		t.Fatalf("%.1f allocations per batch of 64 IPv6 segments", allocs)
	}
}
