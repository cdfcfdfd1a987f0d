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
// Credit updates are control packets (O set, no payload, protocol type 0)
// carrying one option in the experimental class range: class 0xFFF0,
// type 0x01, length 1 word, value = u32 big-endian count of packets the
// receiver has consumed on that stream since it was registered.
// Because the standard port and header are used, tshark and Wireshark
// decode the traffic as GENEVE without configuration.

const (
	// GenevePort is the IANA port for GENEVE.
	GenevePort = 6081

	geneveHdrLen   = 8
	protoIPv4      = 0x0800
	protoIPv6      = 0x86DD
	flagControl    = 0x80
	flagCritical   = 0x40
	creditOptClass = 0xFFF0
	creditOptType  = 0x01
	creditMsgLen   = geneveHdrLen + 8
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
	putGeneve(b, vni, 0, 2, true)
	binary.BigEndian.PutUint16(b[8:], creditOptClass)
	b[10] = creditOptType
	b[11] = 1
	binary.BigEndian.PutUint32(b[12:], consumed)
}

// geneveMsg is a parsed datagram; payload aliases the input.
type geneveMsg struct {
	vni       uint32
	proto     uint16
	control   bool
	hasCredit bool
	credit    uint32
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
		case class == creditOptClass && typ == creditOptType && l == 8:
			m.hasCredit, m.credit = true, binary.BigEndian.Uint32(opts[4:])
		case typ&0x80 != 0 && critical:
			return m, errMalformed // unknown critical option: must drop
		}
		opts = opts[l:]
	}
	m.payload = b[geneveHdrLen+optLen:]
	if m.control {
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
