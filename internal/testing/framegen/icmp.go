package framegen

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// ICMPErrorSpec is an ICMP or ICMPv6 message, usually an error, that quotes
// a packet the receiving side sent: Quoted goes from the local side
// (Quoted.Src, Quoted.SrcPort) to the remote, and the message comes back from
// Reporter to Quoted.Src.
type ICMPErrorSpec struct {
	Tags     []layers.EthernetType // TPIDs of the outer frame, outermost first
	VID      uint16
	V4Opts   bool    // outer IPv4 header with options
	Ext      []uint8 // outer IPv6 extension headers before the ICMPv6 header
	Frag     bool    // the outer packet is a first fragment
	Reporter netip.Addr
	Type     uint8
	Code     uint8
	Word     uint32 // the ICMP header's second word: MTU, pointer or unused
	Quoted   Spec   // the packet quoted; its Tags are ignored
	QuoteLen int    // bytes of the quoted IP packet kept; 0 keeps all
}

func (s ICMPErrorSpec) String() string {
	return fmt.Sprintf("icmp type=%d code=%d tags=%v opts=%v ext=%v frag=%v from %v quoting [%v] cut to %d", s.Type, s.Code, s.Tags, s.V4Opts, s.Ext, s.Frag, s.Reporter, s.Quoted, s.QuoteLen)
}

// Build serializes s: outer Ethernet, VLAN tags and IP header (ICMP for an
// IPv4 quote, ICMPv6 for an IPv6 one), the ICMP header, and the quoted IP
// packet cut to QuoteLen bytes.
func (s ICMPErrorSpec) Build() []byte {
	q := s.Quoted
	q.Tags = nil
	quote := q.Build()[ethHdrLen:]
	if s.QuoteLen > 0 && s.QuoteLen < len(quote) {
		quote = quote[:s.QuoteLen]
	}
	eth := &layers.Ethernet{
		SrcMAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 1},
		DstMAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 2},
	}
	ls := []gopacket.SerializableLayer{eth}
	inner := layers.EthernetTypeIPv4
	if q.L3 == 6 {
		inner = layers.EthernetTypeIPv6
	}
	eth.EthernetType = inner
	if len(s.Tags) > 0 {
		eth.EthernetType = s.Tags[0]
		for i := range s.Tags {
			next := inner
			if i+1 < len(s.Tags) {
				next = s.Tags[i+1]
			}
			ls = append(ls, &layers.Dot1Q{VLANIdentifier: s.VID + uint16(i), Type: next})
		}
	}
	word := []byte{byte(s.Word >> 24), byte(s.Word >> 16), byte(s.Word >> 8), byte(s.Word)}
	if q.L3 == 4 {
		ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolICMPv4, SrcIP: s.Reporter.AsSlice(), DstIP: q.Src.AsSlice(), Id: 7}
		if s.V4Opts {
			ip.Options = []layers.IPv4Option{{OptionType: 1}, {OptionType: 1}, {OptionType: 1}, {OptionType: 0}}
		}
		if s.Frag {
			ip.Flags = layers.IPv4MoreFragments
		}
		icmp := &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(s.Type, s.Code), Id: uint16(s.Word >> 16), Seq: uint16(s.Word)}
		return serialize(append(ls, ip, icmp, gopacket.Payload(quote))...)
	}
	ip := &layers.IPv6{Version: 6, HopLimit: 64, SrcIP: s.Reporter.AsSlice(), DstIP: q.Src.AsSlice(), NextHeader: layers.IPProtocolICMPv6}
	icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(s.Type, s.Code)}
	_ = icmp.SetNetworkLayerForChecksum(ip)
	chain := append([]uint8(nil), s.Ext...)
	if s.Frag {
		chain = append(chain, ipv6Fragment)
	}
	ls = append(ls, ip)
	if len(chain) > 0 {
		ip.NextHeader = layers.IPProtocol(chain[0])
		frag := 0
		if s.Frag {
			frag = 1
		}
		ls = append(ls, gopacket.Payload(extBytes(chain, uint8(layers.IPProtocolICMPv6), Spec{Frag: frag, FragID: 7})))
	}
	return serialize(append(ls, icmp, gopacket.Payload(append(word, quote...)))...)
}

const (
	ethHdrLen    = 14
	ipv6Fragment = 44
)

// ICMP types the generator draws: the errors the classifier steers, and
// others that it must leave to the kernel (echo, redirect, source quench,
// neighbour discovery, router advertisement).
var (
	icmp4Errors = [][2]uint8{{3, 3}, {3, 4}, {3, 1}, {11, 0}, {12, 0}}
	icmp4Others = [][2]uint8{{0, 0}, {8, 0}, {5, 1}, {4, 0}}
	icmp6Errors = [][2]uint8{{1, 4}, {1, 0}, {2, 0}, {3, 0}, {4, 1}}
	icmp6Others = [][2]uint8{{128, 0}, {129, 0}, {135, 0}, {134, 0}, {0, 0}, {5, 0}}
)

// ICMPErrorSpecs draws ICMP and ICMPv6 messages quoting tuples of rs — sent
// by the local end of a flow, or from a listener's address and port — and
// tuples from the pools that rs may not hold, in every shape the classifier
// distinguishes: each error type and some other types; outer VLAN tags,
// IPv4 options, IPv6 extension headers and fragments; quoted IPv4 options,
// fragments and protocols other than TCP and UDP, quoted IPv6 extension
// headers; quotes cut to the minimum or kept whole.
func ICMPErrorSpecs(rng *rand.Rand, rs *classifier.RuleSet) []ICMPErrorSpec {
	var out []ICMPErrorSpec
	for _, family := range []int{4, 6} {
		errs, others := icmp4Errors, icmp4Others
		if family == 6 {
			errs, others = icmp6Errors, icmp6Others
		}
		for _, tc := range errs {
			for variant := range 6 {
				for range 2 {
					out = append(out, drawICMP(rng, rs, family, tc, variant))
				}
			}
		}
		for _, tc := range others {
			out = append(out, drawICMP(rng, rs, family, tc, 0))
		}
	}
	return out
}

// drawICMP draws one message of family with type and code tc. variant 0 is a
// plain quote; 1 quotes IPv4 options or an IPv6 extension header; 2 a first
// fragment; 3 a later fragment; 4 quotes ICMP, not TCP or UDP; 5 makes the
// outer packet a first fragment.
func drawICMP(rng *rand.Rand, rs *classifier.RuleSet, family int, tc [2]uint8, variant int) ICMPErrorSpec {
	pool := pool4
	if family == 6 {
		pool = pool6
	}
	q := Spec{L3: family, Payload: rng.IntN(40), FragID: rng.Uint32() & 0xffff}
	q.Src, q.Dst = pool[rng.IntN(len(pool))], pool[rng.IntN(len(pool))]
	q.SrcPort, q.DstPort = poolPorts[rng.IntN(len(poolPorts))], poolPorts[rng.IntN(len(poolPorts))]
	q.L4 = layers.IPProtocolTCP
	if rng.IntN(2) == 0 {
		q.L4 = layers.IPProtocolUDP
	}
	// Mostly tuples that rs holds, so that flows and listeners are hit.
	var flows []classifier.Flow
	for _, f := range rs.Flows {
		if classifier.Family(f.Local.Addr()) == uint8(family) {
			flows = append(flows, f)
		}
	}
	var listeners []classifier.Listener
	for _, l := range rs.Listeners {
		if !l.Addr.IsValid() || classifier.Family(l.Addr) == uint8(family) {
			listeners = append(listeners, l)
		}
	}
	switch pick := rng.IntN(5); {
	case pick < 2 && len(flows) > 0:
		f := flows[rng.IntN(len(flows))]
		q.Src, q.SrcPort, q.Dst, q.DstPort = f.Local.Addr(), f.Local.Port(), f.Remote.Addr(), f.Remote.Port()
		q.L4 = layers.IPProtocol(f.Protocol)
	case pick < 4 && len(listeners) > 0:
		l := listeners[rng.IntN(len(listeners))]
		if l.Addr.IsValid() && !l.Addr.IsUnspecified() {
			q.Src = l.Addr
		}
		q.SrcPort = l.Port
		q.L4 = layers.IPProtocol(l.Protocol)
	}
	s := ICMPErrorSpec{
		Tags:     tagSets[rng.IntN(3)],
		VID:      poolVLANs[rng.IntN(len(poolVLANs))],
		Reporter: pool[rng.IntN(len(pool))],
		Type:     tc[0],
		Code:     tc[1],
		Word:     rng.Uint32() & 0xffff,
	}
	if family == 4 {
		s.V4Opts = rng.IntN(3) == 0
	} else {
		s.Ext = extChains[rng.IntN(4)]
	}
	switch variant {
	case 1:
		if family == 4 {
			q.V4Opts = true
		} else {
			q.Ext = []uint8{60}
		}
	case 2:
		q.Frag = 1
	case 3:
		q.Frag = 2
	case 4:
		q.L4 = layers.IPProtocolICMPv4
		if family == 6 {
			q.L4 = layers.IPProtocolICMPv6
		}
	case 5:
		s.Frag = true
	}
	s.Quoted = q
	if rng.IntN(2) == 0 {
		// What RFC 792 promises: the IP header and 8 bytes after it.
		s.QuoteLen = len(q.Build()) - ethHdrLen - q.Payload
		if q.Frag != 2 {
			switch q.L4 {
			case layers.IPProtocolTCP:
				s.QuoteLen -= 12
			case layers.IPProtocolUDP:
			default:
				s.QuoteLen = 0
			}
		}
	}
	s.Quoted = q
	return s
}
