package userstack

import (
	"encoding/binary"
	"math"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// Delayed ACKs.
//
// gVisor acknowledges every batch of segments it processes at once, with a
// pure ACK, before the application has had a chance to answer. A request
// of a few hundred bytes therefore costs a packet more than on the
// kernel's path, whose delayed ACK rides on the response: one more frame
// through the stack's send path, the stream, the bridge's transmit and the
// peer's receive path (a fifth of the frames of a keep-alive HTTP
// exchange with a 4 KB answer). The link endpoint holds such an ACK back
// for a short time instead. If the connection sends anything else first,
// that segment carries the same or a later acknowledgment and window, and
// the held ACK is dropped; otherwise it leaves when its time is up.
//
// Only what a peer cannot miss is held, the way a kernel delays ACKs:
//   - a pure ACK (no data, no SYN, FIN or RST) without SACK blocks, which
//     advances the acknowledgment, by less than two full segments, past
//     the last one the connection sent. ACKs of bulk data (two segments
//     or more), duplicate ACKs and window updates leave at once, so a
//     sender's ACK clock and fast retransmit see what they did before;
//   - one per connection: a second pure ACK that acknowledges more
//     replaces it, one that acknowledges no more sends both;
//   - only while the connection answers: once a held ACK has had to leave
//     on its own, the connection's ACKs go at once until it sends data
//     again (a new connection on its ports starts afresh). A receiver of
//     bulk data never answers, and a sender whose Nagle algorithm keeps a
//     write's last partial segment back until everything before it is
//     acknowledged would otherwise wait a hold for it, write after write
//     (socat into `app sink`: 1.0 Gbit/s with such holds, 1.5 without).
//
// Connections are tracked in a fixed table: a hash of their addresses and
// ports picks a set of four entries. A connection new to a full set takes
// an entry that holds nothing, or else sends the ACK another holds and
// takes that one. Nothing grows, and a connection the table has no
// history for is not held.

const (
	// ackHold is how long an ACK waits. Under 2 ms keeps it below the
	// earliest a Linux peer probes for a lost tail when it has more than
	// one segment unacknowledged (twice the RTT plus two jiffies, 2 ms at
	// HZ=1000); with one, it adds the 200 ms minimum RTO, and its own
	// delayed ACKs wait 40 ms. Longer holds absorb more under deep queues
	// (at 1000 connections on 2 vCPUs, 20–40 ms absorbed nearly all and
	// 1–2 ms 60 %), at the price of probes from such peers.
	ackHold = time.Millisecond
	// ackSetBits and ackWays size the table: 1024 sets of 4 entries of
	// 160 bytes. A thousand busy connections rarely fill a set.
	ackSetBits = 10
	ackWays    = 4
	// ackFrameMax is the largest pure ACK held: IPv6 and TCP headers with
	// options.
	ackFrameMax = header.IPv6MinimumSize + header.TCPHeaderMaximumSize
)

// ackFlow names a connection: local then remote address (IPv4 in the
// first four bytes of each half) and the two ports.
type ackFlow struct {
	addrs [32]byte
	ports uint32
	v6    bool
}

// ackSlot is one connection's entry.
type ackSlot struct {
	key     ackFlow
	used    bool
	holding bool
	// quick sends this connection's ACKs at once: its last hold ran out
	// with nothing sent to carry it, as on a connection that only
	// receives. Data it sends clears it (as Linux leaves and enters its
	// interactive "pingpong" mode).
	quick   bool
	sentAck uint32 // the acknowledgment number the connection last sent
	heldAck uint32
	gen     uint32 // counts holds, to tell a queued reference from a stale one
	n       uint8
	frame   [ackFrameMax]byte
}

// heldRef queues a hold, in the order the holds were made.
type heldRef struct {
	slot, gen uint32
	due       int64 // sinceStart when the ACK must leave
}

// ackHolder is the endpoint's delayed-ACK state. It is guarded by the
// transmit lock (txState).
type ackHolder struct {
	slots []ackSlot
	queue []heldRef // holds in order; stale ones are skipped
	head  int
	armed bool // timer runs
	timer *time.Timer
	// next is the due time of the oldest hold (noneDue: none), for the
	// receive loop to look at without the lock.
	next atomic.Int64
}

// outSeg is what the holder reads from a segment the stack sends.
type outSeg struct {
	key     ackFlow
	ack     uint32
	flags   header.TCPFlags
	pureAck bool   // an ACK alone: no data, SYN, FIN, RST or SACK blocks
	data    bool   // carries payload
	size    int    // the whole packet's length
	slot    uint32 // its table entry, once judged
}

// parseOut reads pkt's TCP and IP headers. ok is false for anything but a
// TCP segment over IPv4 or plain IPv6.
func parseOut(pkt *stack.PacketBuffer) (s outSeg, ok bool) {
	if pkt.TransportProtocolNumber != header.TCPProtocolNumber {
		return s, false
	}
	nh := pkt.NetworkHeader().Slice()
	switch pkt.NetworkProtocolNumber {
	case header.IPv4ProtocolNumber:
		if len(nh) < header.IPv4MinimumSize {
			return s, false
		}
		copy(s.key.addrs[0:4], nh[12:16])
		copy(s.key.addrs[16:20], nh[16:20])
	case header.IPv6ProtocolNumber:
		if len(nh) != header.IPv6MinimumSize || nh[6] != uint8(header.TCPProtocolNumber) {
			return s, false
		}
		copy(s.key.addrs[:], nh[8:40])
		s.key.v6 = true
	default:
		return s, false
	}
	th := header.TCP(pkt.TransportHeader().Slice())
	if len(th) < header.TCPMinimumSize || th.DataOffset() < header.TCPMinimumSize || int(th.DataOffset()) > len(th) {
		return s, false
	}
	s.key.ports = uint32(th.SourcePort())<<16 | uint32(th.DestinationPort())
	s.ack = th.AckNumber()
	s.flags = th.Flags()
	s.size = pkt.Size()
	s.data = pkt.Data().Size() > 0
	s.pureAck = s.flags == header.TCPFlagAck && !s.data && !hasSACK(th[header.TCPMinimumSize:th.DataOffset()])
	return s, true
}

// hasSACK reports whether TCP options carry SACK blocks.
func hasSACK(opts []byte) bool {
	for i := 0; i < len(opts); {
		switch opts[i] {
		case header.TCPOptionEOL:
			return false
		case header.TCPOptionNOP:
			i++
		case header.TCPOptionSACK:
			return true
		default:
			if i+1 >= len(opts) || opts[i+1] < 2 {
				return false
			}
			i += int(opts[i+1])
		}
	}
	return false
}

// newAckHolder returns the state of an endpoint that delays ACKs.
func newAckHolder(e *LinkEndpoint) *ackHolder {
	a := &ackHolder{slots: make([]ackSlot, ackWays<<ackSetBits)}
	a.timer = time.AfterFunc(time.Hour, e.expireAcks)
	a.timer.Stop()
	a.next.Store(noneDue)
	return a
}

// setOf returns the index of the first entry of k's set.
func setOf(k *ackFlow) uint32 {
	h := uint64(k.ports) ^ binary.LittleEndian.Uint64(k.addrs[16:24])<<7 ^ binary.LittleEndian.Uint64(k.addrs[24:32])
	h ^= binary.LittleEndian.Uint64(k.addrs[0:8]) >> 3
	return uint32((h*0x9e3779b97f4a7c15)>>(64-ackSetBits)) * ackWays
}

// find returns k's entry and whether it is k's already. If it is not, the
// entry is the one k may take: a free one, else one holding nothing, else
// the set's first.
func (a *ackHolder) find(k *ackFlow) (uint32, *ackSlot, bool) {
	base := setOf(k)
	pick, rank := base, 3
	for i := base; i < base+ackWays; i++ {
		s := &a.slots[i]
		r := 2 // holding
		switch {
		case s.used && s.key == *k:
			return i, s, true
		case !s.used:
			r = 0
		case !s.holding:
			r = 1
		}
		if r < rank {
			pick, rank = i, r
		}
	}
	return pick, &a.slots[pick], false
}

// noneDue is heldRef.due's "never".
const noneDue = math.MaxInt64

// startTime anchors sinceStart.
var startTime = time.Now()

// sinceStart is monotonic time in nanoseconds: one clock read.
func sinceStart() int64 { return int64(time.Since(startTime)) }

// seqAfter reports whether sequence number a comes after b.
func seqAfter(a, b uint32) bool { return int32(a-b) > 0 }

// ackVerdict is what writeLocked does with a segment about to be sent.
type ackVerdict uint8

const (
	ackSend ackVerdict = iota // send it
	ackKeep                   // send it into the holder instead (holdLast)
)

// judge decides a segment's fate before it is written and settles the
// entry's held ACK: one that the segment makes redundant is dropped, one
// that must leave first is written to the batch now. mss bounds what a
// held ACK may acknowledge. The caller holds e.tx.
func (e *LinkEndpoint) judge(s *outSeg, mss uint32) (ackVerdict, error) {
	a := e.tx.acks
	i, slot, ok := a.find(&s.key)
	s.slot = i
	if !ok {
		if slot.holding {
			if err := e.releaseHeld(slot); err != nil {
				return ackSend, err
			}
		}
		*slot = ackSlot{key: s.key, used: true, sentAck: s.ack, gen: slot.gen}
		return ackSend, nil
	}
	if s.flags&(header.TCPFlagSyn|header.TCPFlagRst) != 0 || s.flags&header.TCPFlagAck == 0 {
		// A new connection on the same ports, or one ending: whatever is
		// held leaves first, and the history starts again.
		if slot.holding {
			if err := e.releaseHeld(slot); err != nil {
				return ackSend, err
			}
		}
		slot.sentAck, slot.quick = s.ack, false
		return ackSend, nil
	}
	if s.data {
		slot.quick = false
	}
	if s.pureAck && !slot.quick && s.size <= ackFrameMax && seqAfter(s.ack, slot.sentAck) && s.ack-slot.sentAck < 2*mss &&
		(!slot.holding || seqAfter(s.ack, slot.heldAck)) {
		if slot.holding {
			e.stats.txAcksAbsorbed.Add(1) // the new one acknowledges more
			slot.holding = false
		}
		return ackKeep, nil
	}
	if slot.holding {
		// One that acknowledges less, or a pure ACK that acknowledges no
		// more (a duplicate or a window update, which the peer counts):
		// both go.
		if seqAfter(slot.heldAck, s.ack) || s.pureAck && s.ack == slot.heldAck {
			if err := e.releaseHeld(slot); err != nil {
				return ackSend, err
			}
		} else {
			slot.holding = false
			e.stats.txAcksAbsorbed.Add(1)
		}
	}
	slot.sentAck = s.ack
	return ackSend, nil
}

// holdLast moves the packet just written, the last of the batch, into the
// entry of s and queues it to leave when due. The caller holds e.tx.
func (e *LinkEndpoint) holdLast(s *outSeg) {
	t := &e.tx
	a := t.acks
	i := s.slot
	slot := &a.slots[i]
	p := t.batch[len(t.batch)-1]
	t.batch = t.batch[:len(t.batch)-1]
	slot.n = uint8(copy(slot.frame[:], p))
	slot.holding = true
	slot.heldAck = s.ack
	slot.gen++
	due := sinceStart() + int64(ackHold)
	if a.head == len(a.queue) {
		a.next.Store(due)
	}
	a.queue = append(a.queue, heldRef{slot: i, gen: slot.gen, due: due})
	e.stats.txAcksDelayed.Add(1)
	if !a.armed {
		a.armed = true
		a.timer.Reset(ackHold)
	}
}

// releaseHeld writes slot's held ACK to the batch. The caller holds e.tx.
func (e *LinkEndpoint) releaseHeld(slot *ackSlot) error {
	slot.holding = false
	slot.sentAck = slot.heldAck
	dst, err := e.slot()
	if err != nil {
		return err
	}
	e.tx.batch = append(e.tx.batch, dst[:copy(dst, slot.frame[:slot.n])])
	return nil
}

// expireDueAcks sends the held ACKs whose time is up. The receive loop
// calls it after every batch: under load the timer's goroutine can wait
// for a P behind every runnable goroutine of the application (at 1000
// connections long enough for peers to probe for lost segments), while
// the loop runs whenever packets arrive.
func (e *LinkEndpoint) expireDueAcks() {
	a := e.tx.acks
	if a == nil || a.next.Load() == noneDue {
		return
	}
	if now := sinceStart(); now >= a.next.Load() {
		e.tx.Lock()
		e.sendDueLocked(now)
		e.tx.Unlock()
	}
}

// sendHeldAcks sends every held ACK now: the stack is about to give back
// claims, and a connection's ACK must not leave after its claim.
func (e *LinkEndpoint) sendHeldAcks() {
	if e.tx.acks == nil || e.tx.acks.next.Load() == noneDue {
		return
	}
	e.tx.Lock()
	e.sendDueLocked(math.MaxInt64)
	e.tx.Unlock()
}

// expireAcks runs on the hold timer: it sends the ACKs whose time is up
// and rearms for the next while any are held.
func (e *LinkEndpoint) expireAcks() {
	t := &e.tx
	t.Lock()
	defer t.Unlock()
	a := t.acks
	a.armed = false
	select {
	case <-e.done: // the link is gone: nothing can leave
		a.queue, a.head = a.queue[:0], 0
		a.next.Store(noneDue)
		return
	default:
	}
	now := sinceStart()
	e.sendDueLocked(now)
	if next := a.next.Load(); next != noneDue {
		a.armed = true
		a.timer.Reset(time.Duration(max(next-now, int64(ackHold)/8)))
	}
}

// sendDueLocked sends the ACKs due by now. The caller holds e.tx.
func (e *LinkEndpoint) sendDueLocked(now int64) {
	a := e.tx.acks
	sent := false
	for a.head < len(a.queue) {
		r := a.queue[a.head]
		if r.due > now {
			break
		}
		a.head++
		slot := &a.slots[r.slot]
		if !slot.holding || slot.gen != r.gen {
			continue
		}
		if e.releaseHeld(slot) != nil {
			break // the link refused the batch; the receive loop reports it
		}
		slot.quick = true
		sent = true
	}
	if a.head == len(a.queue) {
		a.queue, a.head = a.queue[:0], 0
		a.next.Store(noneDue)
	} else {
		if a.head > len(a.queue)/2 {
			a.queue = a.queue[:copy(a.queue, a.queue[a.head:])]
			a.head = 0
		}
		a.next.Store(a.queue[a.head].due)
	}
	if sent {
		_ = e.flush()
	}
}
