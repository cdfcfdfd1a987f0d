package classifier_test

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

var (
	remote6 = netip.MustParseAddr("2001:db8::9")
	router4 = netip.MustParseAddr("198.18.200.7")
	router6 = netip.MustParseAddr("2001:db8:ffff::9")
)

// sent is a packet the application sent from local:4000 to remote:53.
func sent(l3 int, l4 layers.IPProtocol) framegen.Spec {
	if l3 == 6 {
		return framegen.Spec{L3: 6, L4: l4, Src: local6, Dst: remote6, SrcPort: 4000, DstPort: 53, Payload: 30}
	}
	return framegen.Spec{L3: 4, L4: l4, Src: local, Dst: remote, SrcPort: 4000, DstPort: 53, Payload: 30}
}

// icmpErr is the error a router sends back about q.
func icmpErr(q framegen.Spec, typ, code uint8) framegen.ICMPErrorSpec {
	from := router4
	if q.L3 == 6 {
		from = router6
	}
	return framegen.ICMPErrorSpec{Reporter: from, Type: typ, Code: code, Word: 1400, Quoted: q}
}

// TestICMPErrorPrecedence: an ICMP error about a packet the application
// sent reaches the application's flow, else its listener on the address,
// else its wildcard listener; rules never decide it.
func TestICMPErrorPrecedence(t *testing.T) {
	for _, l3 := range []int{4, 6} {
		for _, l4 := range []layers.IPProtocol{tcp, udp} {
			q := sent(l3, l4)
			proto := classifier.Protocol(l4)
			flow := classifier.Flow{ID: 1, Protocol: proto, Remote: netip.AddrPortFrom(q.Dst, 53), Local: netip.AddrPortFrom(q.Src, 4000), Stream: 1}
			specific := classifier.Listener{ID: 2, Protocol: proto, Addr: q.Src, Port: 4000, Stream: 2}
			wildcard := classifier.Listener{ID: 3, Protocol: proto, Port: 4000, Stream: 3}
			// Rules that claim everything, the ICMP error's own headers included.
			steerAll := classifier.Rule{ID: 4, Action: classifier.ActionSteer, Stream: 4}
			dropAll := classifier.Rule{ID: 5, Priority: 1, Action: classifier.ActionDrop}
			typ, code := uint8(3), uint8(4) // fragmentation needed
			if l3 == 6 {
				typ, code = 2, 0 // packet too big
			}
			frame := icmpErr(q, typ, code).Build()
			for _, c := range []struct {
				name         string
				rs           classifier.RuleSet
				stream, rule uint32
			}{
				{"flow beats listeners", classifier.RuleSet{Flows: []classifier.Flow{flow}, Listeners: []classifier.Listener{specific, wildcard}, Rules: []classifier.Rule{steerAll}}, 1, 1},
				{"specific listener beats wildcard", classifier.RuleSet{Listeners: []classifier.Listener{wildcard, specific}, Rules: []classifier.Rule{dropAll}}, 2, 2},
				{"wildcard listener", classifier.RuleSet{Listeners: []classifier.Listener{wildcard}}, 3, 3},
				{"rules do not apply", classifier.RuleSet{Rules: []classifier.Rule{steerAll, dropAll}}, 0, 0},
			} {
				m := classify(t, &c.rs, frame)
				want := classifier.VerdictSteer
				if c.rule == 0 {
					want = classifier.VerdictPass
				}
				if m.Verdict != want || m.StreamID != c.stream || m.RuleID != c.rule {
					t.Errorf("IPv%d %v %s: got %v stream %d rule %d, want %v stream %d rule %d", l3, l4, c.name, m.Verdict, m.StreamID, m.RuleID, want, c.stream, c.rule)
				}
				// The metadata describes the outer packet: its IP header and
				// the ICMP header.
				l4Off := uint16(14 + 20)
				if l3 == 6 {
					l4Off = 14 + 40
				}
				if m.L3Offset != 14 || m.L4Offset != l4Off || (m.Flags&classifier.FlagIPv6 != 0) != (l3 == 6) {
					t.Errorf("IPv%d %v %s: offsets %d/%d flags %#x", l3, l4, c.name, m.L3Offset, m.L4Offset, m.Flags)
				}
			}
		}
	}
}

// TestICMPErrorKinds: which messages about a held tuple are steered, and
// which stay the kernel's.
func TestICMPErrorKinds(t *testing.T) {
	rs := &classifier.RuleSet{Listeners: []classifier.Listener{
		{ID: 1, Protocol: classifier.ProtoUDP, Port: 4000, Stream: 7},
		{ID: 2, Protocol: classifier.ProtoTCP, Port: 4000, Stream: 7},
	}}
	tables, err := classifier.Compile(rs)
	if err != nil {
		t.Fatal(err)
	}
	c := classifier.New(tables, 0)
	v4, v6 := sent(4, udp), sent(6, udp)
	withOpts := v4
	withOpts.V4Opts = true
	firstFrag, laterFrag := v4, v4
	firstFrag.Frag, laterFrag.Frag = 1, 2
	v6Ext := v6
	v6Ext.Ext = []uint8{60}
	inbound := v4 // a packet the remote sent to us, not one we sent
	inbound.Src, inbound.Dst, inbound.SrcPort, inbound.DstPort = remote, local, 53, 4000
	echo := v4
	echo.L4 = layers.IPProtocolICMPv4
	asV6 := icmpErr(v6, 3, 3) // an ICMPv4 type inside ICMPv6: type 3 is time exceeded there
	tagged := icmpErr(v4, 3, 3)
	tagged.Tags, tagged.VID = []layers.EthernetType{layers.EthernetTypeQinQ, layers.EthernetTypeDot1Q}, 10
	outerExt := icmpErr(v6, 1, 4)
	outerExt.Ext = []uint8{0, 43, 60}
	outerOpts := icmpErr(v4, 11, 0)
	outerOpts.V4Opts = true
	outerFrag := icmpErr(v4, 3, 3)
	outerFrag.Frag = true
	outerFrag6 := icmpErr(v6, 1, 4)
	outerFrag6.Frag = true
	minimal := icmpErr(v4, 3, 3)
	minimal.QuoteLen = 20 + 8
	short := icmpErr(v4, 3, 3)
	short.QuoteLen = 20 + 7
	minimal6 := icmpErr(v6, 2, 0)
	minimal6.QuoteLen = 40 + 8
	short6 := icmpErr(v6, 2, 0)
	short6.QuoteLen = 40 + 7
	for _, k := range []struct {
		name  string
		spec  framegen.ICMPErrorSpec
		steer bool
	}{
		{"port unreachable", icmpErr(v4, 3, 3), true},
		{"fragmentation needed", icmpErr(v4, 3, 4), true},
		{"time exceeded", icmpErr(v4, 11, 0), true},
		{"parameter problem", icmpErr(v4, 12, 0), true},
		{"quote with IPv4 options", icmpErr(withOpts, 3, 3), true},
		{"quote of a first fragment", icmpErr(firstFrag, 3, 4), true},
		{"quote of a later fragment", icmpErr(laterFrag, 3, 4), false},
		{"quote of a packet received", icmpErr(inbound, 3, 3), false},
		{"quote of ICMP", icmpErr(echo, 3, 3), false},
		{"echo reply", icmpErr(v4, 0, 0), false},
		{"redirect", icmpErr(v4, 5, 1), false},
		{"source quench", icmpErr(v4, 4, 0), false},
		{"tagged", tagged, true},
		{"outer IPv4 options", outerOpts, true},
		{"outer fragment", outerFrag, false},
		{"quote cut to 8 bytes of UDP", minimal, true},
		{"quote cut to 7 bytes of UDP", short, false},
		{"v6 dest unreachable", icmpErr(v6, 1, 4), true},
		{"v6 packet too big", icmpErr(v6, 2, 0), true},
		{"v6 time exceeded", asV6, true},
		{"v6 parameter problem", icmpErr(v6, 4, 0), true},
		{"v6 outer extension headers", outerExt, true},
		{"v6 outer fragment", outerFrag6, false},
		{"v6 quote with an extension header", icmpErr(v6Ext, 1, 4), false},
		{"v6 quote cut to 8 bytes of UDP", minimal6, true},
		{"v6 quote cut to 7 bytes of UDP", short6, false},
		{"v6 echo request", icmpErr(v6, 128, 0), false},
		{"v6 neighbour solicitation", icmpErr(v6, 135, 0), false},
		{"v6 type 0", icmpErr(v6, 0, 0), false},
		{"v6 type 5", icmpErr(v6, 5, 0), false},
	} {
		frame := k.spec.Build()
		c.ResetFragments()
		m := c.Classify(frame)
		want := classifier.Meta{Verdict: classifier.VerdictPass}
		if k.steer {
			want = classifier.Meta{Verdict: classifier.VerdictSteer, StreamID: 7, RuleID: 1}
		}
		if m.Verdict != want.Verdict || m.StreamID != want.StreamID || m.RuleID != want.RuleID {
			t.Errorf("%s: got %v stream %d rule %d, want %v stream %d rule %d", k.name, m.Verdict, m.StreamID, m.RuleID, want.Verdict, want.StreamID, want.RuleID)
		}
		if k.name == "tagged" && m.VLAN != 11 {
			t.Errorf("tagged: VLAN %d, want the inner tag's 11", m.VLAN)
		}
	}
}

// TestICMPErrorTruncated: an ICMP error cut anywhere is never steered unless
// the whole quote the classifier reads is there, and damage to the quote's
// header never steers it elsewhere.
func TestICMPErrorTruncated(t *testing.T) {
	rs := &classifier.RuleSet{Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoTCP, Port: 4000, Stream: 7}}}
	for _, l3 := range []int{4, 6} {
		frame := icmpErr(sent(l3, tcp), 3, 3).Build()
		if l3 == 6 {
			frame = icmpErr(sent(l3, tcp), 1, 4).Build()
		}
		if m := classify(t, rs, frame); m.Verdict != classifier.VerdictSteer {
			t.Fatalf("IPv%d: whole error is %v", l3, m.Verdict)
		}
		for n := range len(frame) {
			if m := classify(t, rs, frame[:n]); m.Verdict == classifier.VerdictSteer || m.StreamID != 0 {
				t.Errorf("IPv%d cut to %d bytes: %+v", l3, n, m)
			}
		}
	}
}

// TestICMPErrorsNoAllocations holds the ICMP path to zero allocations.
func TestICMPErrorsNoAllocations(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	rs := framegen.RandomRuleSet(rng)
	tables, err := classifier.Compile(rs)
	if err != nil {
		t.Fatal(err)
	}
	c := classifier.New(tables, 0)
	var frames [][]byte
	steered := 0
	for _, s := range framegen.ICMPErrorSpecs(rng, rs) {
		f := s.Build()
		frames = append(frames, f, f[:len(f)-1])
		if c.Classify(f).Verdict == classifier.VerdictSteer {
			steered++
		}
	}
	if steered == 0 {
		t.Fatal("no generated ICMP error was steered: the test would measure only the pass path")
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
