package portslice

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func instances(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("web-%d", i)
	}
	return out
}

// The reserved range of the default configuration, 61000-61999, in blocks
// of 8 ports: 125 blocks.
func assign(t *testing.T, names []string) *Assignment {
	t.Helper()
	a, err := Assign(names, 3, 61000, 61999, 8)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestSameOnEveryBox(t *testing.T) {
	names := instances(6)
	ref := assign(t, names)
	shuffled := slices.Clone(names)
	rand.New(rand.NewPCG(1, 1)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	if got := assign(t, shuffled); !slices.Equal(got.owner, ref.owner) {
		t.Fatal("another order of the same instances gave another assignment")
	}
}

func TestEveryPortHasOneOwner(t *testing.T) {
	a := assign(t, instances(5))
	total := 0
	for _, name := range instances(5) {
		bs := a.Blocks(name)
		if len(bs) == 0 {
			t.Errorf("%s has no block", name)
		}
		for _, b := range bs {
			total += int(b.Hi) - int(b.Lo) + 1
			if a.Owner(b.Lo) != name || a.Owner(b.Hi) != name {
				t.Errorf("block %v of %s is owned by %s", b, name, a.Owner(b.Lo))
			}
		}
	}
	if total != 1000 {
		t.Errorf("the blocks cover %d ports of 1000", total)
	}
	if a.Owner(60999) != "" || a.Owner(62000) != "" {
		t.Error("a port outside the range has an owner")
	}
	// Balance: 125 blocks over 5 instances, 25 each ideally.
	for _, name := range instances(5) {
		if n := len(a.Blocks(name)); n < 12 || n > 40 {
			t.Errorf("%s has %d blocks of 125", name, n)
		}
	}
}

// A join moves only blocks to the newcomer, a leave only the leaver's.
func TestMinimalMovement(t *testing.T) {
	base := instances(5)
	before := assign(t, base)
	joined := assign(t, append(slices.Clone(base), "web-new"))
	for b, old := range Moved(before, joined) {
		if joined.Owner(b.Lo) != "web-new" {
			t.Errorf("block %v moved from %s to %s on a join", b, old, joined.Owner(b.Lo))
		}
	}
	if n := len(Moved(before, joined)); n == 0 || n > 2*125/6 {
		t.Errorf("a join moved %d of 125 blocks, ideal about %d", n, 125/6)
	}
	left := assign(t, base[1:])
	for b, old := range Moved(before, left) {
		if old != base[0] {
			t.Errorf("block %v of %s moved when %s left", b, old, base[0])
		}
	}
	if got, want := len(Moved(before, left)), len(before.Blocks(base[0])); got != want {
		t.Errorf("a leave moved %d blocks, the leaver had %d", got, want)
	}
}

func TestAssignRefuses(t *testing.T) {
	for _, c := range []struct {
		names     []string
		lo, hi    uint16
		blockSize int
	}{
		{instances(2), 100, 99, 8},
		{instances(2), 0, 99, 8},
		{instances(2), 61000, 61999, 0},
		{[]string{"a", "a"}, 61000, 61999, 8},
		{instances(200), 61000, 61999, 8}, // 125 blocks
	} {
		if _, err := Assign(c.names, 0, c.lo, c.hi, c.blockSize); err == nil {
			t.Errorf("Assign(%d instances, %d-%d, %d) accepted", len(c.names), c.lo, c.hi, c.blockSize)
		}
	}
}
