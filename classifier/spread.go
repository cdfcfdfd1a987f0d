package classifier

import (
	"encoding/binary"
	"fmt"

	"github.com/fabricbridge/fabricbridge/classifier/maglev"
)

// MaxSpreadSlots bounds a Spread's table; maglev.DefaultSize is far below.
const MaxSpreadSlots = 1 << 20

func (sp *Spread) validate(what string) []error {
	var errs []error
	if n := len(sp.Slots); n == 0 || n > MaxSpreadSlots {
		errs = append(errs, fmt.Errorf("%s: spread of %d slots, want 1..%d", what, n, MaxSpreadSlots))
	}
	for i, s := range sp.Slots {
		if s.Current == 0 {
			errs = append(errs, fmt.Errorf("%s: spread slot %d has no stream", what, i))
			break
		}
	}
	return errs
}

// slotOf is the slot that p's flow hashes to.
func (sp *Spread) slotOf(p *packet) Slot {
	var src, dst [16]byte
	widen(&src, &p.src, p.family)
	widen(&dst, &p.dst, p.family)
	h := maglev.FlowHash16(sp.Seed, p.proto, &src, &dst, p.sport, p.dport)
	return sp.Slots[h%uint64(len(sp.Slots))]
}

// widen writes a table-form address in the 16-byte form FlowHash16 takes:
// IPv4 as IPv4-mapped IPv6.
func widen(out *[16]byte, a *Addr16, family uint8) {
	if family == 4 {
		*out = [16]byte{10: 0xff, 11: 0xff}
		copy(out[12:], a[:4])
		return
	}
	*out = *a
}

// Spread returns the Spread of the listener under k, or nil.
func (t *Tables) Spread(k ListenKey) *Spread { return t.spreads[k] }

// SecondChance finds, for an IP packet (no link header) towards this box
// that an application handed back with fabric.MarkNotMine, the Spread slot
// that steers it. ok is false unless the packet is well-formed TCP that no
// exact flow claims and a listener with a Spread takes; the bridge then
// has no second chance to give it. IPv6 extension headers are not followed:
// their packets get no second chance.
func (t *Tables) SecondChance(ip []byte) (s Slot, ok bool) {
	if t.spreads == nil || len(ip) < 20 {
		return Slot{}, false
	}
	var p packet
	var l4 int
	switch ip[0] >> 4 {
	case 4:
		ihl := int(ip[0]&0x0f) * 4
		if ihl < 20 || len(ip) < ihl+4 || binary.BigEndian.Uint16(ip[6:])&0x3fff != 0 {
			return Slot{}, false
		}
		p.family, p.proto, l4 = 4, ip[9], ihl
		copy(p.src[:4], ip[12:16])
		copy(p.dst[:4], ip[16:20])
	case 6:
		if len(ip) < 44 {
			return Slot{}, false
		}
		p.family, p.proto, l4 = 6, ip[6], 40
		copy(p.src[:], ip[8:24])
		copy(p.dst[:], ip[24:40])
	default:
		return Slot{}, false
	}
	if Protocol(p.proto) != ProtoTCP {
		return Slot{}, false
	}
	p.sport = binary.BigEndian.Uint16(ip[l4:])
	p.dport = binary.BigEndian.Uint16(ip[l4+2:])
	if _, flow := t.flows.lookup(&FlowKey{Family: p.family, Proto: p.proto, SrcPort: p.sport, DstPort: p.dport, Src: p.src, Dst: p.dst}); flow {
		return Slot{}, false
	}
	lk := ListenKey{Family: p.family, Proto: p.proto, Port: p.dport, Addr: p.dst}
	if _, hit := t.listeners[lk]; !hit {
		lk.Addr = Addr16{}
	}
	sp := t.spreads[lk]
	if sp == nil {
		return Slot{}, false
	}
	return sp.slotOf(&p), true
}
