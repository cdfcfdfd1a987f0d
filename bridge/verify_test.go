package bridge

import (
	"net/netip"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

func TestVerify(t *testing.T) {
	me4 := netip.MustParseAddr("198.18.0.1")
	me6 := netip.MustParseAddr("2001:db8::1")
	peer4 := netip.MustParseAddrPort("198.18.0.2:9999")
	peer6 := netip.MustParseAddrPort("[2001:db8::2]:9999")
	own, err := compileOwnership(classifier.Ownership{
		Addrs: []netip.Addr{me4, me6},
		Ports: []classifier.PortClaim{{Proto: classifier.ProtoUDP, Port: 5000}, {Proto: classifier.ProtoTCP, Port: 80}},
	})
	if err != nil {
		t.Fatal(err)
	}
	udp4 := ippkt.UDP(netip.AddrPortFrom(me4, 5000), peer4, []byte("hello"))
	mut := func(p []byte, f func([]byte)) []byte {
		q := append([]byte(nil), p...)
		f(q)
		return q
	}
	cases := []struct {
		name string
		pkt  []byte
		want reason
	}{
		{"udp4", udp4, accepted},
		{"udp6", ippkt.UDP(netip.AddrPortFrom(me6, 5000), peer6, []byte("hello")), accepted},
		{"tcp4", ippkt.TCP(netip.AddrPortFrom(me4, 80), peer4, 1, 2, false, true, false, []byte("x")), accepted},
		{"tcp6", ippkt.TCP(netip.AddrPortFrom(me6, 80), peer6, 1, 2, true, false, false, nil), accepted},
		{"empty", nil, rejVersion},
		{"version 5", mut(udp4, func(p []byte) { p[0] = 0x55 }), rejVersion},
		{"ihl 4", mut(udp4, func(p []byte) { p[0] = 0x44 }), rejHeader},
		{"ihl beyond", mut(udp4, func(p []byte) { p[0] = 0x4f }), rejHeader},
		{"short v4", udp4[:19], rejHeader},
		{"total length short", mut(udp4, func(p []byte) { be.PutUint16(p[2:], uint16(len(p)-1)) }), rejLength},
		{"trailing bytes", append(append([]byte(nil), udp4...), 0), rejLength},
		{"udp length", mut(udp4, func(p []byte) { be.PutUint16(p[24:], 9) }), rejLength},
		{"spoofed source address", ippkt.UDP(netip.MustParseAddrPort("198.18.0.9:5000"), peer4, nil), rejSourceAddr},
		{"spoofed v6 source", ippkt.UDP(netip.MustParseAddrPort("[2001:db8::9]:5000"), peer6, nil), rejSourceAddr},
		{"unowned udp port", ippkt.UDP(netip.AddrPortFrom(me4, 5001), peer4, nil), rejSourcePort},
		{"tcp from the udp port", ippkt.TCP(netip.AddrPortFrom(me4, 5000), peer4, 1, 0, true, false, false, nil), rejSourcePort},
		{"icmp", mut(udp4, func(p []byte) { p[9] = 1 }), rejProtocol},
		{"tcp data offset", mut(ippkt.TCP(netip.AddrPortFrom(me4, 80), peer4, 1, 2, false, true, false, nil), func(p []byte) { p[32] = 0x40 }), rejHeader},
		{"later fragment", mut(udp4, func(p []byte) { be.PutUint16(p[6:], 100) }), accepted},
		{"v6 payload length", mut(ippkt.UDP(netip.AddrPortFrom(me6, 5000), peer6, nil), func(p []byte) { be.PutUint16(p[4:], 100) }), rejLength},
	}
	for _, c := range cases {
		if got := verify(c.pkt, own, 1500); got != c.want {
			t.Errorf("%s: reason %d, want %d", c.name, got, c.want)
		}
	}
	big := ippkt.UDP(netip.AddrPortFrom(me4, 5000), peer4, make([]byte, 1500))
	if got := verify(big, own, 1500); got != rejMTU {
		t.Errorf("1528-byte packet with MTU 1500: reason %d", got)
	}
	// Every truncation of a valid packet is refused, never a panic.
	for _, p := range [][]byte{udp4, cases[1].pkt, cases[2].pkt, cases[3].pkt} {
		for n := range len(p) {
			if verify(p[:n], own, 1500) == accepted {
				t.Errorf("truncated to %d of %d bytes accepted", n, len(p))
			}
		}
	}
	if allocs := testing.AllocsPerRun(1000, func() { verify(udp4, own, 1500) }); allocs != 0 {
		t.Errorf("verify allocates %v times", allocs)
	}
	if _, err := compileOwnership(classifier.Ownership{Ports: []classifier.PortClaim{{Proto: classifier.ProtoAny, Port: 1}, {Proto: classifier.ProtoUDP, Port: 0}}, Addrs: []netip.Addr{{}}}); err == nil {
		t.Error("bad ownership accepted")
	}
}

// TestPortsChangeInPlace: a port added to or removed from an ownership
// takes effect for the next packet, and a stream with no port of a
// protocol left is refused that protocol.
func TestPortsChangeInPlace(t *testing.T) {
	me := netip.MustParseAddr("198.18.0.1")
	peer := netip.MustParseAddrPort("198.18.0.2:9999")
	own, err := compileOwnership(classifier.Ownership{Addrs: []netip.Addr{me}})
	if err != nil {
		t.Fatal(err)
	}
	pkt := ippkt.UDP(netip.AddrPortFrom(me, 40000), peer, []byte("x"))
	if got := verify(pkt, own, 1500); got != rejProtocol {
		t.Fatalf("no UDP port owned: reason %d, want %d", got, rejProtocol)
	}
	udp, _ := own.ports(classifier.ProtoUDP)
	if !udp.add(40000) || udp.add(40000) {
		t.Fatal("add reports wrongly whether the port was new")
	}
	udp.add(40001)
	if got := verify(pkt, own, 1500); got != accepted {
		t.Fatalf("port added: reason %d", got)
	}
	if !udp.remove(40000) || udp.remove(40000) {
		t.Fatal("remove reports wrongly whether the port was owned")
	}
	if got := verify(pkt, own, 1500); got != rejSourcePort {
		t.Fatalf("port removed, another left: reason %d, want %d", got, rejSourcePort)
	}
	udp.remove(40001)
	if got := verify(pkt, own, 1500); got != rejProtocol {
		t.Fatalf("last port removed: reason %d, want %d", got, rejProtocol)
	}
}
