package userstack

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

func TestCheckVerdicts(t *testing.T) {
	a4, b4 := netip.AddrPortFrom(src4, 1000), netip.AddrPortFrom(dst4, 2000)
	a6, b6 := netip.AddrPortFrom(src6, 1000), netip.AddrPortFrom(dst6, 2000)
	tcp4 := ippkt.TCP(a4, b4, 1, 2, false, true, false, pattern(999))
	tcp6 := ippkt.TCP(a6, b6, 1, 2, false, true, false, pattern(1000))
	udp4 := ippkt.UDP(a4, b4, pattern(333))
	udp6 := ippkt.UDP(a6, b6, pattern(334))
	icmp := icmpUnreachable(dst4, udp4)
	for name, p := range map[string][]byte{"tcp4": tcp4, "tcp6": tcp6, "udp4": udp4, "udp6": udp6, "icmp4": icmp} {
		if v := check(p); v != verified {
			t.Errorf("%s: %v, want verified", name, v)
		}
		// Any flipped bit after the IP version is caught.
		for _, off := range []int{5, 12, len(p) / 2, len(p) - 1} {
			q := append([]byte(nil), p...)
			q[off] ^= 0x10
			if off == 5 && p[0]>>4 == 6 {
				continue // the low byte of the IPv6 flow label is not covered by any checksum
			}
			if v := check(q); v == verified {
				t.Errorf("%s with byte %d flipped: verified", name, off)
			}
		}
	}
	noSum4 := append([]byte(nil), udp4...)
	binary.BigEndian.PutUint16(noSum4[20+6:], 0)
	if v := check(noSum4); v != verified {
		t.Errorf("IPv4 UDP without checksum: %v", v)
	}
	noSum6 := append([]byte(nil), udp6...)
	binary.BigEndian.PutUint16(noSum6[40+6:], 0)
	if v := check(noSum6); v != corrupt {
		t.Errorf("IPv6 UDP without checksum: %v, want corrupt", v)
	}
	frag := append([]byte(nil), udp4...)
	header.IPv4(frag).SetFlagsFragmentOffset(header.IPv4FlagMoreFragments, 0)
	if v := check(frag); v != unverified {
		t.Errorf("fragment: %v, want unverified", v)
	}
	for _, short := range [][]byte{{0x45}, tcp4[:30], {0x00, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}} {
		if v := check(short); v != unverified {
			t.Errorf("%x: %v, want unverified (the stack decides)", short, v)
		}
	}
}

// fragments splits an IPv4 packet (20-byte header) into two fragments.
func fragments(p []byte, first int) [][]byte {
	hdr, data := p[:20], p[20:]
	mk := func(off int, chunk []byte, more bool) []byte {
		f := append(append([]byte(nil), hdr...), chunk...)
		ip := header.IPv4(f)
		ip.SetTotalLength(uint16(len(f)))
		var flags uint8
		if more {
			flags = header.IPv4FlagMoreFragments
		}
		ip.SetFlagsFragmentOffset(flags, uint16(off))
		ip.SetChecksum(0)
		ip.SetChecksum(^ip.CalculateChecksum())
		return f
	}
	return [][]byte{mk(0, data[:first], true), mk(first, data[first:], false)}
}

func TestFragmentsAreCheckedByTheStack(t *testing.T) {
	_, b := wiredPair(t, nil)
	pc, err := b.s.ListenPacket("udp4", ":7000")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	from := netip.MustParseAddrPort("198.18.0.9:555")
	to := netip.MustParseAddrPort("198.18.0.2:7000")
	good := ippkt.UDP(from, to, pattern(2500))
	bad := ippkt.UDP(from, to, pattern(2500))
	bad[len(bad)-1] ^= 1
	header.IPv4(bad).SetID(99)
	header.IPv4(bad).SetChecksum(0)
	header.IPv4(bad).SetChecksum(^header.IPv4(bad).CalculateChecksum())
	b.deliver(fragments(bad, 1480)...)
	b.deliver(fragments(good, 1480)...)
	buf := make([]byte, 4000)
	pc.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, _, err := pc.ReadFrom(buf)
	if err != nil || n != 2500 || buf[n-1] != pattern(2500)[2499] {
		t.Fatalf("got %d bytes, %v: want the good datagram only", n, err)
	}
	pc.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, _, err := pc.ReadFrom(buf); err == nil {
		t.Fatalf("a second datagram of %d bytes arrived: the corrupted one was delivered", n)
	}
	if errs := b.s.ns.Stats().UDP.ChecksumErrors.Value(); errs != 1 {
		t.Fatalf("stack counted %d UDP checksum errors, want 1", errs)
	}
	var _ net.PacketConn = pc
}
