package classifier

import (
	"encoding/binary"
	"net/netip"
)

// IngestMetaSize is the size of IngestMeta in the XDP metadata area.
const IngestMetaSize = 40

// MinStrippedFrame is the shortest frame the kernel leaves after stripping
// headers (bpf_xdp_adjust_head keeps an Ethernet header's worth, 14 bytes).
// A datagram whose payload and trailing padding are shorter keeps some header
// bytes in front of its payload; IngestMeta.PayloadOffset says how many.
const MinStrippedFrame = 14

// IngestMeta is what the XDP program writes in front of an ingest frame
// after stripping its Ethernet, VLAN, IP and UDP headers (struct
// fb_ingest_meta in the C source; package ebpf checks the two agree field by
// field). The offload engine needs nothing else: it never parses headers,
// and the payload is at PayloadOffset in the stripped frame.
//
// Like Meta, it ends with the verdict and flags bytes, so the byte just in
// front of any redirected frame names the layout in front of it:
// VerdictIngest for IngestMeta, VerdictSteer for Meta.
type IngestMeta struct {
	RxTimestampNs uint64   // CLOCK_MONOTONIC; set by the receive path, 0 from Ingest
	Src           [16]byte // source address; IPv4 as IPv4-mapped IPv6 (::ffff:a.b.c.d)
	BufferID      uint32   // the ingest buffer (the rule's Stream)
	RuleID        uint16   // the ingest rule; rule ids fit (MaxRuleID < 1<<16)
	SrcPort       uint16
	DstPort       uint16
	PayloadLen    uint16 // UDP length minus its header
	PayloadOffset uint8  // payload start in the stripped frame: 0 unless the frame was short
	_             uint8
	Verdict       Verdict // always VerdictIngest
	Flags         uint8   // FlagIPv6 for an IPv6 source
}

// SrcAddr is the source address, IPv4 unmapped.
func (m *IngestMeta) SrcAddr() netip.Addr { return netip.AddrFrom16(m.Src).Unmap() }

// MarshalTo writes m in the metadata area's byte order (the host's) into b,
// which must hold IngestMetaSize bytes.
func (m *IngestMeta) MarshalTo(b []byte) {
	_ = b[IngestMetaSize-1]
	ne := binary.NativeEndian
	ne.PutUint64(b[0:], m.RxTimestampNs)
	copy(b[8:24], m.Src[:])
	ne.PutUint32(b[24:], m.BufferID)
	ne.PutUint16(b[28:], m.RuleID)
	ne.PutUint16(b[30:], m.SrcPort)
	ne.PutUint16(b[32:], m.DstPort)
	ne.PutUint16(b[34:], m.PayloadLen)
	b[36] = m.PayloadOffset
	b[37] = 0
	b[38] = uint8(m.Verdict)
	b[39] = m.Flags
}

// UnmarshalIngestMeta reads ingest metadata written by the XDP program; b
// must hold IngestMetaSize bytes. It checks nothing: the offload engine
// checks Verdict and that the payload fits the frame.
func UnmarshalIngestMeta(b []byte) IngestMeta {
	_ = b[IngestMetaSize-1]
	ne := binary.NativeEndian
	m := IngestMeta{
		RxTimestampNs: ne.Uint64(b[0:]),
		BufferID:      ne.Uint32(b[24:]),
		RuleID:        ne.Uint16(b[28:]),
		SrcPort:       ne.Uint16(b[30:]),
		DstPort:       ne.Uint16(b[32:]),
		PayloadLen:    ne.Uint16(b[34:]),
		PayloadOffset: b[36],
		Verdict:       Verdict(b[38]),
		Flags:         b[39],
	}
	copy(m.Src[:], b[8:24])
	return m
}

// Ingest is the reference for what the XDP program does to a frame that
// Classify gave VerdictIngest: it removes the first strip bytes (Ethernet to
// the end of the UDP header, or fewer when that would leave less than
// MinStrippedFrame bytes) and writes im in front of the rest. ok is false
// for any other classification, or if m does not describe frame.
func Ingest(frame []byte, m *Meta) (im IngestMeta, strip int, ok bool) {
	l3, l4 := int(m.L3Offset), int(m.L4Offset)
	if m.Verdict != VerdictIngest || l3 < ethHdrLen || l4 < l3+20 || l4+8 > len(frame) {
		return im, 0, false
	}
	ulen := int(be16(frame[l4+4:]))
	if ulen < 8 || l4+ulen > len(frame) || m.RuleID > 0xffff {
		return im, 0, false
	}
	if m.Flags&FlagIPv6 != 0 {
		if l4 < l3+40 {
			return im, 0, false
		}
		copy(im.Src[:], frame[l3+8:l3+24])
	} else {
		im.Src[10], im.Src[11] = 0xff, 0xff
		copy(im.Src[12:], frame[l3+12:l3+16])
	}
	im.BufferID = m.StreamID
	im.RuleID = uint16(m.RuleID)
	im.SrcPort = be16(frame[l4:])
	im.DstPort = be16(frame[l4+2:])
	im.PayloadLen = uint16(ulen - 8)
	im.Verdict = VerdictIngest
	im.Flags = m.Flags & FlagIPv6
	hdr := l4 + 8
	strip = min(hdr, len(frame)-MinStrippedFrame)
	im.PayloadOffset = uint8(hdr - strip)
	return im, strip, true
}
