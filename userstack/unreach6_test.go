package userstack

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// icmpv6Unreachable is an ICMPv6 destination unreachable with the given
// code for the IPv6 packet orig, sent by orig's destination.
func icmpv6Unreachable(orig []byte, code uint8) []byte {
	quoted := orig[:min(len(orig), header.IPv6MinimumMTU-header.IPv6MinimumSize-header.ICMPv6DstUnreachableMinimumSize)]
	pkt := make([]byte, header.IPv6MinimumSize+header.ICMPv6DstUnreachableMinimumSize+len(quoted))
	o := header.IPv6(orig)
	ip := header.IPv6(pkt)
	ip.Encode(&header.IPv6Fields{PayloadLength: uint16(len(pkt) - header.IPv6MinimumSize), TransportProtocol: header.ICMPv6ProtocolNumber,
		HopLimit: 64, SrcAddr: o.DestinationAddress(), DstAddr: o.SourceAddress()})
	icmp := header.ICMPv6(pkt[header.IPv6MinimumSize:])
	icmp.SetType(header.ICMPv6DstUnreachable)
	icmp.SetCode(header.ICMPv6Code(code))
	copy(icmp[header.ICMPv6DstUnreachableMinimumSize:], quoted)
	icmp.SetChecksum(header.ICMPv6Checksum(header.ICMPv6ChecksumParams{Header: icmp, Src: ip.SourceAddress(), Dst: ip.DestinationAddress()}))
	return pkt
}

// TestICMPv6UnreachableCodesAsLinux answers an IPv6 TCP SYN, and a
// datagram of a connected IPv6 UDP socket, with each destination
// unreachable code in turn, and checks that the stack reports what Linux
// does (icmpv6_err_convert, tcp_v6_err, __udp6_lib_err): every code fails
// a TCP connect at once, with ENETUNREACH, EACCES, EHOSTUNREACH,
// ECONNREFUSED or EPROTO; a UDP socket reports the fatal codes (1, 4, 5,
// 6, unknown) and not the others. gVisor alone acts on codes 0 and 4 only
// (a dial answered with another one times out).
func TestICMPv6UnreachableCodesAsLinux(t *testing.T) {
	const basePort = 9100 // the port tells the code to answer with
	a, _ := wiredPair(t, func(from *peer, pkt []byte) bool {
		if pkt[0]>>4 != 6 || len(pkt) < header.IPv6MinimumSize+4 {
			return true
		}
		proto := pkt[6]
		if proto != uint8(header.TCPProtocolNumber) && proto != uint8(header.UDPProtocolNumber) {
			return true
		}
		port := binary.BigEndian.Uint16(pkt[header.IPv6MinimumSize+2:])
		if port < basePort || port > basePort+8 {
			return true
		}
		from.deliver(icmpv6Unreachable(pkt, uint8(port-basePort)))
		return false
	})
	for code := range uint8(9) {
		tcpWant, fatal := unreach6Errno(code)
		addr := fmt.Sprintf("[2001:db8::2]:%d", basePort+int(code))
		t.Run(fmt.Sprintf("code%d", code), func(t *testing.T) {
			start := time.Now()
			c, err := a.s.Dial(testCtx(t, 10*time.Second), "tcp6", addr)
			took := time.Since(start)
			if err == nil {
				c.Close()
				t.Fatalf("tcp dial %s succeeded", addr)
			}
			if !errors.Is(err, tcpWant) || took > 2*time.Second {
				t.Fatalf("tcp dial %s: %v after %v, want %v at once", addr, err, took, tcpWant)
			}
			if want := fmt.Sprintf("%s: connect: %v", addr, tcpWant); !strings.HasSuffix(err.Error(), want) {
				t.Fatalf("tcp dial: %q, want it to end in %q", err, want)
			}

			u, err := a.s.Dial(testCtx(t, 10*time.Second), "udp6", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer u.Close()
			if _, err := u.Write([]byte("anyone?")); err != nil {
				t.Fatal(err)
			}
			wait := 2 * time.Second
			if !fatal {
				wait = 300 * time.Millisecond // the error is not reported: wait a little
			}
			u.SetReadDeadline(time.Now().Add(wait))
			_, err = u.Read(make([]byte, 10))
			if fatal && !errors.Is(err, tcpWant) {
				t.Fatalf("udp read after code %d: %v, want %v", code, err, tcpWant)
			}
			var ne net.Error
			if !fatal && !(errors.As(err, &ne) && ne.Timeout()) {
				t.Fatalf("udp read after code %d: %v, want nothing (Linux does not report it)", code, err)
			}
			t.Logf("tcp: %v after %v; udp: %v", tcpWant, took, err)
		})
	}
	if n := a.s.ns.Stats().ICMP.V6.PacketsReceived.Invalid.Value(); n != 0 {
		t.Errorf("gVisor found %d ICMPv6 packets invalid (a rewritten checksum?)", n)
	}
}

// TestSetICMPv6CodeKeepsTheChecksum checks the incremental checksum update
// against a full computation for every type and code pair's worth of
// changes on random-ish packets.
func TestSetICMPv6CodeKeepsTheChecksum(t *testing.T) {
	src := tcpip.AddrFrom16Slice(netip.MustParseAddr("2001:db8::9").AsSlice())
	dst := tcpip.AddrFrom16Slice(netip.MustParseAddr("2001:db8::1").AsSlice())
	b := body(600)
	for i := range 300 {
		pkt := make([]byte, header.IPv6MinimumSize+header.ICMPv6DstUnreachableMinimumSize+i)
		ip := header.IPv6(pkt)
		ip.Encode(&header.IPv6Fields{PayloadLength: uint16(len(pkt) - header.IPv6MinimumSize), TransportProtocol: header.ICMPv6ProtocolNumber, SrcAddr: src, DstAddr: dst})
		icmp := header.ICMPv6(pkt[header.IPv6MinimumSize:])
		icmp.SetType(header.ICMPv6DstUnreachable)
		icmp.SetCode(header.ICMPv6Code(b[i] % 8))
		copy(icmp[header.ICMPv6DstUnreachableMinimumSize:], b[i:])
		icmp.SetChecksum(header.ICMPv6Checksum(header.ICMPv6ChecksumParams{Header: icmp, Src: src, Dst: dst}))
		setICMPv6Code(pkt, b[i+1])
		want := header.ICMPv6Checksum(header.ICMPv6ChecksumParams{Header: icmp, Src: src, Dst: dst})
		if icmp.Checksum() != want || check(pkt) != verified {
			t.Fatalf("%d bytes, code %d: checksum %#04x, want %#04x", len(pkt), b[i+1], icmp.Checksum(), want)
		}
	}
}

// icmpv4Unreachable is an ICMPv4 destination unreachable with the given
// code for the IPv4 packet orig, sent by orig's destination.
func icmpv4Unreachable(orig []byte, code uint8) []byte {
	quoted := orig[:min(len(orig), 28)]
	pkt := make([]byte, header.IPv4MinimumSize+header.ICMPv4MinimumSize+len(quoted))
	o := header.IPv4(orig)
	ip := header.IPv4(pkt)
	ip.Encode(&header.IPv4Fields{TotalLength: uint16(len(pkt)), TTL: 64, Protocol: uint8(header.ICMPv4ProtocolNumber),
		SrcAddr: o.DestinationAddress(), DstAddr: o.SourceAddress()})
	ip.SetChecksum(^ip.CalculateChecksum())
	icmp := header.ICMPv4(pkt[header.IPv4MinimumSize:])
	icmp.SetType(header.ICMPv4DstUnreachable)
	icmp.SetCode(header.ICMPv4Code(code))
	copy(icmp[header.ICMPv4MinimumSize:], quoted)
	icmp.SetChecksum(^checksum.Checksum(icmp, 0))
	return pkt
}

// TestICMPv4UnreachableCodesOnUDPAsLinux answers a datagram of a
// connected IPv4 UDP socket with each destination unreachable code and
// checks that the socket reports what Linux's does (icmp_err_convert,
// __udp4_lib_err): the "fatal" codes with their errno (administratively
// prohibited: EHOSTUNREACH), the others not at all. gVisor alone reports
// port unreachable only.
func TestICMPv4UnreachableCodesOnUDPAsLinux(t *testing.T) {
	const basePort = 9200
	a, _ := wiredPair(t, func(from *peer, pkt []byte) bool {
		if pkt[0]>>4 != 4 || pkt[9] != uint8(header.UDPProtocolNumber) {
			return true
		}
		port := binary.BigEndian.Uint16(pkt[header.IPv4MinimumSize+2:])
		if port < basePort || port > basePort+16 {
			return true
		}
		from.deliver(icmpv4Unreachable(pkt, uint8(port-basePort)))
		return false
	})
	for code := range uint8(17) {
		want, fatal := unreach4Errno(code)
		addr := fmt.Sprintf("198.18.0.2:%d", basePort+int(code))
		u, err := a.s.Dial(testCtx(t, 10*time.Second), "udp4", addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := u.Write([]byte("anyone?")); err != nil {
			t.Fatal(err)
		}
		wait := 2 * time.Second
		if !fatal {
			wait = 200 * time.Millisecond
		}
		u.SetReadDeadline(time.Now().Add(wait))
		_, err = u.Read(make([]byte, 10))
		u.Close()
		var ne net.Error
		switch {
		case fatal && !errors.Is(err, want):
			t.Errorf("code %d: udp read: %v, want %v", code, err, want)
		case !fatal && !(errors.As(err, &ne) && ne.Timeout()):
			t.Errorf("code %d: udp read: %v, want nothing (Linux does not report it)", code, err)
		default:
			t.Logf("code %d: %v", code, err)
		}
	}
	if n := a.s.ns.Stats().ICMP.V4.PacketsReceived.Invalid.Value(); n != 0 {
		t.Errorf("gVisor found %d ICMP packets invalid (a rewritten checksum?)", n)
	}
}
