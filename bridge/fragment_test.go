package bridge

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// piece is one fragment as the receiver reads it.
type piece struct {
	id        uint32
	off       int
	more      bool
	next      uint8 // IPv6: the Fragment header's next header
	payload   []byte
	headerSum bool // IPv4: the header checksum holds
}

func parsePiece(t *testing.T, f []byte, mtu int) piece {
	t.Helper()
	if len(f) > mtu {
		t.Fatalf("a fragment of %d bytes over the MTU %d", len(f), mtu)
	}
	if f[0]>>4 == 4 {
		if int(binary.BigEndian.Uint16(f[2:])) != len(f) {
			t.Fatalf("IPv4 total length %d, fragment %d bytes", binary.BigEndian.Uint16(f[2:]), len(f))
		}
		fo := binary.BigEndian.Uint16(f[6:])
		if fo&0x4000 != 0 {
			t.Fatal("a fragment with DF")
		}
		return piece{id: uint32(binary.BigEndian.Uint16(f[4:])), off: int(fo&0x1fff) * 8, more: fo&0x2000 != 0,
			payload: f[20:], headerSum: onesSum(f[:20]) == 0xffff}
	}
	if f[6] != 44 || 40+int(binary.BigEndian.Uint16(f[4:])) != len(f) {
		t.Fatalf("IPv6 fragment: next header %d, payload length %d, %d bytes", f[6], binary.BigEndian.Uint16(f[4:]), len(f))
	}
	fo := binary.BigEndian.Uint16(f[42:])
	return piece{id: binary.BigEndian.Uint32(f[44:]), off: int(fo &^ 7), more: fo&1 != 0, next: f[40], payload: f[48:], headerSum: true}
}

// cut fragments p and returns the pieces, copied.
func cut(t *testing.T, p []byte, mtu int) []piece {
	t.Helper()
	var ps []piece
	if !fragment(p, mtu, make([]byte, 9000), func(f []byte) { ps = append(ps, parsePiece(t, bytes.Clone(f), mtu)) }) {
		t.Fatalf("%d bytes not fragmented to %d", len(p), mtu)
	}
	return ps
}

// reassemble checks the pieces as a receiver would and returns the
// datagram's payload (what followed the IP header, or the Fragment header).
func reassemble(t *testing.T, ps []piece, wantMore bool) []byte {
	t.Helper()
	var out []byte
	for i, p := range ps {
		if p.id != ps[0].id || p.id == 0 {
			t.Fatalf("piece %d: identification %#x, first %#x", i, p.id, ps[0].id)
		}
		if !p.headerSum {
			t.Fatalf("piece %d: bad IPv4 header checksum", i)
		}
		if p.off != ps[0].off+len(out) || (i < len(ps)-1 && len(p.payload)%8 != 0) {
			t.Fatalf("piece %d: offset %d, %d bytes, after %d bytes", i, p.off, len(p.payload), len(out))
		}
		if last := i == len(ps)-1; p.more != (!last || wantMore) {
			t.Fatalf("piece %d of %d: more fragments %v", i, len(ps), p.more)
		}
		out = append(out, p.payload...)
	}
	return out
}

func TestFragment(t *testing.T) {
	payload := make([]byte, 4000)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	for _, tc := range []struct{ src, dst string }{{"198.18.0.1", "198.18.0.2"}, {"2001:db8::1", "2001:db8::2"}} {
		src, dst := netip.AddrPortFrom(netip.MustParseAddr(tc.src), 9000), netip.AddrPortFrom(netip.MustParseAddr(tc.dst), 9001)
		p := ippkt.UDP(src, dst, payload) // IPv4 with DF and identification 0
		hl := 20
		if src.Addr().Is6() {
			hl = 40
		}
		for _, mtu := range []int{1280, 1400, 1500} {
			ps := cut(t, p, mtu)
			if got := reassemble(t, ps, false); !bytes.Equal(got, p[hl:]) {
				t.Fatalf("%v, MTU %d: the pieces reassemble to other bytes", src.Addr(), mtu)
			}
			if src.Addr().Is6() && ps[0].next != 17 {
				t.Fatalf("IPv6 Fragment header's next header %d, want UDP", ps[0].next)
			}
		}

		// A fragment (cut at 1500, before the MTU went down) cut again:
		// its pieces keep its identification and offset, and the last its
		// more-fragments flag.
		var first, second []byte
		buf := make([]byte, 9000)
		n := 0
		fragment(p, 1500, buf, func(f []byte) {
			switch n {
			case 0:
				first = bytes.Clone(f)
			case 1:
				second = bytes.Clone(f)
			}
			n++
		})
		a, b := cut(t, first, 1280), cut(t, second, 1280)
		if a[0].id != b[0].id {
			t.Fatalf("%v: the pieces of two fragments of one datagram have identifications %#x and %#x", src.Addr(), a[0].id, b[0].id)
		}
		got := append(reassemble(t, a, true), reassemble(t, b, true)...)
		if !bytes.Equal(got, p[hl:hl+len(got)]) || b[0].off != len(reassemble(t, a, true)) {
			t.Fatalf("%v: the pieces of the first two fragments are not the datagram's start", src.Addr())
		}
	}

	// An IPv4 fragment without identification cannot be cut: the kernel
	// would give each piece a new one.
	p := ippkt.UDP(netip.MustParseAddrPort("198.18.0.1:1"), netip.MustParseAddrPort("198.18.0.2:2"), payload)
	binary.BigEndian.PutUint16(p[6:], 0x2000)
	if fragment(p, 1280, make([]byte, 9000), func([]byte) { t.Fatal("emitted") }) {
		t.Fatal("an IPv4 fragment with identification 0 was cut")
	}
}
