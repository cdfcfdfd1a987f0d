package userstack

import (
	"encoding/binary"
	"hash/maphash"

	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// A peer's pure ACK is often followed, inside one receive batch, by the
// next segment of its connection. An HTTP client on Linux acknowledges a
// multi-segment answer at once (more than one full segment received) and
// writes its next request microseconds later; at 50 keep-alive
// connections half the packets the application received were such ACKs,
// and three in four of them had their request behind them in the same
// batch. The request acknowledges as much or more, with a newer window and
// timestamp, so the ACK tells the stack nothing; yet in gVisor each costs a
// trip through IP, the transport demultiplexer and a TCP processor.
//
// The receive loop therefore drops a pure ACK that the next segment of its
// connection in the batch supersedes, as Linux merges a segment into the
// one before it in a busy socket's backlog (tcp_add_backlog). A pure ACK
// may be lost on any network, and TCP recovers from that with the next
// one; this is the harmless case of it, where the next one is already
// here. The rules keep every signal the ACK could carry alone:
//
//   - the ACK carries no data, no SYN, FIN, RST, URG, ECE or CWR, and no
//     SACK blocks (with SACK, a duplicate ACK that reports loss has them);
//   - the later segment starts at the ACK's sequence number, acknowledges
//     at least as much (strictly more if it is a pure ACK too, so that a
//     run of duplicate ACKs stays whole), carries ACK, no SYN, RST, URG,
//     ECE or CWR, the same IP TOS or traffic class, and the same TCP
//     options but for later timestamps;
//   - neither is one the bridge may take back (fabric.MarkMayReturn), and
//     the later segment's checksums verify.
type ackSuperseder struct {
	seed  maphash.Seed
	gen   uint32
	slots [supersedeSlots]flowSlot
}

// supersedeSlots is a power of two at least twice the largest batch (64),
// so that probes stay short.
const supersedeSlots = 128

// flowSlot remembers the latest packet of one flow in the batch.
type flowSlot struct {
	gen  uint32 // the batch it belongs to; another batch's slot is empty
	hash uint32
	last uint8 // the flow's latest packet in the batch
	ack  bool  // that packet is a pure ACK a later segment may supersede
	// tcpFrom and tcpTo locate that packet's TCP header (IP and TCP
	// headers are at most 60 bytes each).
	tcpFrom, tcpTo uint8
}

// tcpSegment finds the TCP header of p, an IPv4 packet that is not a
// fragment or an IPv6 packet without extension headers. It returns the
// header with its options, where in p it starts and the payload's length,
// or ok false if p is no such segment or its lengths disagree.
func tcpSegment(p []byte) (tcp []byte, at, payload int, ok bool) {
	var ipLen, total int
	switch {
	case len(p) >= header.IPv4MinimumSize && p[0]>>4 == 4:
		ipLen = int(p[0]&0xf) * 4
		total = int(binary.BigEndian.Uint16(p[2:]))
		flagsFrag := binary.BigEndian.Uint16(p[6:])
		if p[9] != uint8(header.TCPProtocolNumber) || flagsFrag&0x3fff != 0 || ipLen < header.IPv4MinimumSize {
			return nil, 0, 0, false // another protocol, or a fragment (MF or an offset)
		}
	case len(p) >= header.IPv6MinimumSize && p[0]>>4 == 6:
		ipLen = header.IPv6MinimumSize
		total = ipLen + int(binary.BigEndian.Uint16(p[4:]))
		if p[6] != uint8(header.TCPProtocolNumber) {
			return nil, 0, 0, false
		}
	default:
		return nil, 0, 0, false
	}
	if total > len(p) || total < ipLen+header.TCPMinimumSize {
		return nil, 0, 0, false
	}
	doff := int(p[ipLen+12]>>4) * 4
	if doff < header.TCPMinimumSize || ipLen+doff > total {
		return nil, 0, 0, false
	}
	return p[ipLen : ipLen+doff], ipLen, total - ipLen - doff, true
}

// segmentFlow is what flowHash hashes: a segment's addresses and ports.
type segmentFlow struct {
	addrs [32]byte // IPv4: the first 8
	ports uint32
}

// flowHash hashes a segment's flow with the superseder's seed, so that a
// peer cannot choose flows that collide; sameFlow settles collisions.
func (s *ackSuperseder) flowHash(p, tcp []byte) uint32 {
	var k segmentFlow
	if p[0]>>4 == 4 {
		copy(k.addrs[:8], p[12:20])
	} else {
		copy(k.addrs[:], p[8:40])
	}
	k.ports = binary.LittleEndian.Uint32(tcp)
	return uint32(maphash.Comparable(s.seed, k))
}

// sameFlow reports whether two TCP segments (as tcpSegment found them)
// travel in the same direction of the same connection.
func sameFlow(p, ptcp, q, qtcp []byte) bool {
	if p[0]>>4 != q[0]>>4 || binary.LittleEndian.Uint32(ptcp) != binary.LittleEndian.Uint32(qtcp) {
		return false
	}
	if p[0]>>4 == 4 {
		return string(p[12:20]) == string(q[12:20])
	}
	return string(p[8:40]) == string(q[8:40])
}

const (
	tcpFlagsNotOnAck    = header.TCPFlagSyn | header.TCPFlagRst | header.TCPFlagUrg | header.TCPFlagEce | header.TCPFlagCwr
	tcpOptionSACK       = 5
	tcpOptionTimestamps = 8
)

// supersedable reports whether tcp, a segment without payload, is a pure
// ACK that a later segment may stand in for.
func supersedable(tcp []byte) bool {
	if header.TCPFlags(tcp[13]) != header.TCPFlagAck {
		return false
	}
	opts := tcp[header.TCPMinimumSize:]
	for i := 0; i < len(opts); {
		switch opts[i] {
		case 0: // end of options
			return true
		case 1: // no-op
			i++
			continue
		}
		if i+1 >= len(opts) || opts[i+1] < 2 || i+int(opts[i+1]) > len(opts) {
			return false // malformed: let the stack judge it
		}
		if opts[i] == tcpOptionSACK {
			return false
		}
		i += int(opts[i+1])
	}
	return true
}

// supersedes reports whether segment q, the next of its flow after the
// pure ACK p, carries everything p does (see ackSuperseder).
func supersedes(p, ptcp, q, qtcp []byte, qPayload int) bool {
	if header.TCPFlags(qtcp[13])&header.TCPFlagAck == 0 || header.TCPFlags(qtcp[13])&tcpFlagsNotOnAck != 0 {
		return false
	}
	if len(ptcp) != len(qtcp) || trafficClass(p) != trafficClass(q) {
		return false
	}
	if binary.BigEndian.Uint32(qtcp[4:]) != binary.BigEndian.Uint32(ptcp[4:]) {
		return false // not the next byte of the stream: a probe, or reordered
	}
	advance := int32(binary.BigEndian.Uint32(qtcp[8:]) - binary.BigEndian.Uint32(ptcp[8:]))
	pureToo := qPayload == 0 && header.TCPFlags(qtcp[13])&header.TCPFlagFin == 0
	if advance < 0 || (advance == 0 && pureToo) {
		return false
	}
	return sameOptions(ptcp[header.TCPMinimumSize:], qtcp[header.TCPMinimumSize:])
}

// trafficClass is the IPv4 TOS or the IPv6 traffic class byte.
func trafficClass(p []byte) byte {
	if p[0]>>4 == 4 {
		return p[1]
	}
	return p[0]<<4 | p[1]>>4
}

// sameOptions reports whether two TCP option areas of equal length hold
// the same options, timestamps allowed to move forward.
func sameOptions(a, b []byte) bool {
	for i := 0; i < len(a); {
		if a[i] != b[i] {
			return false
		}
		switch a[i] {
		case 0:
			return string(a[i:]) == string(b[i:])
		case 1:
			i++
			continue
		}
		if i+1 >= len(a) || a[i+1] != b[i+1] || a[i+1] < 2 || i+int(a[i+1]) > len(a) {
			return false
		}
		n := int(a[i+1])
		if a[i] == tcpOptionTimestamps && n == 10 {
			if int32(binary.BigEndian.Uint32(b[i+2:])-binary.BigEndian.Uint32(a[i+2:])) < 0 ||
				int32(binary.BigEndian.Uint32(b[i+6:])-binary.BigEndian.Uint32(a[i+6:])) < 0 {
				return false
			}
		} else if string(a[i:i+n]) != string(b[i:i+n]) {
			return false
		}
		i += n
	}
	return true
}

// mark finds the superseded pure ACKs among the batch's first n packets
// and sets skip for them. verdicts gets each packet's check (computed
// here), meta holds the packets' metadata words. Flows are looked up only
// from the batch's first pure ACK on, and only flows whose latest packet is
// such an ACK are remembered: a batch of data alone costs a glance per
// packet.
func (s *ackSuperseder) mark(bufs [][]byte, meta []uint32, verdicts []verdict, skip []bool, n int) (superseded int) {
	armed := false
	for j := 0; j < n; j++ {
		q := bufs[j]
		skip[j] = false
		verdicts[j] = check(q)
		qtcp, at, qPayload, ok := tcpSegment(q)
		if !ok {
			continue
		}
		ack := qPayload == 0 && meta[j]&fabric.MarkMayReturn == 0 && supersedable(qtcp)
		if !armed {
			if !ack {
				continue // nothing before the first pure ACK can supersede one
			}
			s.arm()
			armed = true
		}
		h := s.flowHash(q, qtcp)
		for k := h; ; k++ {
			slot := &s.slots[k&(supersedeSlots-1)]
			if slot.gen != s.gen {
				if ack { // the flow's first pure ACK in the batch
					*slot = flowSlot{gen: s.gen, hash: h, ack: true}
					slot.remember(j, at, len(qtcp))
				}
				break
			}
			if slot.hash != h {
				continue
			}
			p := bufs[slot.last]
			ptcp := p[slot.tcpFrom:slot.tcpTo]
			if !sameFlow(p, ptcp, q, qtcp) {
				continue
			}
			if slot.ack && verdicts[j] == verified && meta[j]&fabric.MarkMayReturn == 0 &&
				supersedes(p, ptcp, q, qtcp, qPayload) {
				skip[slot.last] = true
				superseded++
			}
			slot.ack = ack
			slot.remember(j, at, len(qtcp))
			break
		}
	}
	return superseded
}

// arm readies the table for a new batch: every slot of an earlier one
// counts as empty.
func (s *ackSuperseder) arm() {
	if s.seed == (maphash.Seed{}) {
		s.seed = maphash.MakeSeed()
	}
	s.gen++
	if s.gen == 0 {
		s.slots = [supersedeSlots]flowSlot{}
		s.gen = 1
	}
}

// remember makes packet j, whose TCP header of size bytes starts at at,
// the flow's latest.
func (f *flowSlot) remember(j, at, size int) {
	f.last, f.tcpFrom, f.tcpTo = uint8(j), uint8(at), uint8(at+size)
}
