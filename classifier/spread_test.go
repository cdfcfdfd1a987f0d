package classifier_test

import (
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

// twoInstances is a spread over streams 7 and 8 where every third slot
// changed hands from 7 to 8.
func twoInstances(seed uint64) *classifier.Spread {
	sp := &classifier.Spread{Seed: seed, Slots: make([]classifier.Slot, 251)}
	for i := range sp.Slots {
		switch i % 3 {
		case 0:
			sp.Slots[i] = classifier.Slot{Current: 8, Previous: 7}
		case 1:
			sp.Slots[i] = classifier.Slot{Current: 8}
		default:
			sp.Slots[i] = classifier.Slot{Current: 7, Previous: 7} // the same owner: no second chance
		}
	}
	return sp
}

// TestSpreadSteersBySlot checks that a listener with a Spread steers every
// flow to the current owner of maglev.FlowHash's slot, marks the flows of
// slots with another previous owner, leaves exact flows alone, and that
// SecondChance finds the same slot from the bare IP packet.
func TestSpreadSteersBySlot(t *testing.T) {
	const seed = 0x5eed
	sp := twoInstances(seed)
	flowRemote := netip.MustParseAddr("198.19.0.77")
	rs := &classifier.RuleSet{
		Listeners: []classifier.Listener{{ID: 3, Protocol: classifier.ProtoTCP, Port: 80, Stream: 7, Spread: sp}},
		Flows:     []classifier.Flow{{ID: 4, Protocol: classifier.ProtoTCP, Remote: netip.AddrPortFrom(flowRemote, 5000), Local: netip.AddrPortFrom(local, 80), Stream: 9}},
	}
	tables, err := classifier.Compile(rs)
	if err != nil {
		t.Fatal(err)
	}
	c := classifier.New(tables, 0)
	seen := map[uint32]int{}
	marked := 0
	for i := range 600 {
		for _, fam := range []struct {
			l3       int
			src, dst netip.Addr
		}{
			{4, netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), local},
			{6, netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 14: byte(i >> 8), 15: byte(i)}), netip.MustParseAddr("2001:db8::1")},
		} {
			sport := uint16(1024 + i*7)
			frame := framegen.Spec{L3: fam.l3, L4: layers.IPProtocolTCP, Src: fam.src, Dst: fam.dst, SrcPort: sport, DstPort: 80}.Build()
			m := c.Classify(frame)
			want := sp.Slots[maglev.FlowHash(seed, 6, fam.src, fam.dst, sport, 80)%uint64(len(sp.Slots))]
			if m.Verdict != classifier.VerdictSteer || m.StreamID != want.Current || m.RuleID != 3 {
				t.Fatalf("%v:%d: got %v stream %d rule %d, want steer to %d by 3", fam.src, sport, m.Verdict, m.StreamID, m.RuleID, want.Current)
			}
			second := want.Previous != 0 && want.Previous != want.Current
			if got := m.Flags&classifier.FlagSecondChance != 0; got != second {
				t.Fatalf("%v:%d: second-chance flag %v for slot %+v", fam.src, sport, got, want)
			}
			seen[m.StreamID]++
			if second {
				marked++
			}
			got, ok := tables.SecondChance(frame[m.L3Offset:])
			if !ok || got != want {
				t.Fatalf("%v:%d: SecondChance = %+v, %v; want %+v", fam.src, sport, got, ok, want)
			}
		}
	}
	if seen[7] < 300 || seen[8] < 600 || marked < 300 {
		t.Errorf("flows per stream %v, %d marked: the slots are not being used", seen, marked)
	}

	flow := framegen.Spec{L3: 4, L4: layers.IPProtocolTCP, Src: flowRemote, Dst: local, SrcPort: 5000, DstPort: 80}.Build()
	if m := c.Classify(flow); m.StreamID != 9 || m.Flags&classifier.FlagSecondChance != 0 {
		t.Errorf("exact flow: stream %d flags %#x, want stream 9 unmarked", m.StreamID, m.Flags)
	}
	if _, ok := tables.SecondChance(flow[14:]); ok {
		t.Error("SecondChance offered a slot for a packet an exact flow claims")
	}
	udp := framegen.Spec{L3: 4, L4: layers.IPProtocolUDP, Src: remote, Dst: local, SrcPort: 5000, DstPort: 80}.Build()
	if _, ok := tables.SecondChance(udp[14:]); ok {
		t.Error("SecondChance offered a slot for UDP")
	}
	if n := testing.AllocsPerRun(100, func() { c.Classify(flow[:]) }); n != 0 {
		t.Errorf("Classify allocates %v times per frame", n)
	}
	some := framegen.Spec{L3: 6, L4: layers.IPProtocolTCP, Src: netip.MustParseAddr("2001:db8::9"), Dst: netip.MustParseAddr("2001:db8::1"), SrcPort: 999, DstPort: 80}.Build()
	if n := testing.AllocsPerRun(100, func() { c.Classify(some); tables.SecondChance(some[14:]) }); n != 0 {
		t.Errorf("a spread hit allocates %v times per frame", n)
	}
}

func TestSpreadValidation(t *testing.T) {
	for _, sp := range []*classifier.Spread{
		{Seed: 1},
		{Seed: 1, Slots: []classifier.Slot{{Current: 1}, {Current: 0, Previous: 1}}},
	} {
		rs := &classifier.RuleSet{Listeners: []classifier.Listener{{ID: 3, Protocol: classifier.ProtoTCP, Port: 80, Stream: 1, Spread: sp}}}
		if _, err := classifier.Compile(rs); err == nil {
			t.Errorf("spread %+v compiled", sp)
		}
	}
}
