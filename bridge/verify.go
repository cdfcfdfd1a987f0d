package bridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// ownership is classifier.Ownership compiled for the TX check, looked up
// without allocating. Port sets are bitmaps (8 KiB each), so a check is one
// load whatever the number of ports. The addresses are immutable; a port is
// added or removed in place (one atomic word), so that a claim costs the
// same whatever the stream already owns.
type ownership struct {
	addrs    []netip.Addr
	tcp, udp *portSet
}

type portSet struct {
	n    atomic.Int32 // ports set
	bits [65536 / 64]atomic.Uint64
}

func (s *portSet) has(p uint16) bool { return s.bits[p/64].Load()&(1<<(p%64)) != 0 }

// add sets p; it reports false if p was set already.
func (s *portSet) add(p uint16) bool {
	if s.bits[p/64].Or(1<<(p%64))&(1<<(p%64)) != 0 {
		return false
	}
	s.n.Add(1)
	return true
}

// remove clears p; it reports false if p was not set.
func (s *portSet) remove(p uint16) bool {
	if s.bits[p/64].And(^uint64(1<<(p%64)))&(1<<(p%64)) == 0 {
		return false
	}
	s.n.Add(-1)
	return true
}

// ports is the set of proto (TCP or UDP).
func (o *ownership) ports(proto classifier.Protocol) (*portSet, error) {
	switch proto {
	case classifier.ProtoTCP:
		return o.tcp, nil
	case classifier.ProtoUDP:
		return o.udp, nil
	}
	return nil, fmt.Errorf("protocol %v, want tcp or udp", proto)
}

func compileOwnership(o classifier.Ownership) (*ownership, error) {
	c := &ownership{tcp: new(portSet), udp: new(portSet)}
	var errs []error
	for _, a := range o.Addrs {
		if !a.IsValid() {
			errs = append(errs, errors.New("invalid (zero) address"))
			continue
		}
		c.addrs = append(c.addrs, a.Unmap().WithZone(""))
	}
	for _, p := range o.Ports {
		s, err := c.ports(p.Proto)
		if err != nil {
			errs = append(errs, fmt.Errorf("port %d: %w", p.Port, err))
			continue
		}
		if p.Port == 0 {
			errs = append(errs, fmt.Errorf("%v port 0", p.Proto))
			continue
		}
		s.add(p.Port)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("bridge: ownership: %w", err)
	}
	return c, nil
}

func (o *ownership) hasAddr(a netip.Addr) bool {
	for _, x := range o.addrs {
		if x == a {
			return true
		}
	}
	return false
}

// reason is why a packet from a stream was not transmitted.
type reason uint8

const (
	accepted        reason = iota
	rejVersion             // not IPv4 or IPv6
	rejHeader              // header length field broken, or a header does not fit
	rejLength              // the IP length field disagrees with the packet
	rejMTU                 // longer than the interface's MTU
	rejSourceAddr          // source address not the stream's
	rejProtocol            // not TCP or UDP, or a protocol the stream owns no port of
	rejSourcePort          // source port not the stream's
	rejSecondChance        // handed back (fabric.MarkNotMine) where no second chance takes it
	numReasons
)

// Rejects counts packets dropped on transmit, by reason.
type Rejects struct {
	Version      uint64 // not IPv4 or IPv6
	HeaderLength uint64 // an IP or L4 header length is broken or does not fit
	TotalLength  uint64 // the IP length field disagrees with the packet's length
	MTU          uint64 // longer than the interface's MTU
	SourceAddr   uint64 // source address not among the stream's
	Protocol     uint64 // not TCP or UDP, or no port of that protocol owned
	SourcePort   uint64 // source port not owned by the stream
	// SecondChance counts packets handed back with fabric.MarkNotMine that
	// were not passed on: no Spread slot steers them, the stream is
	// neither the slot's current nor its previous owner, or the other
	// owner's stream is gone or full.
	SecondChance uint64
}

func rejectsFrom(c *[numReasons]uint64) Rejects {
	return Rejects{
		Version: c[rejVersion], HeaderLength: c[rejHeader], TotalLength: c[rejLength], MTU: c[rejMTU],
		SourceAddr: c[rejSourceAddr], Protocol: c[rejProtocol], SourcePort: c[rejSourcePort],
		SecondChance: c[rejSecondChance],
	}
}

// Total is the sum over reasons.
func (r Rejects) Total() uint64 {
	return r.Version + r.HeaderLength + r.TotalLength + r.MTU + r.SourceAddr + r.Protocol + r.SourcePort + r.SecondChance
}

var be = binary.BigEndian

// verify decides whether an IP packet written by a stream may leave. It reads
// only fixed header fields, never allocates, and is safe on any bytes.
func verify(p []byte, own *ownership, mtu int) reason {
	if len(p) == 0 {
		return rejVersion
	}
	switch p[0] >> 4 {
	case 4:
		if len(p) < 20 {
			return rejHeader
		}
		ihl := int(p[0]&0xf) * 4
		if ihl < 20 || ihl > len(p) {
			return rejHeader
		}
		if int(be.Uint16(p[2:])) != len(p) {
			return rejLength
		}
		if len(p) > mtu {
			return rejMTU
		}
		if !own.hasAddr(netip.AddrFrom4([4]byte(p[12:16]))) {
			return rejSourceAddr
		}
		frag := be.Uint16(p[6:])
		later := frag&0x1fff != 0
		first := !later && frag&0x2000 != 0
		return own.checkL4(p[9], p[ihl:], later, first)
	case 6:
		if len(p) < 40 {
			return rejHeader
		}
		if 40+int(be.Uint16(p[4:])) != len(p) {
			return rejLength
		}
		if len(p) > mtu {
			return rejMTU
		}
		if !own.hasAddr(netip.AddrFrom16([16]byte(p[8:24]))) {
			return rejSourceAddr
		}
		next, off := p[6], 40
		later, fragmented := false, false
		for range classifier.MaxExtHeaders {
			var n int
			switch next {
			case 0, 43, 60: // hop-by-hop, routing, destination options
				if off+2 > len(p) {
					return rejHeader
				}
				n = (int(p[off+1]) + 1) * 8
			case 44: // fragment
				if off+8 > len(p) {
					return rejHeader
				}
				fo := be.Uint16(p[off+2:])
				later = fo>>3 != 0
				fragmented = fo&1 != 0 || later
				n = 8
			case 51: // authentication header
				if off+2 > len(p) {
					return rejHeader
				}
				n = (int(p[off+1]) + 2) * 4
			default:
				return own.checkL4(next, p[off:], later, fragmented && !later)
			}
			if off+n > len(p) {
				return rejHeader
			}
			next, off = p[off], off+n
		}
		return rejHeader // a longer chain than the classifier walks
	}
	return rejVersion
}

// checkL4 checks the L4 header of an unfragmented packet or first fragment
// (firstFrag relaxes the UDP length check), or, for a later fragment, only
// that the stream owns some port of the protocol.
func (o *ownership) checkL4(proto uint8, l4 []byte, laterFrag, firstFrag bool) reason {
	var ports *portSet
	switch classifier.Protocol(proto) {
	case classifier.ProtoTCP:
		ports = o.tcp
	case classifier.ProtoUDP:
		ports = o.udp
	default:
		return rejProtocol
	}
	if ports.n.Load() == 0 {
		return rejProtocol
	}
	if laterFrag {
		return accepted
	}
	if classifier.Protocol(proto) == classifier.ProtoTCP {
		if len(l4) < 20 {
			return rejHeader
		}
		if doff := int(l4[12]>>4) * 4; doff < 20 || doff > len(l4) {
			return rejHeader
		}
	} else {
		if len(l4) < 8 {
			return rejHeader
		}
		ulen := int(be.Uint16(l4[4:]))
		if ulen < 8 || (!firstFrag && ulen != len(l4)) {
			return rejLength
		}
	}
	if !ports.has(be.Uint16(l4[0:])) {
		return rejSourcePort
	}
	return accepted
}
