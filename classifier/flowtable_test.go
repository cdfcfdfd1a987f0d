package classifier

import (
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
)

func testFlow(i int) Flow {
	return Flow{ID: 7, Protocol: ProtoTCP, Stream: uint32(1 + i%5),
		Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), uint16(1000+i>>16)),
		Local:  netip.AddrPortFrom(netip.MustParseAddr("198.18.0.1"), uint16(10000+i%5000))}
}

// TestFlowDeltasEqualCompile: any sequence of adds and removes leaves the
// tables equal to a compile of the flows left, while readers look up
// concurrently and always find a flow that was never removed.
func TestFlowDeltasEqualCompile(t *testing.T) {
	tab, err := Compile(&RuleSet{Flows: []Flow{testFlow(100000)}})
	if err != nil {
		t.Fatal(err)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the permanent flow must never be missed, whatever the writers do
		defer wg.Done()
		k := testFlow(100000).Key()
		for !stop.Load() {
			if _, ok := tab.flows.lookup(&k); !ok {
				t.Error("a flow that was never removed was not found")
				return
			}
		}
	}()
	held := map[int]bool{}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		i := rng.IntN(20000)
		if held[i] {
			if !tab.RemoveFlow(testFlow(i)) {
				t.Fatalf("flow %d held but not removed", i)
			}
			delete(held, i)
		} else {
			if err := tab.AddFlow(testFlow(i)); err != nil {
				t.Fatal(err)
			}
			held[i] = true
		}
	}
	stop.Store(true)
	wg.Wait()
	set := RuleSet{Flows: []Flow{testFlow(100000)}}
	for i := range held {
		set.Flows = append(set.Flows, testFlow(i))
	}
	want, err := Compile(&set)
	if err != nil {
		t.Fatal(err)
	}
	got := map[FlowKey]Target{}
	for k, v := range tab.Flows() {
		got[k] = v
	}
	n := 0
	for k, v := range want.Flows() {
		n++
		if got[k] != v {
			t.Fatalf("flow %+v: %+v, want %+v", k, got[k], v)
		}
	}
	if len(got) != n || tab.NumFlows() != n {
		t.Fatalf("%d flows (NumFlows %d), want %d", len(got), tab.NumFlows(), n)
	}
	if tab.RemoveFlow(testFlow(123456)) {
		t.Fatal("removed a flow never added")
	}
	if err := tab.AddFlow(Flow{ID: 1, Protocol: ProtoTCP, Stream: 1}); err == nil {
		t.Fatal("a flow with no addresses was accepted")
	}
}

func TestFlowLookupDoesNotAllocate(t *testing.T) {
	tab, _ := Compile(&RuleSet{})
	for i := range 1000 {
		tab.AddFlow(testFlow(i))
	}
	k := testFlow(500).Key()
	if n := testing.AllocsPerRun(100, func() { tab.flows.lookup(&k) }); n != 0 {
		t.Fatalf("%v allocations per lookup", n)
	}
}
