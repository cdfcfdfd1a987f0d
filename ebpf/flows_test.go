package ebpf

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

func deltaFlow(i int) classifier.Flow {
	return classifier.Flow{ID: uint32(1 + i%3), Protocol: classifier.ProtoUDP, Stream: uint32(1 + i%7),
		Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), 53),
		Local:  netip.AddrPortFrom(netip.MustParseAddr("198.18.0.1"), uint16(10000+i))}
}

// TestFlowDeltas: flows added and removed one at a time leave the kernel's
// table equal to the compiled tables of the flows left, and a whole Update
// afterwards changes nothing.
func TestFlowDeltas(t *testing.T) {
	testenv.RequirePrivileged(t)
	p, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	held := map[int]bool{}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 3000 {
		i := rng.IntN(500)
		if held[i] {
			err = p.RemoveFlows([]classifier.Flow{deltaFlow(i)})
			delete(held, i)
		} else {
			err = p.AddFlows([]classifier.Flow{deltaFlow(i)})
			held[i] = true
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	var set classifier.RuleSet
	for i := range held {
		set.Flows = append(set.Flows, deltaFlow(i))
	}
	want, err := classifier.Compile(&set)
	if err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		got, err := p.InstalledFlows()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for k, v := range want.Flows() {
			n++
			if got[k] != v {
				t.Fatalf("%s: flow %+v: %+v, want %+v", when, k, got[k], v)
			}
		}
		if len(got) != n {
			t.Fatalf("%s: %d flows in the kernel, want %d", when, len(got), n)
		}
	}
	check("after deltas")
	if err := p.Update(want); err != nil {
		t.Fatal(err)
	}
	check("after a whole update")
	if err := p.RemoveFlows([]classifier.Flow{deltaFlow(100000)}); err != nil {
		t.Fatalf("removing a flow never added: %v", err)
	}
}

// memlock is what the kernel charges for map fd (its fdinfo's memlock).
func memlock(t *testing.T, fd int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "memlock:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no memlock in fdinfo")
	return 0
}

// TestFlowCapacityMemory: the flow table takes the capacity it is given,
// a flow beyond it is refused, and its memory is about FlowEntryBytes a
// flow.
func TestFlowCapacityMemory(t *testing.T) {
	testenv.RequirePrivileged(t)
	small, err := LoadWith(Options{FlowCapacity: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	if small.FlowCapacity() != 4 {
		t.Fatalf("capacity %d, want 4", small.FlowCapacity())
	}
	for i := range 4 {
		if err := small.AddFlows([]classifier.Flow{deltaFlow(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := small.AddFlows([]classifier.Flow{deltaFlow(4)}); err == nil {
		t.Fatal("a fifth flow fitted a table of four")
	}
	per := map[int]int{}
	for _, n := range []int{1 << 16, 1 << 20} {
		p, err := LoadWith(Options{FlowCapacity: n})
		if err != nil {
			t.Fatal(err)
		}
		per[n] = memlock(t, p.objs.Flows.FD())
		p.Close()
	}
	bytes := float64(per[1<<20]-per[1<<16]) / float64(1<<20-1<<16)
	t.Logf("flow table: %d bytes for 65,536 flows, %d for 1,048,576: %.0f bytes a flow", per[1<<16], per[1<<20], bytes)
	if bytes < FlowEntryBytes/2 || bytes > FlowEntryBytes*2 {
		t.Errorf("%.0f bytes a flow; FlowEntryBytes says %d", bytes, FlowEntryBytes)
	}
}
