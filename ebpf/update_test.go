package ebpf

import (
	"maps"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

// TestCounters checks the per-verdict and per-rule counters, summed over
// CPUs, against what the reference says each frame is.
func TestCounters(t *testing.T) {
	p := newPair(t)
	rng := rand.New(rand.NewPCG(3, 3))
	rs := framegen.RandomRuleSet(rng)
	if err := p.install(rs); err != nil {
		t.Fatal(err)
	}
	before, err := p.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	beforeRules, err := p.prog.RuleCounters()
	if err != nil {
		t.Fatal(err)
	}
	var want [classifier.NumVerdicts]Counter
	wantRules := map[uint32]Counter{}
	for _, spec := range framegen.AllSpecs(rng) {
		frame := spec.Build()
		m, err := p.compare(frame)
		if err != nil {
			t.Fatal(err)
		}
		meta := p.ref.Classify(frame) // a second look changes no state of the reference
		want[m].Packets++
		want[m].Bytes += uint64(len(frame))
		if meta.RuleID != 0 {
			c := wantRules[meta.RuleID]
			c.Packets++
			c.Bytes += uint64(len(frame))
			wantRules[meta.RuleID] = c
		}
	}
	after, err := p.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	for v := range want {
		got := Counter{after.Verdicts[v].Packets - before.Verdicts[v].Packets, after.Verdicts[v].Bytes - before.Verdicts[v].Bytes}
		if got != want[v] {
			t.Errorf("verdict %v: counted %+v, want %+v", classifier.Verdict(v), got, want[v])
		}
	}
	afterRules, err := p.prog.RuleCounters()
	if err != nil {
		t.Fatal(err)
	}
	for id, a := range afterRules {
		b := beforeRules[id]
		got := Counter{a.Packets - b.Packets, a.Bytes - b.Bytes}
		if got != wantRules[id] {
			t.Errorf("rule %d: counted %+v, want %+v", id, got, wantRules[id])
		}
		delete(wantRules, id)
	}
	for id, w := range wantRules {
		t.Errorf("rule %d: counted nothing, want %+v", id, w)
	}
	if len(afterRules) == 0 {
		t.Error("no rule counted anything; the test proves nothing")
	}
	one, err := p.prog.RuleCounter(rs.Rules[0].ID)
	if err != nil || one != afterRules[rs.Rules[0].ID] {
		t.Errorf("RuleCounter(%d) = %+v, %v; RuleCounters has %+v", rs.Rules[0].ID, one, err, afterRules[rs.Rules[0].ID])
	}
}

// TestUpdateHasNoWindow flips the program between two rule sets while frames
// run through it: every frame must get the result of one set or the other,
// never a mixture or a miss.
func TestUpdateHasNoWindow(t *testing.T) {
	p := newPair(t)
	var sets [2]*classifier.RuleSet
	var tables [2]*classifier.Tables
	for i := range sets {
		sets[i] = framegen.RandomRuleSet(rand.New(rand.NewPCG(uint64(100+i), 1)))
		var err error
		if tables[i], err = classifier.Compile(sets[i]); err != nil {
			t.Fatal(err)
		}
	}
	var frames [][]byte
	var want [][2]classifier.Meta
	differ := 0
	for _, spec := range framegen.AllSpecs(rand.New(rand.NewPCG(5, 5))) {
		if spec.Frag != 0 {
			continue // fragments carry state across updates by design
		}
		f := spec.Build()
		var w [2]classifier.Meta
		for i := range w {
			w[i] = classifier.New(tables[i], 0).Classify(f)
		}
		if w[0] != w[1] {
			differ++
		}
		frames = append(frames, f)
		want = append(want, w)
	}
	if differ == 0 {
		t.Fatal("the two rule sets classify every frame alike; the test proves nothing")
	}

	if err := p.prog.Update(tables[0]); err != nil {
		t.Fatal(err)
	}
	const flips = 100
	runs := flipWhileRunning(t, p, tables, frames, want, flips)
	t.Logf("%d frames during %d updates, %d frames differ between the sets", runs, flips, differ)
}

// flipWhileRunning updates the program flips times, to tables[1] and
// tables[0] in turn, while it runs frames through it: every frame must get
// what one of the tables gives it (want). It returns how many frames ran.
func flipWhileRunning(t *testing.T, p *pair, tables [2]*classifier.Tables, frames [][]byte, want [][2]classifier.Meta, flips int) int {
	t.Helper()
	var done atomic.Bool
	errc := make(chan error, 1)
	go func() {
		defer done.Store(true)
		for i := range flips {
			if err := p.prog.Update(tables[(i+1)%2]); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	runs := 0
	for !done.Load() || runs == 0 {
		for i, f := range frames {
			_, got, _, _, err := p.run(f)
			if err != nil {
				t.Fatal(err)
			}
			if got != want[i][0] && got != want[i][1] {
				t.Fatalf("frame %d classified %+v during an update; table A gives %+v, table B %+v", i, got, want[i][0], want[i][1])
			}
			runs++
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	return runs
}

// TestRuleCountersAcrossBatches puts known per-CPU counts at ids on both
// sides of readCounters' batch boundaries and at the last id, and wants
// exactly them back, summed over CPUs.
func TestRuleCountersAcrossBatches(t *testing.T) {
	p := newPair(t)
	ncpu := ebpf.MustPossibleCPU()
	want := map[uint32]Counter{}
	for i, id := range []uint32{0, 1, counterBatch - 1, counterBatch, 5*counterBatch + 7, classifier.MaxRuleID} {
		per := make([]bpfFbCounter, ncpu)
		var sum Counter
		for c := range per {
			per[c] = bpfFbCounter{Packets: uint64(i*100 + c + 1), Bytes: uint64(i*1000 + 10*c + 60)}
			sum.Packets += per[c].Packets
			sum.Bytes += per[c].Bytes
		}
		if err := p.prog.objs.RuleCounters.Put(id, per); err != nil {
			t.Fatal(err)
		}
		want[id] = sum
	}
	got, err := p.prog.RuleCounters()
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, want) {
		t.Errorf("RuleCounters() = %v, want %v", got, want)
	}
}

// BenchmarkRuleCounters is what one metrics scrape pays for the per-rule
// counters.
func BenchmarkRuleCounters(b *testing.B) {
	p := newPair(b)
	for b.Loop() {
		if _, err := p.prog.RuleCounters(); err != nil {
			b.Fatal(err)
		}
	}
}
