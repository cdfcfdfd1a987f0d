package ippkt

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket/layers"
)

var (
	a4 = netip.MustParseAddr("198.18.0.1")
	b4 = netip.MustParseAddr("198.18.0.2")
	a6 = netip.MustParseAddr("2001:db8::1")
	b6 = netip.MustParseAddr("2001:db8::2")
)

func TestParseRoundTrip(t *testing.T) {
	payload := []byte("round trip")
	for _, c := range []struct {
		name     string
		pkt      []byte
		src, dst netip.AddrPort
		proto    layers.IPProtocol
	}{
		{"udp4", UDP(netip.AddrPortFrom(a4, 40000), netip.AddrPortFrom(b4, 7000), payload), netip.AddrPortFrom(a4, 40000), netip.AddrPortFrom(b4, 7000), layers.IPProtocolUDP},
		{"udp6", UDP(netip.AddrPortFrom(a6, 40000), netip.AddrPortFrom(b6, 7000), payload), netip.AddrPortFrom(a6, 40000), netip.AddrPortFrom(b6, 7000), layers.IPProtocolUDP},
		{"tcp4", TCP(netip.AddrPortFrom(a4, 40000), netip.AddrPortFrom(b4, 8080), 1, 2, false, true, false, payload), netip.AddrPortFrom(a4, 40000), netip.AddrPortFrom(b4, 8080), layers.IPProtocolTCP},
		{"tcp6", TCP(netip.AddrPortFrom(a6, 40000), netip.AddrPortFrom(b6, 8080), 1, 2, false, true, false, payload), netip.AddrPortFrom(a6, 40000), netip.AddrPortFrom(b6, 8080), layers.IPProtocolTCP},
	} {
		p, err := Parse(c.pkt)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if p.Src != c.src || p.Dst != c.dst || p.Proto != c.proto || !bytes.Equal(p.Payload, payload) || !p.ChecksumOK {
			t.Fatalf("%s: parsed %+v", c.name, p)
		}
		c.pkt[len(c.pkt)-1] ^= 0xff
		if p, err := Parse(c.pkt); err != nil || p.ChecksumOK {
			t.Fatalf("%s: a flipped payload byte: %+v %v, want a bad checksum", c.name, p, err)
		}
	}
}

// TestParseEveryPort: a datagram parses the same whatever its ports. gopacket
// picks an application decoder by port (44818, in the kernel's ephemeral
// range, is EtherNet/IP's), and a test that sent from an ephemeral port once
// failed with "ENIP packet data truncated".
func TestParseEveryPort(t *testing.T) {
	payload := []byte("flow 7 #3")
	for _, src := range []netip.Addr{a4, a6} {
		dst := b4
		if src.Is6() {
			dst = b6
		}
		tmpl := UDP(netip.AddrPortFrom(src, 1), netip.AddrPortFrom(dst, 1), payload)
		l4 := len(tmpl) - 8 - len(payload)
		pkt := make([]byte, len(tmpl))
		for port := range 1 << 16 {
			for _, field := range []int{0, 2} { // source, then destination port
				copy(pkt, tmpl)
				binary.BigEndian.PutUint16(pkt[l4+field:], uint16(port))
				fixUDPChecksum(pkt, l4, src, dst)
				p, err := Parse(pkt)
				if err != nil {
					t.Fatalf("%v port %d (field %d): %v", src, port, field, err)
				}
				if !bytes.Equal(p.Payload, payload) || !p.ChecksumOK {
					t.Fatalf("%v port %d (field %d): parsed %+v", src, port, field, p)
				}
			}
		}
	}
}

func fixUDPChecksum(pkt []byte, l4 int, src, dst netip.Addr) {
	pkt[l4+6], pkt[l4+7] = 0, 0
	s := sum(src.AsSlice(), 0)
	s = sum(dst.AsSlice(), s)
	s += uint32(layers.IPProtocolUDP) + uint32(len(pkt)-l4)
	c := ^fold(sum(pkt[l4:], s))
	if c == 0 {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(pkt[l4+6:], c)
}

// TestParseTrailingBytes: bytes after the IP packet (Ethernet padding) are
// not payload and do not spoil the checksum.
func TestParseTrailingBytes(t *testing.T) {
	payload := []byte("x")
	pkt := append(UDP(netip.AddrPortFrom(a4, 5000), netip.AddrPortFrom(b4, 7000), payload), 0xde, 0xad, 0xbe, 0xef)
	p, err := Parse(pkt)
	if err != nil || !bytes.Equal(p.Payload, payload) || !p.ChecksumOK {
		t.Fatalf("padded packet: %+v %v", p, err)
	}
}

func TestParseTruncated(t *testing.T) {
	for _, pkt := range [][]byte{
		UDP(netip.AddrPortFrom(a4, 5000), netip.AddrPortFrom(b4, 7000), []byte("cut short")),
		UDP(netip.AddrPortFrom(a6, 5000), netip.AddrPortFrom(b6, 7000), []byte("cut short")),
		TCP(netip.AddrPortFrom(a4, 5000), netip.AddrPortFrom(b4, 7000), 1, 0, true, false, false, []byte("cut short")),
	} {
		for n := range len(pkt) {
			if p, err := Parse(pkt[:n]); err == nil {
				t.Fatalf("%d of %d bytes parsed: %+v", n, len(pkt), p)
			}
		}
	}
}

// TestParseIPv6Extension: extension headers are skipped to the transport.
func TestParseIPv6Extension(t *testing.T) {
	payload := []byte("behind a hop-by-hop header")
	plain := UDP(netip.AddrPortFrom(a6, 5000), netip.AddrPortFrom(b6, 7000), payload)
	// Insert an empty hop-by-hop header (8 bytes: next header UDP, length
	// 0, a PadN option of 4 bytes).
	pkt := append(append(append([]byte(nil), plain[:40]...), byte(layers.IPProtocolUDP), 0, 1, 4, 0, 0, 0, 0), plain[40:]...)
	pkt[6] = byte(layers.IPProtocolIPv6HopByHop)
	binary.BigEndian.PutUint16(pkt[4:], uint16(len(pkt)-40))
	p, err := Parse(pkt)
	if err != nil || p.Proto != layers.IPProtocolUDP || !bytes.Equal(p.Payload, payload) || !p.ChecksumOK {
		t.Fatalf("%+v %v", p, err)
	}
}

func TestParseNotUDPOrTCP(t *testing.T) {
	pkt := UDP(netip.AddrPortFrom(a4, 5000), netip.AddrPortFrom(b4, 7000), []byte("icmp now"))
	pkt[9] = byte(layers.IPProtocolICMPv4)
	pkt[10], pkt[11] = 0, 0
	if p, err := Parse(pkt); err == nil {
		t.Fatalf("ICMP parsed as %+v", p)
	}
	if p, err := Parse([]byte{0x00, 1, 2, 3}); err == nil {
		t.Fatalf("garbage parsed as %+v", p)
	}
	if p, err := Parse(nil); err == nil {
		t.Fatalf("nothing parsed as %+v", p)
	}
}
