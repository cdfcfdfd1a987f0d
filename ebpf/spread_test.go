package ebpf

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

var (
	spreadLocal4 = netip.MustParseAddr("198.18.0.1")
	spreadLocal6 = netip.MustParseAddr("2001:db8::1")
)

// cycleSpread is a spread of n slots whose owners cycle through streams
// first..first+2, every other slot with the stream before as its previous
// owner: neighbouring slots differ, so a frame hashed with another table's
// seed or size lands on another owner.
func cycleSpread(seed uint64, n int, first uint32) *classifier.Spread {
	sp := &classifier.Spread{Seed: seed, Slots: make([]classifier.Slot, n)}
	for i := range sp.Slots {
		s := classifier.Slot{Current: first + uint32(i%3)}
		if i%2 == 0 {
			s.Previous = s.Current + 7
		}
		sp.Slots[i] = s
	}
	return sp
}

// spreadFrames are TCP frames of many flows from both families to port on
// the addresses spreadLocal4 and spreadLocal6.
func spreadFrames(port uint16) [][]byte {
	var frames [][]byte
	for i := range 200 {
		sport := uint16(1024 + 37*i)
		frames = append(frames,
			framegen.Spec{L3: 4, L4: layers.IPProtocolTCP, Src: netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), Dst: spreadLocal4, SrcPort: sport, DstPort: port}.Build(),
			framegen.Spec{L3: 6, L4: layers.IPProtocolTCP, Src: netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 5, 14: byte(i >> 8), 15: byte(i)}), Dst: spreadLocal6, SrcPort: sport, DstPort: port}.Build())
	}
	return frames
}

// listenerEntry reads the listeners table's entry for a TCP listener.
func listenerEntry(t *testing.T, p *Program, addr netip.Addr, port uint16) bpfFbListener {
	t.Helper()
	k := bpfFbListenKey{Family: classifier.Family(addr), Proto: uint8(classifier.ProtoTCP), Port: port}
	if !addr.IsUnspecified() {
		k.Addr = words32(classifier.ToAddr16(addr))
	}
	var v bpfFbListener
	if err := p.objs.Listeners.Lookup(&k, &v); err != nil {
		t.Fatalf("listener %v:%d: %v", addr, port, err)
	}
	return v
}

// spreadMapID is the id of the table under index in the spreads map, 0 if
// there is none.
func spreadMapID(t *testing.T, p *Program, index uint32) uint32 {
	t.Helper()
	var id uint32
	err := p.objs.Spreads.Lookup(index, &id)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return 0
	}
	if err != nil {
		t.Fatalf("spreads[%d]: %v", index, err)
	}
	return id
}

// TestSpreadSwapIsAtomic flips the program between two tables that differ
// in one listener's spread (seed, size and owners) while frames run: every
// frame must get what one table or the other gives it, never the old slots
// under the new seed or size. A spread equal in both (though a different
// value each time) keeps its kernel table throughout; the changed one gets
// a fresh table, and the old one is cleared an Update later.
func TestSpreadSwapIsAtomic(t *testing.T) {
	p := newPair(t)
	shared := cycleSpread(0xb0b, maglev.DefaultSize, 4)
	var tables [2]*classifier.Tables
	for i, sp := range []*classifier.Spread{cycleSpread(1, 251, 1), cycleSpread(3, 61, 11)} {
		var err error
		tables[i], err = classifier.Compile(&classifier.RuleSet{Listeners: []classifier.Listener{
			{ID: 1, Protocol: classifier.ProtoTCP, Addr: spreadLocal4, Port: 80, Stream: 1, Spread: sp},
			{ID: 2, Protocol: classifier.ProtoTCP, Addr: spreadLocal6, Port: 80, Stream: 1, Spread: sp},
			{ID: 3, Protocol: classifier.ProtoTCP, Port: 443, Stream: 4, Spread: &classifier.Spread{Seed: shared.Seed, Slots: slices.Clone(shared.Slots)}},
		}})
		if err != nil {
			t.Fatal(err)
		}
	}
	frames := append(spreadFrames(80), spreadFrames(443)...)
	want := make([][2]classifier.Meta, len(frames))
	moved := 0
	for i, f := range frames {
		for j := range tables {
			want[i][j] = classifier.New(tables[j], 0).Classify(f)
			if want[i][j].Verdict != classifier.VerdictSteer {
				t.Fatalf("frame %d: %v under table %d, want steer", i, want[i][j].Verdict, j)
			}
		}
		if want[i][0] != want[i][1] {
			moved++
		}
	}
	if moved != len(frames)/2 {
		t.Fatalf("%d frames differ between the tables, want the %d to port 80", moved, len(frames)/2)
	}

	if err := p.prog.Update(tables[0]); err != nil {
		t.Fatal(err)
	}
	before80, before443 := listenerEntry(t, p.prog, spreadLocal4, 80), listenerEntry(t, p.prog, netip.IPv4Unspecified(), 443)
	if v6 := listenerEntry(t, p.prog, spreadLocal6, 80); v6.Spread != before80.Spread {
		t.Errorf("listeners with one spread have tables %d and %d, want one shared", before80.Spread, v6.Spread)
	}
	if v6 := listenerEntry(t, p.prog, netip.IPv6Unspecified(), 443); v6.Spread != before443.Spread {
		t.Errorf("a wildcard listener's families have tables %d and %d, want one shared", before443.Spread, v6.Spread)
	}
	table443 := spreadMapID(t, p.prog, before443.Spread)
	if err := p.prog.Update(tables[1]); err != nil {
		t.Fatal(err)
	}
	after80, after443 := listenerEntry(t, p.prog, spreadLocal4, 80), listenerEntry(t, p.prog, netip.IPv4Unspecified(), 443)
	if after443.Spread != before443.Spread || spreadMapID(t, p.prog, after443.Spread) != table443 {
		t.Errorf("the unchanged spread moved from table %d (map %d) to %d (map %d)", before443.Spread, table443, after443.Spread, spreadMapID(t, p.prog, after443.Spread))
	}
	if after80.Spread == before80.Spread || after80.Spread == 0 {
		t.Errorf("the changed spread stayed in table %d (now %d)", before80.Spread, after80.Spread)
	}
	if spreadMapID(t, p.prog, before80.Spread) == 0 {
		t.Errorf("the old table %d went in the Update that left it: a frame that read the listener just before meets no table", before80.Spread)
	}
	if err := p.prog.Update(tables[1]); err != nil {
		t.Fatal(err)
	}
	if id := spreadMapID(t, p.prog, before80.Spread); id != 0 {
		t.Errorf("the old table %d is still there (map %d) an Update after it was left", before80.Spread, id)
	}

	const flips = 100
	runs := flipWhileRunning(t, p, tables, frames, want, flips)
	if got := listenerEntry(t, p.prog, netip.IPv4Unspecified(), 443); got.Spread != before443.Spread || spreadMapID(t, p.prog, got.Spread) != table443 {
		t.Errorf("after %d flips the unchanged spread is in table %d (map %d), want %d (map %d)", flips, got.Spread, spreadMapID(t, p.prog, got.Spread), before443.Spread, table443)
	}
	t.Logf("%d frames during %d updates", runs, flips)
}

// TestSpreadBound: the program holds MaxSpreads distinct spreads, and
// Update refuses one more, or a spread of more than MaxSpreadSlots slots,
// leaving the tables as they were.
func TestSpreadBound(t *testing.T) {
	p := newPair(t)
	ruleSet := func(n int) *classifier.RuleSet {
		rs := &classifier.RuleSet{}
		for i := range n {
			rs.Listeners = append(rs.Listeners, classifier.Listener{
				ID: uint32(1 + i), Protocol: classifier.ProtoTCP, Port: uint16(1000 + i), Stream: 1,
				Spread: cycleSpread(uint64(i), 1+i%5, 1),
			})
		}
		return rs
	}
	full := ruleSet(MaxSpreads)
	// Listeners sharing a spread count once.
	full.Listeners = append(full.Listeners, classifier.Listener{ID: 9000, Protocol: classifier.ProtoTCP, Port: 2000, Stream: 1, Spread: full.Listeners[0].Spread})
	if err := p.install(full); err != nil {
		t.Fatalf("%d distinct spreads: %v", MaxSpreads, err)
	}
	frames := slices.Concat(spreadFrames(1000), spreadFrames(uint16(1000+MaxSpreads-1)), spreadFrames(2000))
	check := func(when string) {
		t.Helper()
		for _, f := range frames {
			v, err := p.compare(f)
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			if v != classifier.VerdictSteer {
				t.Fatalf("%s: a frame to a spread listener is %v", when, v)
			}
		}
	}
	check("full")

	over, err := classifier.Compile(ruleSet(MaxSpreads + 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.prog.Update(over); err == nil || !strings.Contains(err.Error(), "at most 256") {
		t.Errorf("Update with %d distinct spreads: %v, want refused", MaxSpreads+1, err)
	}
	check("after refusing too many spreads")

	huge, err := classifier.Compile(&classifier.RuleSet{Listeners: []classifier.Listener{
		{ID: 1, Protocol: classifier.ProtoTCP, Port: 80, Stream: 1, Spread: cycleSpread(1, MaxSpreadSlots+1, 1)},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.prog.Update(huge); err == nil || !strings.Contains(err.Error(), "slots") {
		t.Errorf("Update with a spread of %d slots: %v, want refused", MaxSpreadSlots+1, err)
	}
	check("after refusing a spread too large")
}
