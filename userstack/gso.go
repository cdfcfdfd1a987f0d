package userstack

import (
	"errors"

	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// errMalformedOffload marks an offload packet the endpoint cannot cut: it
// is dropped alone and TCP retransmits it, the other packets go on.
var errMalformedOffload = errors.New("userstack: malformed offload packet")

// writeOffload completes a TCP packet that the stack handed down with a
// partial checksum (gVisor's host-GSO contract) and, when it carries more
// than one MSS, cuts it into segments the way a NIC's TSO does: the headers
// are repeated, the sequence number advances, FIN and PSH stay on the last
// segment and CWR on the first, IPv4 ids count up, and every length and
// checksum is recomputed.
func (e *LinkEndpoint) writeOffload(pkt *stack.PacketBuffer) error {
	size := pkt.Size()
	mss := int(pkt.GSOOptions.MSS)
	if size <= e.maxPacket {
		// Common case (ACKs, small writes): finish it in place.
		dst, err := e.slot()
		if err != nil {
			return err
		}
		p := flatten(pkt, dst)
		l3, hdr, ok := tcpHeaders(p)
		if !ok {
			return errMalformedOffload
		}
		mss = e.segmentSize(mss, hdr)
		if len(p)-hdr <= mss {
			finishTCP(p, l3)
			e.tx.batch = append(e.tx.batch, p)
			return nil
		}
		// Larger than one MSS yet within a slot: cut it like a big one.
	}
	if size > gsoMaxSize+header.IPv6MinimumSize || mss <= 0 {
		return errMalformedOffload
	}
	// Only the headers are gathered; each segment's payload is copied
	// straight from the packet's views into its slot, one pass over the
	// data instead of two.
	views, skip := pkt.AsViewList()
	src := viewCursor{v: views.Front(), off: skip}
	whole := e.tx.gso[:src.read(e.tx.gso[:min(size, maxOffloadHeaders)])]
	l3, hdr, ok := tcpHeaders(whole)
	if ok {
		mss = e.segmentSize(mss, hdr)
	}
	if !ok || hdr+mss > e.maxPacket {
		return errMalformedOffload
	}
	e.stats.txSegmented.Add(1)
	src = viewCursor{v: views.Front(), off: skip}
	src.skip(hdr)
	whole = whole[:hdr]
	payload := size - hdr
	tcp := header.TCP(whole[l3:])
	seq := tcp.SequenceNumber()
	flags := tcp.Flags()
	v6 := whole[0]>>4 == 6
	var id uint16
	if !v6 {
		id = header.IPv4(whole).ID()
	}
	for i, off := 0, 0; off < payload; i++ {
		n := min(mss, payload-off)
		dst, err := e.slot()
		if err != nil {
			return err
		}
		copy(dst, whole[:hdr])
		if src.read(dst[hdr:hdr+n]) != n {
			return errMalformedOffload
		}
		seg := dst[:hdr+n]
		t := header.TCP(seg[l3:])
		t.SetSequenceNumber(seq + uint32(off))
		f := flags
		if off+n < payload {
			f &^= header.TCPFlagFin | header.TCPFlagPsh
		}
		if i > 0 {
			f &^= header.TCPFlagCwr
		}
		t.SetFlags(uint8(f))
		if v6 {
			header.IPv6(seg).SetPayloadLength(uint16(len(seg) - l3))
		} else {
			ip := header.IPv4(seg)
			ip.SetTotalLength(uint16(len(seg)))
			ip.SetID(id + uint16(i))
			ip.SetChecksum(0)
			ip.SetChecksum(^ip.CalculateChecksum())
		}
		finishTCP(seg, l3)
		e.tx.batch = append(e.tx.batch, seg)
		off += n
	}
	return nil
}

// maxOffloadHeaders bounds the IP and TCP headers of an offload packet:
// 60 bytes of IPv4 header and 60 of TCP (IPv6's fixed 40 is less).
const maxOffloadHeaders = 120

// tcpHeaders finds the TCP header of an IPv4 or IPv6 packet from the stack
// (no IPv6 extension headers: gVisor's TCP adds none) and returns its
// offset and the offset of the payload.
func tcpHeaders(p []byte) (l3, payload int, ok bool) {
	if len(p) < header.IPv4MinimumSize {
		return 0, 0, false
	}
	switch p[0] >> 4 {
	case 4:
		l3 = int(p[0]&0xf) * 4
		if l3 < header.IPv4MinimumSize || p[9] != uint8(header.TCPProtocolNumber) {
			return 0, 0, false
		}
	case 6:
		l3 = header.IPv6MinimumSize
		if len(p) < l3 || p[6] != uint8(header.TCPProtocolNumber) {
			return 0, 0, false
		}
	default:
		return 0, 0, false
	}
	if len(p) < l3+header.TCPMinimumSize {
		return 0, 0, false
	}
	payload = l3 + int(header.TCP(p[l3:]).DataOffset())
	if payload < l3+header.TCPMinimumSize || payload > len(p) {
		return 0, 0, false
	}
	return l3, payload, true
}

// finishTCP writes the full TCP checksum of a contiguous packet whose TCP
// header starts at l3.
func finishTCP(p []byte, l3 int) {
	var src, dst tcpip.Address
	if p[0]>>4 == 6 {
		ip := header.IPv6(p)
		src, dst = ip.SourceAddress(), ip.DestinationAddress()
	} else {
		ip := header.IPv4(p)
		src, dst = ip.SourceAddress(), ip.DestinationAddress()
	}
	t := header.TCP(p[l3:])
	t.SetChecksum(0)
	x := header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(len(p)-l3))
	t.SetChecksum(^checksum.Checksum(p[l3:], x))
}

// viewCursor reads a packet's bytes from its views in order.
type viewCursor struct {
	v   *buffer.View
	off int
}

// read copies the next len(dst) bytes, or as many as are left, into dst.
func (c *viewCursor) read(dst []byte) int {
	n := 0
	for n < len(dst) && c.v != nil {
		s := c.v.AsSlice()
		k := copy(dst[n:], s[c.off:])
		n += k
		if c.off += k; c.off >= len(s) {
			c.v, c.off = c.v.Next(), 0
		}
	}
	return n
}

// skip passes over n bytes.
func (c *viewCursor) skip(n int) {
	for n > 0 && c.v != nil {
		left := len(c.v.AsSlice()) - c.off
		if n < left {
			c.off += n
			return
		}
		n -= left
		c.v, c.off = c.v.Next(), 0
	}
}
