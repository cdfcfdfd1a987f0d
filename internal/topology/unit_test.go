package topology

import (
	"net/netip"
	"strings"
	"testing"
)

// These tests need no privileges: they cover the guards that keep tests
// inside the benchmark ranges and the pure helpers.

func TestCheckPrefix(t *testing.T) {
	for _, tc := range []struct {
		p     string
		want4 bool
		ok    bool
	}{
		{"198.18.0.1/24", true, true},
		{"198.19.255.254/24", true, true},
		{"198.18.7.9/15", true, true},
		{"198.18.0.0/31", true, true},
		{"198.18.0.0/32", true, true},
		{"2001:db8::1/64", false, true},
		{"2001:db8:ffff:ffff::2/64", false, true},
		{"2001:db8::/127", false, true},

		{"10.0.0.1/24", true, false},
		{"192.168.1.1/24", true, false},
		{"198.17.255.1/24", true, false},
		{"198.20.0.1/24", true, false},
		{"198.18.0.1/14", true, false}, // subnet spills outside the range
		{"198.18.0.0/24", true, false}, // network address
		{"2001:db9::1/64", false, false},
		{"2001:db8::1/31", false, false},
		{"fe80::1/64", false, false},
		{"2001:db8:1::/64", false, false},
		{"::ffff:198.18.0.1/120", true, false}, // v4-mapped
		{"::ffff:198.18.0.1/120", false, false},
		{"2001:db8::1/64", true, false}, // wrong family
		{"198.18.0.1/24", false, false},
	} {
		err := checkPrefix(netip.MustParsePrefix(tc.p), tc.want4)
		if (err == nil) != tc.ok {
			t.Errorf("checkPrefix(%s, want4=%v) = %v, want ok=%v", tc.p, tc.want4, err, tc.ok)
		}
	}
	if checkPrefix(netip.Prefix{}, true) == nil {
		t.Error("checkPrefix accepted the zero prefix")
	}
}

func TestSlotPrefixes(t *testing.T) {
	want := map[int][4]string{
		0:   {"198.18.0.1/24", "2001:db8::1/64", "198.18.0.2/24", "2001:db8::2/64"},
		1:   {"198.18.1.1/24", "2001:db8:1::1/64", "198.18.1.2/24", "2001:db8:1::2/64"},
		257: {"198.19.1.1/24", "2001:db8:101::1/64", "198.19.1.2/24", "2001:db8:101::2/64"},
		511: {"198.19.255.1/24", "2001:db8:1ff::1/64", "198.19.255.2/24", "2001:db8:1ff::2/64"},
	}
	for n, w := range want {
		for i, p := range slotPrefixes(n) {
			if p.String() != w[i] {
				t.Errorf("slot %d prefix %d = %s, want %s", n, i, p, w[i])
			}
		}
	}
	seen := map[netip.Addr]int{}
	for n := range maxSlots {
		for i, p := range slotPrefixes(n) {
			if err := checkPrefix(p, i%2 == 0); err != nil {
				t.Fatalf("slot %d: %v", n, err)
			}
			if m, dup := seen[p.Addr()]; dup {
				t.Fatalf("slot %d reuses %v from slot %d", n, p.Addr(), m)
			}
			seen[p.Addr()] = n
		}
	}
}

func TestAddresses(t *testing.T) {
	// Two links allocated at once must not share a subnet.
	a1, rel1, err := addresses(VethOptions{})
	if err != nil {
		t.Fatal(err)
	}
	a2, rel2, err := addresses(VethOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a1[0].Masked() == a2[0].Masked() || a1[1].Masked() == a2[1].Masked() {
		t.Errorf("concurrent links share subnets: %v and %v", a1, a2)
	}
	if a1[0].Masked() != a1[2].Masked() || a1[1].Masked() != a1[3].Masked() {
		t.Errorf("the ends of one link are on different subnets: %v", a1)
	}
	// A released slot is handed out again; releasing twice is harmless.
	rel1()
	rel1()
	a3, rel3, err := addresses(VethOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a3 != a1 {
		t.Errorf("after release got %v, want the freed %v", a3, a1)
	}
	rel2()
	rel3()

	// Pinned addresses are used as given; the others are still allocated.
	pin := netip.MustParsePrefix("198.19.200.1/24")
	got, rel, err := addresses(VethOptions{A4: pin})
	if err != nil {
		t.Fatal(err)
	}
	rel()
	if got[0] != pin || !got[1].IsValid() || !got[2].IsValid() || !got[3].IsValid() {
		t.Errorf("with A4 pinned got %v", got)
	}

	for _, opts := range []VethOptions{
		{A4: netip.MustParsePrefix("10.1.2.3/24")},
		{B4: netip.MustParsePrefix("203.0.113.1/24")},
		{A6: netip.MustParsePrefix("fd00::1/64")},
		{B6: netip.MustParsePrefix("2001:db8::1/16")},
		{A4: netip.MustParsePrefix("2001:db8::1/64")},
		{A4: pin, B4: pin}, // both ends the same address
	} {
		if got, _, err := addresses(opts); err == nil {
			t.Errorf("addresses(%+v) accepted, gave %v", opts, got)
		}
	}
	// Nothing above may have kept a slot.
	for i, used := range slots.used {
		if used {
			t.Errorf("slot %d still in use", i)
		}
	}
}

// fatalRecorder is a testing.TB whose Fatalf records instead of stopping.
type fatalRecorder struct {
	testing.TB
	msgs []string
}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msgs = append(r.msgs, format)
}

// TestConnectRejectsForeignAddress shows the guard sits in front of any
// kernel work: Connect refuses before it would touch a namespace (here there
// are none, so going further would crash).
func TestConnectRejectsForeignAddress(t *testing.T) {
	r := &fatalRecorder{}
	v := Connect(r, nil, nil, VethOptions{B4: netip.MustParsePrefix("8.8.8.1/24")})
	if v != nil || len(r.msgs) != 1 {
		t.Fatalf("Connect returned %v, Fatalf calls %q", v, r.msgs)
	}
}

func TestCheckPingTarget(t *testing.T) {
	for addr, ok := range map[string]bool{
		"198.18.0.2": true, "2001:db8::2": true, "127.0.0.1": true, "::1": true,
		"8.8.8.8": false, "10.0.0.1": false, "2001:4860::8888": false, "fe80::1": false, "0.0.0.0": false,
	} {
		if err := checkPingTarget(netip.MustParseAddr(addr)); (err == nil) != ok {
			t.Errorf("checkPingTarget(%s) = %v, want ok=%v", addr, err, ok)
		}
	}
}

func TestEcho(t *testing.T) {
	payload := []byte("fabricbridge-ok") // odd length exercises the checksum tail
	msg := echo(icmp4EchoRequest, 0x1234, 7, payload)
	if checksum(msg) != 0 {
		t.Errorf("checksum over a finished message = %#x, want 0", checksum(msg))
	}
	// RFC 1071's worked example: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2.
	if got := checksum([]byte{0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7}); got != ^uint16(0xddf2) {
		t.Errorf("checksum of RFC 1071 example = %#x, want %#x", got, ^uint16(0xddf2))
	}
	reply := append([]byte(nil), msg...)
	reply[0] = icmp4EchoReply
	if seq, ok := parseEcho(reply, icmp4EchoReply, 0x1234, payload); !ok || seq != 7 {
		t.Errorf("parseEcho(reply) = %d, %v", seq, ok)
	}
	if _, ok := parseEcho(msg, icmp4EchoReply, 0x1234, payload); ok {
		t.Error("parseEcho accepted our own request")
	}
	if _, ok := parseEcho(reply, icmp4EchoReply, 0x4321, payload); ok {
		t.Error("parseEcho accepted another identifier")
	}
	if _, ok := parseEcho(reply[:len(reply)-1], icmp4EchoReply, 0x1234, payload); ok {
		t.Error("parseEcho accepted a truncated payload")
	}
}

func TestIsOurName(t *testing.T) {
	for name, ok := range map[string]bool{
		"fb0123abcd": true, "fbdeadbeef": true,
		"fb0123abc": false, "fb0123abcde": false, "fbDEADBEEF": false, "fbuser-net": false, "xb0123abcd": false,
	} {
		if isOurName(name) != ok {
			t.Errorf("isOurName(%q) = %v", name, !ok)
		}
	}
	if name := namePrefix + randomHex(4); !isOurName(name) || strings.ToLower(name) != name {
		t.Errorf("generated name %q does not match its own pattern", name)
	}
}
