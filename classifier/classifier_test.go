package classifier_test

import (
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"

	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

var (
	local  = netip.MustParseAddr("198.18.0.1")
	remote = netip.MustParseAddr("198.19.0.9")
	tcp    = layers.IPProtocolTCP
)

func classify(t *testing.T, rs *classifier.RuleSet, frame []byte) classifier.Meta {
	t.Helper()
	tables, err := classifier.Compile(rs)
	if err != nil {
		t.Fatal(err)
	}
	return classifier.New(tables, 0).Classify(frame)
}

// TestPrecedence walks the documented order: exact flow, listener on the
// address, listener on the wildcard, rules by priority then id, default.
func TestPrecedence(t *testing.T) {
	frame := framegen.Spec{L3: 4, L4: tcp, Src: remote, Dst: local, SrcPort: 4000, DstPort: 80}.Build()
	flow := classifier.Flow{ID: 1, Protocol: classifier.ProtoTCP, Remote: netip.AddrPortFrom(remote, 4000), Local: netip.AddrPortFrom(local, 80), Stream: 1}
	specific := classifier.Listener{ID: 2, Protocol: classifier.ProtoTCP, Addr: local, Port: 80, Stream: 2}
	wildcard := classifier.Listener{ID: 3, Protocol: classifier.ProtoTCP, Port: 80, Stream: 3}
	ruleLow := classifier.Rule{ID: 4, Priority: 1, DstPorts: classifier.Port(80), Action: classifier.ActionSteer, Stream: 4}
	ruleHigh := classifier.Rule{ID: 6, Priority: 0, Protocol: classifier.ProtoTCP, Action: classifier.ActionDrop}
	ruleTie := classifier.Rule{ID: 5, Priority: 0, Dst: netip.MustParsePrefix("198.18.0.0/15"), Action: classifier.ActionPass}

	for _, c := range []struct {
		name   string
		rs     classifier.RuleSet
		v      classifier.Verdict
		stream uint32
		rule   uint32
	}{
		{"flow beats all", classifier.RuleSet{Flows: []classifier.Flow{flow}, Listeners: []classifier.Listener{specific, wildcard}, Rules: []classifier.Rule{ruleHigh}}, classifier.VerdictSteer, 1, 1},
		{"specific listener beats wildcard", classifier.RuleSet{Listeners: []classifier.Listener{wildcard, specific}, Rules: []classifier.Rule{ruleHigh}}, classifier.VerdictSteer, 2, 2},
		{"wildcard listener beats rules", classifier.RuleSet{Listeners: []classifier.Listener{wildcard}, Rules: []classifier.Rule{ruleHigh}}, classifier.VerdictSteer, 3, 3},
		{"lower priority value first", classifier.RuleSet{Rules: []classifier.Rule{ruleLow, ruleHigh}}, classifier.VerdictDrop, 0, 6},
		{"ties go to the lower id", classifier.RuleSet{Rules: []classifier.Rule{ruleHigh, ruleTie, ruleLow}}, classifier.VerdictPass, 0, 5},
		{"default is pass with no rule", classifier.RuleSet{Rules: []classifier.Rule{{ID: 9, DstPorts: classifier.Port(81), Action: classifier.ActionDrop}}}, classifier.VerdictPass, 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := classify(t, &c.rs, frame)
			if m.Verdict != c.v || m.StreamID != c.stream || m.RuleID != c.rule {
				t.Errorf("got %v stream %d rule %d, want %v stream %d rule %d", m.Verdict, m.StreamID, m.RuleID, c.v, c.stream, c.rule)
			}
		})
	}
}

// TestRuleFields checks each match field on its own.
func TestRuleFields(t *testing.T) {
	v4 := framegen.Spec{L3: 4, L4: layers.IPProtocolUDP, Src: remote, Dst: local, SrcPort: 4000, DstPort: 53, Tags: []layers.EthernetType{layers.EthernetTypeDot1Q}, VID: 20}.Build()
	v6 := framegen.Spec{L3: 6, L4: tcp, Src: netip.MustParseAddr("2001:db8::9"), Dst: netip.MustParseAddr("2001:db8::1"), SrcPort: 4000, DstPort: 53}.Build()
	for _, c := range []struct {
		name string
		rule classifier.Rule
		hit4 bool
		hit6 bool
	}{
		{"vlan", classifier.Rule{VLAN: 20}, true, false},
		{"other vlan", classifier.Rule{VLAN: 21}, false, false},
		{"ip version 6", classifier.Rule{IPVersion: 6}, false, true},
		{"udp", classifier.Rule{Protocol: classifier.ProtoUDP}, true, false},
		{"src prefix", classifier.Rule{Src: netip.MustParsePrefix("198.19.0.0/16")}, true, false},
		{"src prefix miss", classifier.Rule{Src: netip.MustParsePrefix("198.18.0.0/16")}, false, false},
		{"dst prefix v6", classifier.Rule{Dst: netip.MustParsePrefix("2001:db8::/126")}, false, true},
		{"src port range", classifier.Rule{SrcPorts: classifier.PortRange{Lo: 3000, Hi: 4000}}, true, true},
		{"dst port range miss", classifier.Rule{DstPorts: classifier.PortRange{Lo: 54, Hi: 100}}, false, false},
		{"any", classifier.Rule{}, true, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := c.rule
			r.ID, r.Action = 7, classifier.ActionDrop
			rs := &classifier.RuleSet{Rules: []classifier.Rule{r}}
			if got := classify(t, rs, v4).Verdict == classifier.VerdictDrop; got != c.hit4 {
				t.Errorf("IPv4 frame: hit %v, want %v", got, c.hit4)
			}
			if got := classify(t, rs, v6).Verdict == classifier.VerdictDrop; got != c.hit6 {
				t.Errorf("IPv6 frame: hit %v, want %v", got, c.hit6)
			}
		})
	}
}

// TestFragments: a later fragment follows its first fragment; without one
// it is a miss; unclaimed first fragments are not remembered.
func TestFragments(t *testing.T) {
	for _, l3 := range []int{4, 6} {
		src, dst := remote, local
		if l3 == 6 {
			src, dst = netip.MustParseAddr("2001:db8::9"), netip.MustParseAddr("2001:db8::1")
		}
		first := framegen.Spec{L3: l3, L4: layers.IPProtocolUDP, Src: src, Dst: dst, SrcPort: 1, DstPort: 5000, Frag: 1, FragID: 77, Payload: 16}
		later := first
		later.Frag = 2
		other := later
		other.FragID = 78
		tables, err := classifier.Compile(&classifier.RuleSet{Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoUDP, Port: 5000, Stream: 9}}})
		if err != nil {
			t.Fatal(err)
		}
		c := classifier.New(tables, 0)
		if m := c.Classify(later.Build()); m.Verdict != classifier.VerdictFragMiss {
			t.Errorf("IPv%d later fragment before its first: %v, want fragmiss", l3, m.Verdict)
		}
		if m := c.Classify(first.Build()); m.Verdict != classifier.VerdictSteer || m.Flags&classifier.FlagFragment == 0 {
			t.Errorf("IPv%d first fragment: %+v", l3, m)
		}
		m := c.Classify(later.Build())
		if m.Verdict != classifier.VerdictSteer || m.StreamID != 9 || m.RuleID != 1 || m.Flags&classifier.FlagLaterFragment == 0 {
			t.Errorf("IPv%d later fragment: %+v, want steer to 9 under rule 1", l3, m)
		}
		if m := c.Classify(other.Build()); m.Verdict != classifier.VerdictFragMiss {
			t.Errorf("IPv%d fragment of another datagram: %v, want fragmiss", l3, m.Verdict)
		}
	}
}

// TestMalformed lists damage the parser must catch.
func TestMalformed(t *testing.T) {
	good := framegen.Spec{L3: 4, L4: tcp, Src: remote, Dst: local, SrcPort: 1, DstPort: 80, Payload: 10}.Build()
	good6 := framegen.Spec{L3: 6, Ext: []uint8{0, 60}, L4: layers.IPProtocolUDP, Src: netip.MustParseAddr("2001:db8::9"), Dst: netip.MustParseAddr("2001:db8::1"), SrcPort: 1, DstPort: 80, Payload: 10}.Build()
	edit := func(b []byte, f func([]byte)) []byte {
		c := append([]byte(nil), b...)
		f(c)
		return c
	}
	for _, c := range []struct {
		name  string
		frame []byte
	}{
		{"runt", good[:13]},
		{"ipv4 version 5", edit(good, func(b []byte) { b[14] = 0x55 })},
		{"ihl 4", edit(good, func(b []byte) { b[14] = 0x44 })},
		{"ihl beyond total", edit(good, func(b []byte) { b[14] = 0x4f })},
		{"total length beyond frame", edit(good, func(b []byte) { b[16], b[17] = 0x05, 0xdc })},
		{"total length under header", edit(good, func(b []byte) { b[16], b[17] = 0, 19 })},
		{"tcp data offset 4", edit(good, func(b []byte) { b[14+20+12] = 0x40 })},
		{"tcp data offset beyond packet", edit(good, func(b []byte) { b[14+20+12] = 0xf0 })},
		{"truncated tcp", good[:14+20+10]},
		{"ipv6 payload length beyond frame", edit(good6, func(b []byte) { b[18], b[19] = 0x10, 0 })},
		{"extension header beyond packet", edit(good6, func(b []byte) { b[54+1] = 200 })},
		{"udp length 7", edit(good6, func(b []byte) { b[78+4], b[78+5] = 0, 7 })},
		{"udp length beyond packet", edit(good6, func(b []byte) { b[78+4], b[78+5] = 0x01, 0 })},
	} {
		t.Run(c.name, func(t *testing.T) {
			// A listener that would claim the frame if it were whole.
			rs := &classifier.RuleSet{Listeners: []classifier.Listener{
				{ID: 1, Protocol: classifier.ProtoTCP, Port: 80, Stream: 1},
				{ID: 2, Protocol: classifier.ProtoUDP, Port: 80, Stream: 1},
			}}
			if m := classify(t, rs, good); m.Verdict != classifier.VerdictSteer {
				t.Fatalf("the undamaged frame is %v", m.Verdict)
			}
			if m := classify(t, rs, c.frame); m.Verdict != classifier.VerdictMalformed || m.StreamID != 0 {
				t.Errorf("got %+v, want malformed", m)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	good := classifier.Rule{ID: 1, Action: classifier.ActionPass}
	for _, c := range []struct {
		name string
		rs   classifier.RuleSet
		want string
	}{
		{"id 0", classifier.RuleSet{Rules: []classifier.Rule{{Action: classifier.ActionPass}}}, "id 0 outside"},
		{"id too big", classifier.RuleSet{Rules: []classifier.Rule{{ID: classifier.MaxRuleID + 1, Action: classifier.ActionPass}}}, "outside 1..16383"},
		{"duplicate id", classifier.RuleSet{Rules: []classifier.Rule{good, good}}, "already used"},
		{"no action", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1}}}, "unknown action"},
		{"steer without stream", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionSteer}}}, "needs a stream"},
		{"drop with stream", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionDrop, Stream: 3}}}, "takes no stream"},
		{"ingest over tcp", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionIngest, Stream: 1, Protocol: classifier.ProtoTCP}}}, "ingest needs protocol udp"},
		{"empty port range", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionPass, DstPorts: classifier.PortRange{Lo: 9, Hi: 8}}}}, "is empty"},
		{"family clash", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionPass, IPVersion: 6, Src: netip.MustParsePrefix("198.18.0.0/15")}}}, "does not belong to IPv6"},
		{"mixed families", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionPass, Src: netip.MustParsePrefix("198.18.0.0/15"), Dst: netip.MustParsePrefix("2001:db8::/32")}}}, "does not belong to IPv4"},
		{"vlan 4095", classifier.RuleSet{Rules: []classifier.Rule{{ID: 1, Action: classifier.ActionPass, VLAN: 4095}}}, "vlan 4095"},
		{"listener port 0", classifier.RuleSet{Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoTCP, Stream: 1}}}, "port must not be 0"},
		{"listener clash", classifier.RuleSet{Listeners: []classifier.Listener{
			{ID: 1, Protocol: classifier.ProtoTCP, Port: 80, Stream: 1},
			{ID: 2, Protocol: classifier.ProtoTCP, Port: 80, Addr: netip.IPv4Unspecified(), Stream: 2}}}, "already held by listener id 1"},
		{"flow families", classifier.RuleSet{Flows: []classifier.Flow{{ID: 1, Protocol: classifier.ProtoUDP, Stream: 1,
			Remote: netip.MustParseAddrPort("198.18.0.2:1"), Local: netip.MustParseAddrPort("[2001:db8::1]:2")}}}, "different families"},
		{"too many rules", classifier.RuleSet{Rules: make([]classifier.Rule, classifier.MaxRules+1)}, "at most 1024"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.rs.Validate()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Validate() = %v, want an error containing %q", err, c.want)
			}
			if _, err := classifier.Compile(&c.rs); err == nil {
				t.Error("Compile accepted what Validate refused")
			}
		})
	}
	ok := classifier.RuleSet{
		Flows: []classifier.Flow{
			{ID: 5, Protocol: classifier.ProtoTCP, Stream: 1, Remote: netip.MustParseAddrPort("198.18.0.2:1"), Local: netip.MustParseAddrPort("198.18.0.1:80")},
			{ID: 5, Protocol: classifier.ProtoTCP, Stream: 1, Remote: netip.MustParseAddrPort("198.18.0.3:1"), Local: netip.MustParseAddrPort("198.18.0.1:80")},
		},
		Listeners: []classifier.Listener{{ID: 5, Protocol: classifier.ProtoTCP, Port: 80, Stream: 1}},
	}
	if err := ok.Validate(); err != nil {
		t.Errorf("flows sharing their listener's id: %v", err)
	}
}

// TestNoAllocations holds the reference to zero allocations per frame on
// every header mix, whole and truncated.
func TestNoAllocations(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tables, err := classifier.Compile(framegen.RandomRuleSet(rng))
	if err != nil {
		t.Fatal(err)
	}
	c := classifier.New(tables, 0)
	var frames [][]byte
	for _, s := range framegen.AllSpecs(rng) {
		f := s.Build()
		frames = append(frames, f, f[:len(f)/2])
	}
	for _, bc := range framegen.BenchCases() {
		frames = append(frames, bc.Frame)
	}
	// Fill the fragment table first: its map may grow once, not per frame.
	for _, f := range frames {
		c.Classify(f)
	}
	allocs := testing.AllocsPerRun(20, func() {
		for _, f := range frames {
			c.Classify(f)
		}
	})
	if allocs != 0 {
		t.Errorf("%v allocations per pass over %d frames, want 0", allocs, len(frames))
	}
}

// FuzzClassify: no input makes the reference panic, and malformed frames
// are never steered.
func FuzzClassify(f *testing.F) {
	for _, s := range framegen.AllSpecs(rand.New(rand.NewPCG(9, 9)))[:40] {
		f.Add(s.Build())
	}
	rs := framegen.RandomRuleSet(rand.New(rand.NewPCG(4, 4)))
	for _, s := range framegen.ICMPErrorSpecs(rand.New(rand.NewPCG(9, 9)), rs)[:20] {
		f.Add(s.Build())
	}
	tables, err := classifier.Compile(rs)
	if err != nil {
		f.Fatal(err)
	}
	ingestRules := map[uint32]bool{}
	for _, r := range tables.Rules() {
		ingestRules[r.ID] = r.Action == classifier.ActionIngest
	}
	c := classifier.New(tables, 0)
	f.Fuzz(func(t *testing.T, frame []byte) {
		m := c.Classify(frame)
		if m.Verdict >= classifier.NumVerdicts {
			t.Fatalf("verdict %d", m.Verdict)
		}
		// Only an ingest rule that refused a datagram names itself on a
		// malformed frame.
		if m.Verdict == classifier.VerdictMalformed && (m.StreamID != 0 || (m.RuleID != 0 && !ingestRules[m.RuleID])) {
			t.Fatalf("malformed frame carries stream %d rule %d", m.StreamID, m.RuleID)
		}
		im, strip, ok := classifier.Ingest(frame, &m)
		if ok != (m.Verdict == classifier.VerdictIngest) {
			t.Fatalf("Ingest ok=%v for a %v frame", ok, m.Verdict)
		}
		if ok && int(im.PayloadOffset)+int(im.PayloadLen) > len(frame)-strip {
			t.Fatalf("payload %d+%d beyond the %d-byte stripped frame", im.PayloadOffset, im.PayloadLen, len(frame)-strip)
		}
	})
}

func BenchmarkReference(b *testing.B) {
	for _, bc := range framegen.BenchCases() {
		tables, err := classifier.Compile(bc.Rules)
		if err != nil {
			b.Fatal(err)
		}
		c := classifier.New(tables, 0)
		if m := c.Classify(bc.Frame); m.Verdict != bc.Want {
			b.Fatalf("%s: %v, want %v", bc.Name, m.Verdict, bc.Want)
		}
		b.Run(bc.Name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.Frame)))
			for b.Loop() {
				c.Classify(bc.Frame)
			}
		})
	}
}
