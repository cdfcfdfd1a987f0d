package classifier

import (
	"encoding/binary"
	"fmt"
	"iter"
	"maps"
	"slices"
	"sync/atomic"
)

// Verdict is the outcome of classifying one frame. The values are shared with
// the XDP program, where they index the per-verdict counters.
type Verdict uint8

// Verdicts.
const (
	VerdictPass      Verdict = iota // the kernel gets it: no match, a pass rule, or not classified
	VerdictDrop                     // a drop rule matched
	VerdictSteer                    // deliver to Meta.StreamID
	VerdictIngest                   // UDP offload into ingest buffer Meta.StreamID (metadata: IngestMeta)
	VerdictMalformed                // broken headers, or UDP unfit for ingest; the kernel gets it, never a stream
	VerdictFragMiss                 // a later fragment with no first fragment seen; the kernel gets it
	NumVerdicts
)

var verdictNames = [NumVerdicts]string{"pass", "drop", "steer", "ingest", "malformed", "fragmiss"}

func (v Verdict) String() string {
	if v < NumVerdicts {
		return verdictNames[v]
	}
	return fmt.Sprintf("verdict(%d)", uint8(v))
}

// Meta flags.
const (
	FlagIPv6          = 1 << 0 // the L3 header is IPv6
	FlagFragment      = 1 << 1 // the packet is one fragment of a datagram
	FlagLaterFragment = 1 << 2 // a fragment other than the first: no L4 header
	FlagSecondChance  = 1 << 3 // steered by a Spread slot that has a Previous owner
)

// MetaSize is the size of Meta in the XDP metadata area.
const MetaSize = 24

// Meta is the classification of one frame. Its layout is the XDP metadata
// written in front of every steered frame (struct fb_meta in the C source;
// package ebpf checks field by field that the two agree), so user space never
// parses a frame twice.
type Meta struct {
	RxTimestampNs uint64 // CLOCK_MONOTONIC; set by the receive path for ingest frames, and for steered ones while a capture asks (ebpf.Program.StampSteered); 0 from Classify
	StreamID      uint32 // stream (steer) or ingest buffer (ingest); 0 otherwise
	RuleID        uint32 // the flow, listener or rule that decided; 0 for none
	L3Offset      uint16 // start of the IP header
	L4Offset      uint16 // start of the L4 header, or of the payload of a later fragment
	VLAN          uint16 // innermost VLAN id, 0 if untagged
	Verdict       Verdict
	Flags         uint8
}

// MarshalTo writes m in the metadata area's byte order (the host's) into b,
// which must hold MetaSize bytes.
func (m *Meta) MarshalTo(b []byte) {
	_ = b[MetaSize-1]
	ne := binary.NativeEndian
	ne.PutUint64(b[0:], m.RxTimestampNs)
	ne.PutUint32(b[8:], m.StreamID)
	ne.PutUint32(b[12:], m.RuleID)
	ne.PutUint16(b[16:], m.L3Offset)
	ne.PutUint16(b[18:], m.L4Offset)
	ne.PutUint16(b[20:], m.VLAN)
	b[22] = uint8(m.Verdict)
	b[23] = m.Flags
}

// UnmarshalMeta reads metadata written by the XDP program; b must hold
// MetaSize bytes.
func UnmarshalMeta(b []byte) Meta {
	_ = b[MetaSize-1]
	ne := binary.NativeEndian
	return Meta{
		RxTimestampNs: ne.Uint64(b[0:]),
		StreamID:      ne.Uint32(b[8:]),
		RuleID:        ne.Uint32(b[12:]),
		L3Offset:      ne.Uint16(b[16:]),
		L4Offset:      ne.Uint16(b[18:]),
		VLAN:          ne.Uint16(b[20:]),
		Verdict:       Verdict(b[22]),
		Flags:         b[23],
	}
}

// Tables is a compiled RuleSet. Its listeners and rules are immutable once
// built; its exact flows change in place, one at a time (AddFlow,
// RemoveFlow), under the feet of the Classifiers that use it.
type Tables struct {
	flows     *flowTable
	listeners map[ListenKey]Target
	spreads   map[ListenKey]*Spread // the listeners that have one; nil if none
	rules     []CompiledRule
}

// DefaultFragmentCapacity is the size of the fragment table, the same in the
// XDP program.
const DefaultFragmentCapacity = 8192

// Classifier is the reference classifier. The tables may be swapped while it
// runs; the fragment table is its own, so use one Classifier per receive queue
// (fragments of one datagram hash to one queue) and do not share it between
// goroutines.
type Classifier struct {
	tables atomic.Pointer[Tables]
	frags  fragTable
}

// New returns a classifier over t with a fragment table of fragCapacity
// entries (DefaultFragmentCapacity if 0).
func New(t *Tables, fragCapacity int) *Classifier {
	if fragCapacity <= 0 {
		fragCapacity = DefaultFragmentCapacity
	}
	c := &Classifier{frags: fragTable{cap: fragCapacity, m: make(map[fragKey]fragEntry, fragCapacity)}}
	c.tables.Store(t)
	return c
}

// SetTables replaces the tables atomically: every frame is classified wholly
// by the old tables or wholly by the new.
func (c *Classifier) SetTables(t *Tables) { c.tables.Store(t) }

// ResetFragments forgets every remembered first fragment.
func (c *Classifier) ResetFragments() { clear(c.frags.m) }

// EtherTypes the parser knows.
const (
	etherIPv4  = 0x0800
	etherIPv6  = 0x86dd
	etherVLAN  = 0x8100
	etherQinQ  = 0x88a8
	ethHdrLen  = 14
	vlanHdrLen = 4
)

// IPv6 extension headers the parser walks.
const (
	ipv6HopByHop = 0
	ipv6Routing  = 43
	ipv6Fragment = 44
	ipv6AH       = 51
	ipv6DstOpts  = 60
)

func be16(b []byte) uint16 { return binary.BigEndian.Uint16(b) }

// Classify classifies one Ethernet frame. It never panics and never
// allocates, whatever the bytes.
func (c *Classifier) Classify(frame []byte) Meta {
	var m Meta
	n := len(frame)
	if n < ethHdrLen {
		m.Verdict = VerdictMalformed
		return m
	}
	etype := be16(frame[12:])
	off := ethHdrLen
	for range 2 {
		if etype != etherVLAN && etype != etherQinQ {
			break
		}
		if off+vlanHdrLen > n {
			m.Verdict = VerdictMalformed
			return m
		}
		m.VLAN = be16(frame[off:]) & 0x0fff
		etype = be16(frame[off+2:])
		off += vlanHdrLen
	}
	m.L3Offset = uint16(off)

	var (
		key     fragKey
		first   bool // a first fragment: remember the result under key
		proto   uint8
		l4, end int
	)
	switch etype {
	case etherIPv4:
		if off+20 > n || frame[off]>>4 != 4 {
			m.Verdict = VerdictMalformed
			return m
		}
		ihl := int(frame[off]&0x0f) * 4
		total := int(be16(frame[off+2:]))
		if ihl < 20 || total < ihl || off+total > n {
			m.Verdict = VerdictMalformed
			return m
		}
		end = off + total
		l4 = off + ihl
		proto = frame[off+9]
		frag := be16(frame[off+6:])
		if frag&0x3fff != 0 {
			m.Flags |= FlagFragment
			key = fragKey{family: 4, proto: proto, id: uint32(be16(frame[off+4:]))}
			copy(key.src[:4], frame[off+12:off+16])
			copy(key.dst[:4], frame[off+16:off+20])
			if frag&0x1fff != 0 {
				m.L4Offset = uint16(l4)
				c.laterFragment(&m, &key)
				return m
			}
			first = true
		}
	case etherIPv6:
		if off+40 > n || frame[off]>>4 != 6 {
			m.Verdict = VerdictMalformed
			return m
		}
		m.Flags |= FlagIPv6
		end = off + 40 + int(be16(frame[off+4:]))
		if end > n {
			m.Verdict = VerdictMalformed
			return m
		}
		proto = frame[off+6]
		l4 = off + 40
		for depth := 0; ; depth++ {
			if proto != ipv6HopByHop && proto != ipv6Routing && proto != ipv6Fragment &&
				proto != ipv6AH && proto != ipv6DstOpts {
				break
			}
			if depth == MaxExtHeaders {
				return m // too deep to follow: the kernel's
			}
			if l4+8 > end {
				m.Verdict = VerdictMalformed
				return m
			}
			if proto == ipv6Fragment {
				if m.Flags&FlagFragment != 0 {
					m.Verdict = VerdictMalformed
					return m
				}
				fo := be16(frame[l4+2:])
				next := frame[l4]
				if fo&0xfff9 != 0 { // offset or M set: a real fragment
					m.Flags |= FlagFragment
					key = fragKey{family: 6, proto: next, id: binary.BigEndian.Uint32(frame[l4+4:])}
					copy(key.src[:], frame[off+8:off+24])
					copy(key.dst[:], frame[off+24:off+40])
					if fo&0xfff8 != 0 {
						m.L4Offset = uint16(l4 + 8)
						c.laterFragment(&m, &key)
						return m
					}
					first = true
				}
				proto = next
				l4 += 8
				continue
			}
			var hlen int
			if proto == ipv6AH {
				hlen = (int(frame[l4+1]) + 2) * 4
			} else {
				hlen = (int(frame[l4+1]) + 1) * 8
			}
			if l4+hlen > end {
				m.Verdict = VerdictMalformed
				return m
			}
			proto = frame[l4]
			l4 += hlen
		}
	default:
		return m // not IP, or a third VLAN tag: the kernel's
	}
	m.L4Offset = uint16(l4)

	switch Protocol(proto) {
	case ProtoTCP:
		if l4+20 > end {
			m.Verdict = VerdictMalformed
			return m
		}
		if doff := int(frame[l4+12]>>4) * 4; doff < 20 || l4+doff > end {
			m.Verdict = VerdictMalformed
			return m
		}
	case ProtoUDP:
		if l4+8 > end {
			m.Verdict = VerdictMalformed
			return m
		}
		// A first fragment's UDP length covers the whole datagram.
		if ulen := int(be16(frame[l4+4:])); ulen < 8 || (!first && l4+ulen > end) {
			m.Verdict = VerdictMalformed
			return m
		}
	default:
		if m.Flags&FlagFragment == 0 {
			c.icmpError(frame, proto, l4, end, &m)
		}
		return m
	}

	var pk packet
	pk.proto = proto
	pk.vlan = m.VLAN
	pk.sport = be16(frame[l4:])
	pk.dport = be16(frame[l4+2:])
	if m.Flags&FlagIPv6 != 0 {
		pk.family = 6
		copy(pk.src[:], frame[off+8:off+24])
		copy(pk.dst[:], frame[off+24:off+40])
	} else {
		pk.family = 4
		copy(pk.src[:4], frame[off+12:off+16])
		copy(pk.dst[:4], frame[off+16:off+20])
	}
	c.tables.Load().lookup(&pk, &m)
	if m.Verdict == VerdictIngest && (m.Flags&FlagFragment != 0 || l4+int(be16(frame[l4+4:])) != end) {
		// Offload takes whole datagrams whose UDP length is the IP
		// payload's; anything else would put a partial or ambiguous
		// payload into a buffer. The rule id stays, so the refusal is
		// counted under the rule as well as a malformed frame.
		m.Verdict, m.StreamID = VerdictMalformed, 0
	}
	if first && m.RuleID != 0 {
		c.frags.put(key, fragEntry{verdict: m.Verdict, stream: m.StreamID, rule: m.RuleID})
	}
	return m
}

func (c *Classifier) laterFragment(m *Meta, key *fragKey) {
	m.Flags |= FlagLaterFragment
	e, ok := c.frags.m[*key]
	if !ok {
		m.Verdict = VerdictFragMiss
		return
	}
	m.Verdict, m.StreamID, m.RuleID = e.verdict, e.stream, e.rule
}

// ICMP protocol numbers, and the fixed part of an ICMP error in front of the
// packet it quotes.
const (
	protoICMPv4        = 1
	protoICMPv6        = 58
	icmpHdrLen         = 8
	quotedL4Len        = 8 // the first 64 bits of the quoted L4 header, all RFC 792 promises
	ipv4HdrLen         = 20
	ipv6HdrLen         = 40
	icmpv4Unreach      = 3
	icmpv4TimeExceeded = 11
	icmpv4ParamProblem = 12
	icmpv6ParamProblem = 4 // types 1 to 4 are the ICMPv6 errors
)

// icmpError steers an ICMP error that quotes a TCP or UDP packet the local
// side sent to the flow or listener that owns the quoted tuple, so that the
// application's own stack learns of unreachable ports and path MTUs. The
// quote is read as the application sent it (source local, destination
// remote) and looked up reversed, as a reply from the remote would be.
// Anything else leaves m as it is: VerdictPass with no rule, the kernel's.
func (c *Classifier) icmpError(frame []byte, proto uint8, l4, end int, m *Meta) {
	if l4+icmpHdrLen > end {
		return
	}
	var pk packet
	q := l4 + icmpHdrLen // the quoted IP header
	if m.Flags&FlagIPv6 == 0 {
		if proto != protoICMPv4 {
			return
		}
		if t := frame[l4]; t != icmpv4Unreach && t != icmpv4TimeExceeded && t != icmpv4ParamProblem {
			return
		}
		if q+ipv4HdrLen > end || frame[q]>>4 != 4 {
			return
		}
		ihl := int(frame[q]&0x0f) * 4
		// A later fragment quotes no L4 header.
		if ihl < ipv4HdrLen || q+ihl+quotedL4Len > end || be16(frame[q+6:])&0x1fff != 0 {
			return
		}
		pk.family = 4
		pk.proto = frame[q+9]
		copy(pk.src[:4], frame[q+16:q+20])
		copy(pk.dst[:4], frame[q+12:q+16])
		q += ihl
	} else {
		if proto != protoICMPv6 {
			return
		}
		if t := frame[l4]; t == 0 || t > icmpv6ParamProblem {
			return
		}
		if q+ipv6HdrLen+quotedL4Len > end || frame[q]>>4 != 6 {
			return
		}
		pk.family = 6
		pk.proto = frame[q+6] // extension headers in the quote are not followed
		copy(pk.src[:], frame[q+24:q+40])
		copy(pk.dst[:], frame[q+8:q+24])
		q += ipv6HdrLen
	}
	if pk.proto != uint8(ProtoTCP) && pk.proto != uint8(ProtoUDP) {
		return
	}
	pk.vlan = m.VLAN
	pk.sport = be16(frame[q+2:])
	pk.dport = be16(frame[q:])
	c.tables.Load().steer(&pk, m)
}

type packet struct {
	family, proto uint8
	vlan          uint16
	sport, dport  uint16
	src, dst      Addr16
}

// steer looks p up in the exact flows, then the listeners on its destination
// address, then the wildcard listeners, and on a hit steers m to the stream.
func (t *Tables) steer(p *packet, m *Meta) bool {
	hit, ok := t.flows.lookup(&FlowKey{Family: p.family, Proto: p.proto, SrcPort: p.sport, DstPort: p.dport, Src: p.src, Dst: p.dst})
	if !ok {
		lk := ListenKey{Family: p.family, Proto: p.proto, Port: p.dport, Addr: p.dst}
		if hit, ok = t.listeners[lk]; !ok {
			lk.Addr = Addr16{}
			hit, ok = t.listeners[lk]
		}
		if ok && t.spreads != nil {
			if sp := t.spreads[lk]; sp != nil {
				slot := sp.slotOf(p)
				hit.Stream = slot.Current
				if slot.Previous != 0 && slot.Previous != slot.Current {
					m.Flags |= FlagSecondChance
				}
			}
		}
	}
	if ok {
		m.Verdict, m.StreamID, m.RuleID = VerdictSteer, hit.Stream, hit.Rule
	}
	return ok
}

// lookup decides a TCP or UDP packet: flows and listeners, rules, default.
func (t *Tables) lookup(p *packet, m *Meta) {
	if t.steer(p, m) {
		return
	}
	for i := range t.rules {
		r := &t.rules[i]
		if !r.matches(p) {
			continue
		}
		m.RuleID, m.StreamID = r.ID, r.Stream
		switch r.Action {
		case ActionSteer:
			m.Verdict = VerdictSteer
		case ActionIngest:
			m.Verdict = VerdictIngest
		case ActionDrop:
			m.Verdict = VerdictDrop
		default:
			m.Verdict = VerdictPass
		}
		return
	}
}

func (r *CompiledRule) matches(p *packet) bool {
	return (r.VLAN == 0 || r.VLAN == p.vlan) &&
		(r.Proto == 0 || r.Proto == p.proto) &&
		(r.Family == 0 || r.Family == p.family) &&
		masked(&p.src, &r.SrcMask, &r.SrcNet) && masked(&p.dst, &r.DstMask, &r.DstNet) &&
		r.SrcPorts.Lo <= p.sport && p.sport <= r.SrcPorts.Hi &&
		r.DstPorts.Lo <= p.dport && p.dport <= r.DstPorts.Hi
}

// masked reports whether a&mask == net, eight bytes at a time as the XDP
// program does it.
func masked(a, mask, net *Addr16) bool {
	ne := binary.NativeEndian
	return ne.Uint64(a[0:])&ne.Uint64(mask[0:]) == ne.Uint64(net[0:]) &&
		ne.Uint64(a[8:])&ne.Uint64(mask[8:]) == ne.Uint64(net[8:])
}

// Flows lists the exact-flow table.
func (t *Tables) Flows() iter.Seq2[FlowKey, Target] { return t.flows.all() }

// Listeners lists the listener table; wildcard listeners have a zero Addr.
func (t *Tables) Listeners() iter.Seq2[ListenKey, Target] { return maps.All(t.listeners) }

// Rules lists the rules in match order.
func (t *Tables) Rules() []CompiledRule { return slices.Clone(t.rules) }

type fragKey struct {
	family, proto uint8
	id            uint32
	src, dst      Addr16
}

type fragEntry struct {
	verdict      Verdict
	stream, rule uint32
}

// fragTable is a bounded map; when full it forgets an arbitrary entry, as the
// kernel's LRU map forgets the least recently used one. Both forget only under
// pressure, which the equality tests stay clear of.
type fragTable struct {
	cap int
	m   map[fragKey]fragEntry
}

func (f *fragTable) put(k fragKey, e fragEntry) {
	if _, ok := f.m[k]; !ok && len(f.m) >= f.cap {
		for old := range f.m {
			delete(f.m, old)
			break
		}
	}
	f.m[k] = e
}
