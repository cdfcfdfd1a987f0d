// Package ippkt builds whole IP packets and Ethernet frames with correct
// lengths and checksums, the way an application's user-space stack writes
// them into a stream, so that tests and benchmarks of the bridge can hand the
// outside kernel packets it accepts. Addresses are not checked here: callers
// use the benchmark ranges inside their own namespaces.
package ippkt

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
)

// UDP is an IPv4 or IPv6 packet (by src's family) carrying one datagram.
func UDP(src, dst netip.AddrPort, payload []byte) []byte {
	u := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	return ip(src.Addr(), dst.Addr(), layers.IPProtocolUDP, u, payload)
}

// TCP is an IPv4 or IPv6 packet carrying one TCP segment with the given
// flags (SYN, ACK, ...), sequence numbers and payload.
func TCP(src, dst netip.AddrPort, seq, ack uint32, syn, ackFlag, rst bool, payload []byte) []byte {
	t := &layers.TCP{
		SrcPort: layers.TCPPort(src.Port()), DstPort: layers.TCPPort(dst.Port()),
		Seq: seq, Ack: ack, SYN: syn, ACK: ackFlag, RST: rst, Window: 65535,
	}
	return ip(src.Addr(), dst.Addr(), layers.IPProtocolTCP, t, payload)
}

type l4 interface {
	gopacket.SerializableLayer
	SetNetworkLayerForChecksum(gopacket.NetworkLayer) error
}

func ip(src, dst netip.Addr, proto layers.IPProtocol, l l4, payload []byte) []byte {
	var nl gopacket.NetworkLayer
	var top gopacket.SerializableLayer
	if src.Is4() {
		v4 := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: proto, SrcIP: net.IP(src.AsSlice()), DstIP: net.IP(dst.AsSlice()), Flags: layers.IPv4DontFragment}
		nl, top = v4, v4
	} else {
		v6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: proto, SrcIP: net.IP(src.AsSlice()), DstIP: net.IP(dst.AsSlice())}
		nl, top = v6, v6
	}
	if err := l.SetNetworkLayerForChecksum(nl); err != nil {
		panic(err)
	}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, top, l, gopacket.Payload(payload)); err != nil {
		panic(fmt.Sprintf("ippkt: %v", err))
	}
	return append([]byte(nil), buf.Bytes()...)
}

// Ether puts an Ethernet header in front of an IP packet.
func Ether(dst, src net.HardwareAddr, pkt []byte) []byte {
	f := make([]byte, 14+len(pkt))
	copy(f[0:6], dst)
	copy(f[6:12], src)
	if len(pkt) > 0 && pkt[0]>>4 == 6 {
		f[12], f[13] = 0x86, 0xdd
	} else {
		f[12], f[13] = 0x08, 0x00
	}
	copy(f[14:], pkt)
	return f
}

// Parsed is what Parse finds in an IP packet.
type Parsed struct {
	Src, Dst netip.AddrPort
	Proto    layers.IPProtocol
	Payload  []byte
	// ChecksumOK says the IPv4 header checksum (if any) and the L4 checksum
	// are right.
	ChecksumOK bool
}

// Parse decodes an IPv4 or IPv6 packet (IPv6 extension headers skipped)
// with a UDP or TCP header and checks its checksums. It is an error if the
// packet holds fewer bytes than its IP or UDP length says.
//
// Parse decodes no further than the transport header: the payload is
// whatever follows it. (Decoding on by port, as gopacket does for a whole
// packet, would fail on an ordinary datagram whose ephemeral port happens to
// be a well-known one: 44818 is EtherNet/IP's and lies in Linux's ephemeral
// range, and gopacket reports a short datagram from it as "ENIP packet data
// truncated".)
func Parse(pkt []byte) (Parsed, error) {
	var (
		v4  layers.IPv4
		v6  layers.IPv6
		ext layers.IPv6ExtensionSkipper
		udp layers.UDP
		tcp layers.TCP
	)
	first := layers.LayerTypeIPv4
	if len(pkt) > 0 && pkt[0]>>4 == 6 {
		first = layers.LayerTypeIPv6
	}
	parser := gopacket.NewDecodingLayerParser(first, &v4, &v6, &ext, &udp, &tcp)
	// Stop quietly at the first layer past the transport header.
	parser.IgnoreUnsupported = true
	var decoded []gopacket.LayerType
	if err := parser.DecodeLayers(pkt, &decoded); err != nil {
		return Parsed{}, fmt.Errorf("ippkt: %w", err)
	}
	if parser.Truncated {
		return Parsed{}, fmt.Errorf("ippkt: truncated: %d bytes hold less than the packet's lengths say", len(pkt))
	}
	var out Parsed
	var src, dst netip.Addr
	var l4 []byte // the transport header and payload, as the checksum covers them
	for _, lt := range decoded {
		switch lt {
		case layers.LayerTypeIPv4:
			src, _ = netip.AddrFromSlice(v4.SrcIP.To4())
			dst, _ = netip.AddrFromSlice(v4.DstIP.To4())
		case layers.LayerTypeIPv6:
			src, _ = netip.AddrFromSlice(v6.SrcIP)
			dst, _ = netip.AddrFromSlice(v6.DstIP)
		case layers.LayerTypeUDP:
			out.Proto = layers.IPProtocolUDP
			out.Src = netip.AddrPortFrom(src, uint16(udp.SrcPort))
			out.Dst = netip.AddrPortFrom(dst, uint16(udp.DstPort))
			out.Payload = udp.Payload
			l4 = within(pkt, udp.Contents, len(udp.Contents)+len(udp.Payload))
		case layers.LayerTypeTCP:
			out.Proto = layers.IPProtocolTCP
			out.Src = netip.AddrPortFrom(src, uint16(tcp.SrcPort))
			out.Dst = netip.AddrPortFrom(dst, uint16(tcp.DstPort))
			out.Payload = tcp.Payload
			l4 = within(pkt, tcp.Contents, len(tcp.Contents)+len(tcp.Payload))
		}
	}
	if !src.IsValid() {
		return Parsed{}, fmt.Errorf("ippkt: not IP")
	}
	if l4 == nil {
		return Parsed{}, fmt.Errorf("ippkt: no UDP or TCP header")
	}
	out.ChecksumOK = checksumsOK(pkt, l4, src, dst, uint8(out.Proto))
	return out, nil
}

// within is the n bytes of pkt that start where sub, a slice of pkt, starts.
func within(pkt, sub []byte, n int) []byte {
	off := cap(pkt) - cap(sub)
	return pkt[off : off+n]
}

// checksumsOK verifies the IPv4 header checksum and the L4 checksum over
// the pseudo-header: a correct one sums to 0xffff.
func checksumsOK(pkt, l4 []byte, src, dst netip.Addr, proto uint8) bool {
	if src.Is4() {
		ihl := int(pkt[0]&0xf) * 4
		if fold(sum(pkt[:ihl], 0)) != 0xffff {
			return false
		}
	}
	var s uint32
	s = sum(src.AsSlice(), s)
	s = sum(dst.AsSlice(), s)
	s += uint32(proto) + uint32(len(l4))
	return fold(sum(l4, s)) == 0xffff
}

func sum(b []byte, s uint32) uint32 {
	for len(b) >= 2 {
		s += uint32(b[0])<<8 | uint32(b[1])
		b = b[2:]
	}
	if len(b) == 1 {
		s += uint32(b[0]) << 8
	}
	return s
}

func fold(s uint32) uint16 {
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}
