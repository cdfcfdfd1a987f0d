package bridge

import (
	"encoding/binary"
	"math/rand/v2"
	"sync/atomic"
)

// A packet over the interface's MTU reaches the bridge only between a
// lowering of the MTU and the application's stack hearing of it (the
// daemon tells it within about a second): the stack fragments by the MTU
// it knows. Dropped there, such a packet would be lost without the
// application ever learning of it (a UDP datagram) or stall a connection
// until it is sent again (TCP). The bridge fragments it instead, as the
// IP layer under a kernel socket does when the interface's MTU drops, and
// hands the fragments to the kernel; the peer reassembles them. IPv4
// fragments lose DF, which asks routers on the path not to fragment, not
// the sending host; IPv6 fragments carry a Fragment header, which only
// the sender may add, and the application's stack is the sender.

// fragID numbers the datagrams the bridge fragments: IPv4 identifications
// (16 bits, for packets that had none, as DF packets may) and IPv6
// fragment identifications.
var fragID atomic.Uint32

func init() { fragID.Store(rand.Uint32()) }

func nextFragID() uint32 {
	for {
		if id := fragID.Add(1); id&0xffff != 0 {
			return id
		}
	}
}

// fragment cuts a verified IP packet into fragments of at most mtu bytes
// and calls emit with each, in order, in a buffer reused between calls.
// It reports false, emitting nothing, for a packet it cannot fragment: an
// IPv4 packet with options or a fragment without identification, an IPv6
// packet with extension headers other than a Fragment header, or an MTU
// with no room for 8 bytes of payload.
func fragment(p []byte, mtu int, buf []byte, emit func([]byte)) bool {
	switch p[0] >> 4 {
	case 4:
		return fragment4(p, mtu, buf, emit)
	case 6:
		return fragment6(p, mtu, buf, emit)
	}
	return false
}

func fragment4(p []byte, mtu int, buf []byte, emit func([]byte)) bool {
	const hl = 20
	if int(p[0]&0xf)*4 != hl || mtu-hl < 8 {
		return false
	}
	// The packet may be a fragment itself: its pieces keep its offset,
	// and the last keeps its more-fragments flag.
	flags := binary.BigEndian.Uint16(p[6:])
	base, more := int(flags&0x1fff), flags&0x2000 != 0
	// A packet without an identification (DF set) gets one. A fragment
	// must keep its siblings', and 0 the kernel would replace with a new
	// one for each piece (IP_HDRINCL): such a fragment cannot be cut.
	id := binary.BigEndian.Uint16(p[4:])
	if id == 0 {
		if base != 0 || more {
			return false
		}
		id = uint16(nextFragID())
	}
	payload := p[hl:]
	step := (mtu - hl) &^ 7
	for off := 0; off < len(payload); off += step {
		n := min(step, len(payload)-off)
		f := buf[:hl+n]
		copy(f, p[:hl])
		copy(f[hl:], payload[off:off+n])
		binary.BigEndian.PutUint16(f[2:], uint16(hl+n))
		binary.BigEndian.PutUint16(f[4:], id)
		fo := uint16(base + off/8)
		if off+n < len(payload) || more {
			fo |= 0x2000
		}
		binary.BigEndian.PutUint16(f[6:], fo)
		f[10], f[11] = 0, 0
		binary.BigEndian.PutUint16(f[10:], ^onesSum(f[:hl]))
		emit(f)
	}
	return true
}

func fragment6(p []byte, mtu int, buf []byte, emit func([]byte)) bool {
	const hl, fh = 40, 8
	next, base, more, payload := p[6], 0, false, p[hl:]
	var id uint32
	switch next {
	case 0, 43, 60, 51:
		return false
	case 44:
		// A fragment already: its pieces keep its identification and
		// offset, and the last keeps its more-fragments flag.
		if len(p) < hl+fh {
			return false
		}
		fo := binary.BigEndian.Uint16(p[hl+2:])
		next, base, more, id, payload = p[hl], int(fo&^7), fo&1 != 0, binary.BigEndian.Uint32(p[hl+4:]), p[hl+fh:]
	default:
		id = nextFragID()
	}
	if mtu-hl-fh < 8 {
		return false
	}
	step := (mtu - hl - fh) &^ 7
	for off := 0; off < len(payload); off += step {
		n := min(step, len(payload)-off)
		f := buf[:hl+fh+n]
		copy(f, p[:hl])
		f[6] = 44
		binary.BigEndian.PutUint16(f[4:], uint16(fh+n))
		f[hl], f[hl+1] = next, 0
		fo := uint16(base + off)
		if off+n < len(payload) || more {
			fo |= 1
		}
		binary.BigEndian.PutUint16(f[hl+2:], fo)
		binary.BigEndian.PutUint32(f[hl+4:], id)
		copy(f[hl+fh:], payload[off:off+n])
		emit(f)
	}
	return true
}

// onesSum is the ones' complement sum of b (even length).
func onesSum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return uint16(s)
}
