package framegen

import (
	"net/netip"

	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
)

// BenchCase is one frame and the tables it meets, as both classifiers'
// benchmarks measure them.
type BenchCase struct {
	Name  string
	Rules *classifier.RuleSet
	Frame []byte
	Want  classifier.Verdict
}

// BenchFlows is how many exact flows the flow-hit case installs.
const BenchFlows = 100_000

// BenchCases are the benchmark cases: a frame that nothing claims (passing
// every table and 16 rules), a listener hit, the same listener spread over
// instances (maglev.DefaultSize slots), an exact-flow hit among BenchFlows
// flows, and IPv6 with three extension headers to a listener.
func BenchCases() []BenchCase {
	local4 := netip.MustParseAddr("198.18.0.1")
	local6 := netip.MustParseAddr("2001:db8::1")
	remote4 := netip.MustParseAddr("198.19.0.9")
	remote6 := netip.MustParseAddr("2001:db8:5::9")

	// A background every case shares: listeners and rules on other ports.
	base := func() *classifier.RuleSet {
		rs := &classifier.RuleSet{}
		for i := range 8 {
			rs.Listeners = append(rs.Listeners, classifier.Listener{ID: uint32(100 + i), Protocol: classifier.ProtoTCP, Port: uint16(9000 + i), Stream: 1})
		}
		for i := range 16 {
			rs.Rules = append(rs.Rules, classifier.Rule{
				ID: uint32(200 + i), Priority: uint32(i), Protocol: classifier.ProtoUDP,
				Dst: netip.PrefixFrom(local4, 32), DstPorts: classifier.PortRange{Lo: uint16(7000 + 10*i), Hi: uint16(7009 + 10*i)},
				Action: classifier.ActionSteer, Stream: 2,
			})
		}
		return rs
	}

	pass := base()
	listen := base()
	listen.Listeners = append(listen.Listeners, classifier.Listener{ID: 1, Protocol: classifier.ProtoTCP, Addr: local4, Port: 80, Stream: 3})
	spread := base()
	sp := &classifier.Spread{Seed: 0x5eed, Slots: make([]classifier.Slot, maglev.DefaultSize)}
	for i := range sp.Slots {
		sp.Slots[i] = classifier.Slot{Current: uint32(3 + i%4), Previous: uint32(3 + i%3)}
	}
	spread.Listeners = append(spread.Listeners, classifier.Listener{ID: 1, Protocol: classifier.ProtoTCP, Addr: local4, Port: 80, Stream: 3, Spread: sp})
	flows := base()
	for i := range BenchFlows {
		flows.Flows = append(flows.Flows, classifier.Flow{
			ID: 2, Protocol: classifier.ProtoTCP, Stream: 4,
			Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), uint16(1024+i%50000)),
			Local:  netip.AddrPortFrom(local4, 443),
		})
	}
	v6 := base()
	v6.Listeners = append(v6.Listeners, classifier.Listener{ID: 3, Protocol: classifier.ProtoTCP, Addr: netip.IPv6Unspecified(), Port: 80, Stream: 5})

	hit := flows.Flows[BenchFlows/2]
	tcp := layers.IPProtocolTCP
	return []BenchCase{
		{"default-pass", pass, Spec{L3: 4, L4: layers.IPProtocolUDP, Src: remote4, Dst: local4, SrcPort: 5555, DstPort: 6666, Payload: 18}.Build(), classifier.VerdictPass},
		{"listener-hit", listen, Spec{L3: 4, L4: tcp, Src: remote4, Dst: local4, SrcPort: 5555, DstPort: 80, Payload: 6}.Build(), classifier.VerdictSteer},
		{"spread-hit", spread, Spec{L3: 4, L4: tcp, Src: remote4, Dst: local4, SrcPort: 5555, DstPort: 80, Payload: 6}.Build(), classifier.VerdictSteer},
		{"flow-hit-100k", flows, Spec{L3: 4, L4: tcp, Src: hit.Remote.Addr(), Dst: local4, SrcPort: hit.Remote.Port(), DstPort: 443, Payload: 6}.Build(), classifier.VerdictSteer},
		{"ipv6-3ext", v6, Spec{L3: 6, Ext: []uint8{0, 43, 60}, L4: tcp, Src: remote6, Dst: local6, SrcPort: 5555, DstPort: 80, Payload: 6}.Build(), classifier.VerdictSteer},
	}
}
