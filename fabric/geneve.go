package fabric

import (
	"encoding/binary"
	"errors"
)

// GENEVE framing (RFC 8926) for the remote transport. Every fabric packet
// travels as one UDP datagram to port 6081:
//
//	0      u8   version (2 bits, 0) | option length in 4-byte words (6 bits)
//	1      u8   O (control) | C (critical options) | 6 reserved bits
//	2      u16  protocol type, big-endian: 0x0800 IPv4, 0x86DD IPv6
//	4      u24  VNI = stream id, big-endian; then u8 reserved
//	8      options, then the inner IP packet
//
// Fabric control messages are GENEVE control packets (O set, no payload)
// with protocol type 0x88B5, IEEE 802's "Local Experimental Ethertype 1",
// the one value set aside for private protocols that are never assigned
// to anything else: RFC 8926 makes the field an Ethertype and asks nothing
// more of control packets, and 0 would be a non-Ethertype that analysers
// show as an error. Their options come from the option class range
// 0xFFF0-0xFFFF that IANA reserves for experimental use:
//
//	class 0xFFF0, type 0x01, length 1 word: credit, a u32 big-endian count
//	    of packets the sender of the option has consumed on that stream
//	    since it was registered. Sent when it changes and, unchanged, as
//	    the stream's keepalive.
//	class 0xFFF0, type 0x02, length 0: goodbye, the sender closed the
//	    stream; the receiver breaks its end once it has drained it.
//
// Data packets carry one option of the same class, only when they have
// something to say, so that a plain packet's datagram is what it always
// was and a receiver that does not know the option skips it (it is not
// critical):
//
//	class 0xFFF0, type 0x03, length 1 word: marks, the u32 big-endian
//	    high bits of the packet's metadata word in its stream (see
//	    MarkMayReturn). The rule id in the low bits is the bridge's own
//	    business and does not travel.
//
// A control packet with another protocol type, or a data packet with the
// O bit, is refused as malformed. Because the standard port and header
// are used, tshark and Wireshark decode the traffic as GENEVE without
// configuration (TestTsharkDecodesGeneve checks it).

const (
	// GenevePort is the IANA port for GENEVE.
	GenevePort = 6081

	geneveHdrLen   = 8
	protoIPv4      = 0x0800
	protoIPv6      = 0x86DD
	protoControl   = 0x88B5 // IEEE 802 Local Experimental Ethertype 1
	flagControl    = 0x80
	flagCritical   = 0x40
	fabricOptClass = 0xFFF0
	creditOptType  = 0x01
	closeOptType   = 0x02
	marksOptType   = 0x03
	marksOptLen    = 8 // the marks option, header included
	creditMsgLen   = geneveHdrLen + 8
	closeMsgLen    = geneveHdrLen + 4
	maxVNI         = 1<<24 - 1
)

var errMalformed = errors.New("fabric: malformed GENEVE packet")

func putGeneve(b []byte, vni uint32, proto uint16, optWords uint8, control bool) {
	b[0] = optWords & 0x3f
	b[1] = 0
	if control {
		b[1] = flagControl
	}
	binary.BigEndian.PutUint16(b[2:], proto)
	binary.BigEndian.PutUint32(b[4:], vni<<8)
}

func putCredit(b []byte, vni, consumed uint32) {
	putGeneve(b, vni, protoControl, 2, true)
	binary.BigEndian.PutUint16(b[8:], fabricOptClass)
	b[10] = creditOptType
	b[11] = 1
	binary.BigEndian.PutUint32(b[12:], consumed)
}

// putMarks writes the marks option behind a data packet's base header,
// which putGeneve wrote with two option words.
func putMarks(b []byte, marks uint32) {
	binary.BigEndian.PutUint16(b[8:], fabricOptClass)
	b[10] = marksOptType
	b[11] = 1
	binary.BigEndian.PutUint32(b[12:], marks)
}

func putGoodbye(b []byte, vni uint32) {
	putGeneve(b, vni, protoControl, 1, true)
	binary.BigEndian.PutUint16(b[8:], fabricOptClass)
	b[10] = closeOptType
	b[11] = 0
}

// geneveMsg is a parsed datagram; payload aliases the input.
type geneveMsg struct {
	vni       uint32
	proto     uint16
	control   bool
	hasCredit bool
	credit    uint32
	goodbye   bool
	marks     uint32 // of a data packet: MarkMask bits only
	payload   []byte
}

// parseGeneve validates a datagram from the network. It never reads past
// b, refuses other versions, unknown critical options, and data packets
// whose protocol type does not match the inner IP version.
func parseGeneve(b []byte) (geneveMsg, error) {
	var m geneveMsg
	if len(b) < geneveHdrLen || b[0]>>6 != 0 {
		return m, errMalformed
	}
	optLen := int(b[0]&0x3f) * 4
	if len(b) < geneveHdrLen+optLen {
		return m, errMalformed
	}
	m.control = b[1]&flagControl != 0
	critical := b[1]&flagCritical != 0
	m.proto = binary.BigEndian.Uint16(b[2:])
	m.vni = binary.BigEndian.Uint32(b[4:]) >> 8
	opts := b[geneveHdrLen : geneveHdrLen+optLen]
	for len(opts) > 0 {
		if len(opts) < 4 {
			return m, errMalformed
		}
		class, typ := binary.BigEndian.Uint16(opts), opts[2]
		l := 4 + int(opts[3]&0x1f)*4
		if l > len(opts) {
			return m, errMalformed
		}
		switch {
		case class == fabricOptClass && typ == creditOptType && l == 8:
			m.hasCredit, m.credit = true, binary.BigEndian.Uint32(opts[4:])
		case class == fabricOptClass && typ == closeOptType && l == 4:
			m.goodbye = true
		case class == fabricOptClass && typ == marksOptType && l == 8:
			m.marks = binary.BigEndian.Uint32(opts[4:]) & MarkMask
		case typ&0x80 != 0 && critical:
			return m, errMalformed // unknown critical option: must drop
		}
		opts = opts[l:]
	}
	m.payload = b[geneveHdrLen+optLen:]
	if m.control {
		if m.proto != protoControl {
			return m, errMalformed
		}
		return m, nil
	}
	if len(m.payload) == 0 {
		return m, errMalformed
	}
	switch v := m.payload[0] >> 4; {
	case v == 4 && m.proto == protoIPv4, v == 6 && m.proto == protoIPv6:
		return m, nil
	}
	return m, errMalformed
}

// protoFor picks the GENEVE protocol type from the IP version nibble.
func protoFor(pkt []byte) (uint16, bool) {
	if len(pkt) == 0 {
		return 0, false
	}
	switch pkt[0] >> 4 {
	case 4:
		return protoIPv4, true
	case 6:
		return protoIPv6, true
	}
	return 0, false
}
