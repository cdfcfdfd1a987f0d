// Package framegen crafts Ethernet frames of every header mix the classifier
// knows, and random rule sets over the same small address and port pools, so
// that tests and benchmarks of both classifiers meet often. Every address is
// in the benchmark ranges 198.18.0.0/15 and 2001:db8::/32.
package framegen

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
)

// The address and port pools are small so that random frames and random rules
// meet often. Every address is in the benchmark ranges.
var (
	pool4 = []netip.Addr{
		netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2"),
		netip.MustParseAddr("198.19.1.1"), netip.MustParseAddr("198.18.200.7"),
	}
	pool6 = []netip.Addr{
		netip.MustParseAddr("2001:db8::1"), netip.MustParseAddr("2001:db8::2"),
		netip.MustParseAddr("2001:db8:1::5"), netip.MustParseAddr("2001:db8:ffff::9"),
	}
	poolPorts = []uint16{53, 80, 443, 5000, 5001, 6081, 40000}
	poolVLANs = []uint16{10, 20, 100}
)

// Spec is one mix of headers; AllSpecs walks every combination.
type Spec struct {
	Tags    []layers.EthernetType // TPIDs, outermost first
	L3      int                   // 0 ARP, 4 IPv4, 6 IPv6
	V4Opts  bool
	Ext     []uint8 // IPv6 extension headers before the L4 header (44 is added by frag)
	Frag    int     // 0 none, 1 first fragment, 2 later fragment
	L4      layers.IPProtocol
	Src     netip.Addr
	Dst     netip.Addr
	SrcPort uint16
	DstPort uint16
	VID     uint16
	FragID  uint32
	Payload int
}

func (s Spec) String() string {
	return fmt.Sprintf("tags=%v l3=%d opts=%v ext=%v frag=%d l4=%v %v:%d>%v:%d vid=%d", s.Tags, s.L3, s.V4Opts, s.Ext, s.Frag, s.L4, s.Src, s.SrcPort, s.Dst, s.DstPort, s.VID)
}

// extChains are the IPv6 extension-header chains the generator uses; the
// last is deeper than the parser follows.
var extChains = [][]uint8{
	nil,
	{0},
	{60},
	{0, 43, 60},
	{0, 60, 43, 51, 60},
	{0, 43, 43, 60, 51, 60},
	{0, 43, 60, 51, 60, 43, 60, 43, 60},
}

var tagSets = [][]layers.EthernetType{
	nil,
	{layers.EthernetTypeDot1Q},
	{layers.EthernetTypeQinQ, layers.EthernetTypeDot1Q},
	{layers.EthernetTypeDot1Q, layers.EthernetTypeDot1Q},
	{layers.EthernetTypeQinQ, layers.EthernetTypeDot1Q, layers.EthernetTypeDot1Q},
}

// AllSpecs enumerates every mix of tags, L3 (with options or extension
// chains), fragmentation and L4, with addresses and ports drawn from the
// pools. Fragmented specs come as a first and a later fragment of one
// datagram, in that order, and sometimes a later fragment with no first.
func AllSpecs(rng *rand.Rand) []Spec {
	var out []Spec
	pick := func(s Spec) Spec {
		pool := pool4
		if s.L3 == 6 {
			pool = pool6
		}
		s.Src, s.Dst = pool[rng.IntN(len(pool))], pool[rng.IntN(len(pool))]
		s.SrcPort, s.DstPort = poolPorts[rng.IntN(len(poolPorts))], poolPorts[rng.IntN(len(poolPorts))]
		s.VID = poolVLANs[rng.IntN(len(poolVLANs))]
		s.FragID = rng.Uint32()
		if s.L3 == 4 {
			s.FragID &= 0xffff
		}
		s.Payload = rng.IntN(64)
		return s
	}
	for _, tags := range tagSets {
		out = append(out, pick(Spec{Tags: tags, L3: 0}))
		for _, l4 := range []layers.IPProtocol{layers.IPProtocolTCP, layers.IPProtocolUDP, layers.IPProtocolICMPv4} {
			for _, opts := range []bool{false, true} {
				s := pick(Spec{Tags: tags, L3: 4, V4Opts: opts, L4: l4})
				out = append(out, s)
				first := s
				first.Frag = 1
				later := first
				later.Frag = 2
				orphan := pick(later)
				out = append(out, first, later, orphan)
			}
			l6 := l4
			if l4 == layers.IPProtocolICMPv4 {
				l6 = layers.IPProtocolICMPv6
			}
			for _, ext := range extChains {
				s := pick(Spec{Tags: tags, L3: 6, Ext: ext, L4: l6})
				out = append(out, s)
				if len(ext) < 6 {
					first := s
					first.Frag = 1
					later := first
					later.Frag = 2
					out = append(out, first, later)
				}
			}
		}
	}
	return out
}

// build serializes s with gopacket. IPv6 extension headers are written as
// raw bytes between the IPv6 and L4 layers, because gopacket cannot
// serialize all of them.
func (s Spec) Build() []byte {
	var ls []gopacket.SerializableLayer
	eth := &layers.Ethernet{
		SrcMAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 1},
		DstMAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 2},
	}
	ls = append(ls, eth)
	inner := layers.EthernetTypeARP
	switch s.L3 {
	case 4:
		inner = layers.EthernetTypeIPv4
	case 6:
		inner = layers.EthernetTypeIPv6
	}
	if len(s.Tags) == 0 {
		eth.EthernetType = inner
	} else {
		eth.EthernetType = s.Tags[0]
		for i := range s.Tags {
			next := inner
			if i+1 < len(s.Tags) {
				next = s.Tags[i+1]
			}
			ls = append(ls, &layers.Dot1Q{VLANIdentifier: s.VID + uint16(i), Type: next})
		}
	}
	var netLayer gopacket.NetworkLayer
	switch s.L3 {
	case 0:
		ls = append(ls, &layers.ARP{
			AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4,
			HwAddressSize: 6, ProtAddressSize: 4, Operation: layers.ARPRequest,
			SourceHwAddress: eth.SrcMAC, SourceProtAddress: []byte{198, 18, 0, 1},
			DstHwAddress: make([]byte, 6), DstProtAddress: []byte{198, 18, 0, 2},
		})
		return serialize(ls...)
	case 4:
		ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: s.L4, SrcIP: s.Src.AsSlice(), DstIP: s.Dst.AsSlice(), Id: uint16(s.FragID)}
		if s.V4Opts {
			ip.Options = []layers.IPv4Option{
				{OptionType: 7, OptionLength: 7, OptionData: []byte{4, 0, 0, 0, 0}}, // record route
				{OptionType: 1}, // nop
			}
		}
		switch s.Frag {
		case 1:
			ip.Flags = layers.IPv4MoreFragments
		case 2:
			ip.FragOffset = 8
		}
		ls = append(ls, ip)
		netLayer = ip
	case 6:
		ip := &layers.IPv6{Version: 6, HopLimit: 64, SrcIP: s.Src.AsSlice(), DstIP: s.Dst.AsSlice()}
		chain := append([]uint8(nil), s.Ext...)
		if s.Frag != 0 {
			chain = append(chain, 44)
		}
		if len(chain) == 0 {
			ip.NextHeader = s.L4
		} else {
			ip.NextHeader = layers.IPProtocol(chain[0])
			ls = append(ls, ip, gopacket.Payload(extBytes(chain, uint8(s.L4), s)))
			netLayer = ip
			break
		}
		ls = append(ls, ip)
		netLayer = ip
	}
	payload := make(gopacket.Payload, s.Payload)
	for i := range payload {
		payload[i] = byte(i)
	}
	if s.Frag == 2 {
		// A later fragment carries only data; make it long enough to look
		// like an L4 header, so that a parser that wrongly reads one sees
		// ports.
		return serialize(append(ls, append(payload, make([]byte, 24)...))...)
	}
	switch s.L4 {
	case layers.IPProtocolTCP:
		tcp := &layers.TCP{SrcPort: layers.TCPPort(s.SrcPort), DstPort: layers.TCPPort(s.DstPort), SYN: true, Window: 1024}
		_ = tcp.SetNetworkLayerForChecksum(netLayer)
		ls = append(ls, tcp, payload)
	case layers.IPProtocolUDP:
		udp := &layers.UDP{SrcPort: layers.UDPPort(s.SrcPort), DstPort: layers.UDPPort(s.DstPort)}
		_ = udp.SetNetworkLayerForChecksum(netLayer)
		ls = append(ls, udp, payload)
	case layers.IPProtocolICMPv4:
		ls = append(ls, &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0), Id: 1, Seq: 1}, payload)
	case layers.IPProtocolICMPv6:
		icmp := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(128, 0)}
		_ = icmp.SetNetworkLayerForChecksum(netLayer)
		ls = append(ls, icmp, payload)
	}
	b := serialize(ls...)
	if s.Frag == 1 && s.L4 == layers.IPProtocolUDP {
		// A first fragment's UDP length covers the whole datagram.
		off := len(b) - s.Payload - 8
		binary.BigEndian.PutUint16(b[off+4:], uint16(8+s.Payload+512))
	}
	return b
}

// extBytes writes the IPv6 extension headers of chain, the last pointing at
// l4. Header lengths vary so that the parser's arithmetic is exercised.
func extBytes(chain []uint8, l4 uint8, s Spec) []byte {
	var b []byte
	for i, typ := range chain {
		next := l4
		if i+1 < len(chain) {
			next = chain[i+1]
		}
		switch typ {
		case 44:
			h := make([]byte, 8)
			h[0] = next
			var fo uint16
			switch s.Frag {
			case 1:
				fo = 1 // M
			case 2:
				fo = 8 << 3
			}
			binary.BigEndian.PutUint16(h[2:], fo)
			binary.BigEndian.PutUint32(h[4:], s.FragID)
			b = append(b, h...)
		case 51:
			h := make([]byte, 24) // payload len 4: (4+2)*4 bytes
			h[0], h[1] = next, 4
			b = append(b, h...)
		default:
			units := i % 2 // 8 or 16 bytes
			h := make([]byte, (units+1)*8)
			h[0], h[1] = next, byte(units)
			if typ == 43 {
				h[2], h[3] = 4, 0 // routing type 4 (SRH-like), segments left 0
			} else {
				h[2], h[3] = 1, byte(len(h)-4) // one PadN option filling the header
			}
			b = append(b, h...)
		}
	}
	return b
}

// RandomSpread draws a spread over the streams RandomRuleSet uses: a few
// slots or maglev.DefaultSize, each slot's previous owner none, the current
// one or another.
func RandomSpread(rng *rand.Rand) *classifier.Spread {
	sizes := []int{1, 2, 7, 61, 251, maglev.DefaultSize}
	sp := &classifier.Spread{Seed: rng.Uint64(), Slots: make([]classifier.Slot, sizes[rng.IntN(len(sizes))])}
	for i := range sp.Slots {
		s := classifier.Slot{Current: uint32(1 + rng.IntN(8))}
		switch rng.IntN(3) {
		case 0:
		case 1:
			s.Previous = s.Current
		default:
			s.Previous = uint32(1 + rng.IntN(8))
		}
		sp.Slots[i] = s
	}
	return sp
}

func serialize(ls ...gopacket.SerializableLayer) []byte {
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, ls...); err != nil {
		panic(err)
	}
	return append([]byte(nil), buf.Bytes()...)
}

// RandomRuleSet draws flows, listeners and rules over the pools, so that
// every precedence level gets hit. About half the listeners are spread over
// instances (RandomSpread).
func RandomRuleSet(rng *rand.Rand) *classifier.RuleSet {
	rs := &classifier.RuleSet{}
	id := uint32(1 + rng.IntN(1000))
	nextID := func() uint32 { id++; return id }
	stream := func() uint32 { return uint32(1 + rng.IntN(8)) }
	addr := func(v6 bool) netip.Addr {
		if v6 {
			return pool6[rng.IntN(len(pool6))]
		}
		return pool4[rng.IntN(len(pool4))]
	}
	port := func() uint16 { return poolPorts[rng.IntN(len(poolPorts))] }
	proto := func() classifier.Protocol {
		if rng.IntN(2) == 0 {
			return classifier.ProtoTCP
		}
		return classifier.ProtoUDP
	}

	flowSeen := map[string]bool{}
	for range rng.IntN(12) {
		v6 := rng.IntN(2) == 0
		f := classifier.Flow{ID: nextID(), Protocol: proto(), Stream: stream(),
			Remote: netip.AddrPortFrom(addr(v6), port()), Local: netip.AddrPortFrom(addr(v6), port())}
		k := fmt.Sprint(f.Protocol, f.Remote, f.Local)
		if !flowSeen[k] {
			flowSeen[k] = true
			rs.Flows = append(rs.Flows, f)
		}
	}
	listenSeen := map[string]bool{}
	for range rng.IntN(8) {
		l := classifier.Listener{ID: nextID(), Protocol: proto(), Port: port(), Stream: stream()}
		switch rng.IntN(4) {
		case 0: // both wildcards
		case 1:
			l.Addr = netip.IPv4Unspecified()
		case 2:
			l.Addr = addr(false)
		default:
			l.Addr = addr(true)
		}
		keys := []string{fmt.Sprint(l.Protocol, l.Addr, l.Port)}
		if !l.Addr.IsValid() {
			keys = []string{fmt.Sprint(l.Protocol, netip.IPv4Unspecified(), l.Port), fmt.Sprint(l.Protocol, netip.IPv6Unspecified(), l.Port)}
		}
		dup := false
		for _, k := range keys {
			dup = dup || listenSeen[k]
		}
		if dup {
			continue
		}
		for _, k := range keys {
			listenSeen[k] = true
		}
		// Drawn from the listener, not rng, so that the rest of the set
		// is what it was before listeners had spreads.
		if sr := rand.New(rand.NewPCG(uint64(l.ID), uint64(l.Port))); sr.IntN(2) == 0 {
			l.Spread = RandomSpread(sr)
		}
		rs.Listeners = append(rs.Listeners, l)
	}
	for range rng.IntN(16) {
		r := classifier.Rule{ID: nextID(), Priority: uint32(rng.IntN(4))}
		if rng.IntN(3) == 0 {
			r.VLAN = poolVLANs[rng.IntN(len(poolVLANs))] + uint16(rng.IntN(2))
		}
		v6 := rng.IntN(2) == 0
		if rng.IntN(3) == 0 {
			r.IPVersion = 4
			if v6 {
				r.IPVersion = 6
			}
		}
		if rng.IntN(2) == 0 {
			r.Protocol = proto()
		}
		maxBits := 32
		if v6 {
			maxBits = 128
		}
		if rng.IntN(2) == 0 {
			r.Src = netip.PrefixFrom(addr(v6), rng.IntN(maxBits+1)).Masked()
		}
		if rng.IntN(2) == 0 {
			r.Dst = netip.PrefixFrom(addr(v6), rng.IntN(maxBits+1)).Masked()
		}
		if (r.Src.IsValid() || r.Dst.IsValid()) && r.IPVersion != 0 {
			r.IPVersion = 4
			if v6 {
				r.IPVersion = 6
			}
		}
		ranges := func() classifier.PortRange {
			switch rng.IntN(3) {
			case 0:
				return classifier.AnyPort
			case 1:
				return classifier.Port(port())
			}
			a, b := port(), port()
			return classifier.PortRange{Lo: min(a, b), Hi: max(a, b)}
		}
		r.SrcPorts, r.DstPorts = ranges(), ranges()
		switch rng.IntN(4) {
		case 0:
			r.Action, r.Stream = classifier.ActionSteer, stream()
		case 1:
			r.Action, r.Stream, r.Protocol = classifier.ActionIngest, stream(), classifier.ProtoUDP
		case 2:
			r.Action = classifier.ActionPass
		default:
			r.Action = classifier.ActionDrop
		}
		rs.Rules = append(rs.Rules, r)
	}
	return rs
}
