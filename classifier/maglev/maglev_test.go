package maglev

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

func names(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("web-%d", i)
	}
	return out
}

func mustNew(t *testing.T, instances []string, seed uint64) *Table {
	t.Helper()
	tab, err := New(instances, seed, DefaultSize)
	if err != nil {
		t.Fatal(err)
	}
	return tab
}

// Two boxes that learn the instances in different orders must still build
// the same table, slot for slot.
func TestIdenticalFromShuffledInput(t *testing.T) {
	in := names(13)
	ref := mustNew(t, in, 42)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 5 {
		shuffled := slices.Clone(in)
		rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		got := mustNew(t, shuffled, 42)
		if !slices.Equal(got.slots, ref.slots) {
			t.Fatalf("order %v gave a different table", shuffled)
		}
	}
	if other := mustNew(t, in, 43); slices.Equal(other.slots, ref.slots) {
		t.Fatal("seeds 42 and 43 gave the same table; the seed is not used")
	}
}

// The table is fixed by its inputs forever: boxes running different
// versions of fabricbridge must agree. These owners were computed once; a
// change here is a change of the hash, which splits a cluster mid-upgrade.
func TestTableIsStableAcrossVersions(t *testing.T) {
	tab := mustNew(t, []string{"a", "b", "c"}, 1)
	var got []string
	for _, h := range []uint64{0, 1, 2, 1000, 65536, 1 << 40} {
		got = append(got, tab.Owner(h))
	}
	want := []string{"a", "b", "a", "c", "c", "a"}
	if !slices.Equal(got, want) {
		t.Fatalf("owners %v, want %v", got, want)
	}
}

func TestBalance(t *testing.T) {
	for _, n := range []int{1, 2, 3, 7, 50, 655} {
		tab := mustNew(t, names(n), 9)
		ideal := float64(DefaultSize) / float64(n)
		counts := tab.Counts()
		if len(counts) != n {
			t.Fatalf("%d instances, %d own slots", n, len(counts))
		}
		total := 0
		for name, c := range counts {
			total += c
			if dev := math.Abs(float64(c)-ideal) / ideal; dev > 0.02 {
				t.Errorf("n=%d: %s owns %d slots, %.1f%% from the ideal %.0f", n, name, c, 100*dev, ideal)
			}
		}
		if total != DefaultSize {
			t.Fatalf("n=%d: %d of %d slots owned", n, total, DefaultSize)
		}
	}
}

// One instance joining or leaving moves about 1/n of the slots; Maglev
// trades a little more than that for its balance.
func TestMinimalDisruption(t *testing.T) {
	for _, n := range []int{3, 10, 40} {
		base := names(n)
		before := mustNew(t, base, 5)

		left := mustNew(t, base[1:], 5)
		ideal := 1 / float64(n)
		if got := Moved(before, left); got < ideal || got > 1.5*ideal {
			t.Errorf("n=%d, one leaves: %.4f of slots moved, ideal %.4f", n, got, ideal)
		} else {
			t.Logf("n=%d, one leaves: %.4f of slots moved, ideal %.4f (%.2fx)", n, got, ideal, got/ideal)
		}

		joined := mustNew(t, append(slices.Clone(base), "web-new"), 5)
		ideal = 1 / float64(n+1)
		if got := Moved(before, joined); got < ideal || got > 1.5*ideal {
			t.Errorf("n=%d, one joins: %.4f of slots moved, ideal %.4f", n, got, ideal)
		} else {
			t.Logf("n=%d, one joins: %.4f of slots moved, ideal %.4f (%.2fx)", n, got, ideal, got/ideal)
		}
		// What moves on a join goes to the newcomer; Maglev shuffles only
		// a little between the old hands (the excess over the ideal).
		shuffled := 0
		for s := range before.slots {
			if b, j := before.SlotOwner(s), joined.SlotOwner(s); b != j && j != "web-new" {
				shuffled++
			}
		}
		if frac := float64(shuffled) / DefaultSize; frac > ideal/4 {
			t.Errorf("n=%d: %.4f of slots moved between old instances on a join", n, frac)
		}
	}
}

func TestNewRefuses(t *testing.T) {
	for _, c := range []struct {
		instances []string
		size      int
	}{
		{[]string{"a"}, 65536},            // not prime
		{[]string{"a"}, 1},                // too small
		{[]string{"a", "a"}, DefaultSize}, // duplicate
		{[]string{""}, DefaultSize},       // empty name
		{names(700), DefaultSize},         // fewer than 100 slots each
		{[]string{"a"}, MaxSize + 2},      // too large
	} {
		if _, err := New(c.instances, 0, c.size); err == nil {
			t.Errorf("New(%d instances, size %d) accepted", len(c.instances), c.size)
		}
	}
	empty, err := New(nil, 0, 101)
	if err != nil {
		t.Fatal(err)
	}
	if empty.Owner(5) != "" || empty.Index(5) != NoOwner {
		t.Fatal("an empty table has an owner")
	}
}

// Connections opened under one table must all be found, by their first or
// second chance, after an instance joins or leaves.
func TestChainKeepsEstablishedConnections(t *testing.T) {
	base := names(5)
	chain := NewChain(mustNew(t, base, 3))
	rng := rand.New(rand.NewPCG(3, 4))
	flows := make(map[uint64]string) // flow hash -> instance that accepted it
	for range 100_000 {
		h := rng.Uint64()
		flows[h], _ = chain.Lookup(h)
	}

	for step, next := range [][]string{
		append(slices.Clone(base), "web-5"),     // a join
		append(slices.Clone(base[1:]), "web-5"), // web-0 drains: it leaves the table, keeps its connections
	} {
		var err error
		if chain, err = chain.Advance(mustNew(t, next, 3)); err != nil {
			t.Fatal(err)
		}
		lost, second := 0, 0
		for h, owner := range flows {
			cur, prev := chain.Lookup(h)
			switch owner {
			case cur:
			case prev:
				second++
			default:
				lost++
			}
		}
		// Step 1 moves 1/6 of the flows to web-5; step 2 moves web-0's.
		t.Logf("step %d: %d of %d flows found by their second chance", step, second, len(flows))
		if second == 0 {
			t.Fatalf("step %d: no flow needed a second chance; the change moved nothing", step)
		}
		if step == 0 && lost != 0 {
			t.Fatalf("step %d: %d flows lost both chances", step, lost)
		}
		if step == 1 {
			// A slot that changed hands twice (to web-5, then again)
			// remembers only its last owner: those flows are lost, and
			// there must be few (two changes hitting one slot).
			if frac := float64(lost) / float64(len(flows)); frac > 0.02 {
				t.Fatalf("step %d: %.3f of flows lost both chances", step, frac)
			}
		}
	}

	// A drained instance past its deadline is forgotten: no second
	// chance points at it any more.
	chain = chain.Forget("web-0")
	for h := range flows {
		if cur, prev := chain.Lookup(h); cur == "web-0" || prev == "web-0" {
			t.Fatal("web-0 still gets packets after Forget")
		}
	}
}

// An instance that dies while a drained one still finishes its
// connections must not take the drained one's second chance with it: the
// slots that pass on from the dead instance keep the previous owner they
// had. Plain Advance then Forget loses a third of them; AdvanceWithout
// only those whose slot also moved between the living.
func TestChainSurvivesADeathAfterADrain(t *testing.T) {
	base := names(4)
	start := NewChain(mustNew(t, base, 3))
	rng := rand.New(rand.NewPCG(5, 6))
	drained := make(map[uint64]bool) // flows web-0 accepted
	for range 100_000 {
		h := rng.Uint64()
		if cur, _ := start.Lookup(h); cur == "web-0" {
			drained[h] = true
		}
	}
	afterDrain, err := start.Advance(mustNew(t, base[1:], 3)) // web-0 drains
	if err != nil {
		t.Fatal(err)
	}
	lost := func(c *Chain) int {
		n := 0
		for h := range drained {
			if cur, prev := c.Lookup(h); cur != "web-0" && prev != "web-0" {
				n++
			}
		}
		return n
	}
	if n := lost(afterDrain); n != 0 {
		t.Fatalf("the drain alone lost %d of web-0's %d flows", n, len(drained))
	}
	next := mustNew(t, base[2:], 3) // web-1 dies
	with, err := afterDrain.AdvanceWithout(next, "web-1")
	if err != nil {
		t.Fatal(err)
	}
	// Maglev moves a few slots between the instances that stay, too; a
	// flow of such a slot has now changed hands twice and is lost.
	kept := lost(with)
	t.Logf("AdvanceWithout lost %d of web-0's %d flows when web-1 died", kept, len(drained))
	if kept > len(drained)/200 {
		t.Errorf("AdvanceWithout lost %d of web-0's %d flows when web-1 died", kept, len(drained))
	}
	plain, err := afterDrain.Advance(next)
	if err != nil {
		t.Fatal(err)
	}
	n := lost(plain.Forget("web-1"))
	t.Logf("Advance then Forget would have lost %d of web-0's %d flows", n, len(drained))
	if n == 0 {
		t.Error("the case does not arise: no slot of web-0's passed to web-1 and on")
	}
	for h := range drained {
		if cur, prev := with.Lookup(h); cur == "web-1" || prev == "web-1" {
			t.Fatal("web-1 still gets packets after it died")
		}
	}
}

func TestChainAdvanceRefusesOtherSize(t *testing.T) {
	a, _ := New([]string{"a"}, 0, 101)
	b, _ := New([]string{"a"}, 0, 103)
	if _, err := NewChain(a).Advance(b); err == nil {
		t.Fatal("advanced to a table of another size")
	}
}

func BenchmarkNew(b *testing.B) {
	in := names(16)
	for b.Loop() {
		if _, err := New(in, 1, DefaultSize); err != nil {
			b.Fatal(err)
		}
	}
}

// FlowHash is part of the wire contract between boxes (and, later, the XDP
// program): fixed values, and every field of the tuple counts.
func TestFlowHash(t *testing.T) {
	src, dst := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.200.1")
	h := FlowHash(7, 6, src, dst, 40000, 80)
	if want := uint64(0xf2065846e269f643); h != want {
		t.Errorf("FlowHash = %#x, want %#x", h, want)
	}
	for name, other := range map[string]uint64{
		"seed":     FlowHash(8, 6, src, dst, 40000, 80),
		"protocol": FlowHash(7, 17, src, dst, 40000, 80),
		"source":   FlowHash(7, 6, netip.MustParseAddr("198.18.0.2"), dst, 40000, 80),
		"dest":     FlowHash(7, 6, src, netip.MustParseAddr("198.18.200.2"), 40000, 80),
		"sport":    FlowHash(7, 6, src, dst, 40001, 80),
		"dport":    FlowHash(7, 6, src, dst, 40000, 81),
	} {
		if other == h {
			t.Errorf("changing the %s does not change the hash", name)
		}
	}
	// Source ports of one client spread over a table's instances evenly.
	tab := mustNew(t, names(4), 1)
	counts := map[string]int{}
	for p := range 40000 {
		counts[tab.Owner(FlowHash(1, 6, src, dst, uint16(20000+p), 80))]++
	}
	for name, c := range counts {
		if c < 9000 || c > 11000 {
			t.Errorf("%s got %d of 40000 flows of one client", name, c)
		}
	}
}
