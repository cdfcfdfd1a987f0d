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

// TestFlowDeltas: flows of both families added and removed one at a time
// leave the kernel's tables equal to the compiled tables of the flows left,
// and a whole Update afterwards changes nothing.
func TestFlowDeltas(t *testing.T) {
	testenv.RequirePrivileged(t)
	flow := func(i int) classifier.Flow {
		if i%2 == 1 {
			return deltaFlow6(i)
		}
		return deltaFlow(i)
	}
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
			err = p.RemoveFlows([]classifier.Flow{flow(i)})
			delete(held, i)
		} else {
			err = p.AddFlows([]classifier.Flow{flow(i)})
			held[i] = true
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	var set classifier.RuleSet
	for i := range held {
		set.Flows = append(set.Flows, flow(i))
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
	if err := p.RemoveFlows([]classifier.Flow{deltaFlow(100000), deltaFlow6(100001), flow(0), flow(1)}); err != nil {
		t.Fatalf("removing flows never added among installed ones: %v", err)
	}
	delete(held, 0)
	delete(held, 1)
	set.Flows = nil
	for i := range held {
		set.Flows = append(set.Flows, flow(i))
	}
	if want, err = classifier.Compile(&set); err != nil {
		t.Fatal(err)
	}
	check("after removing flows never added among installed ones")
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

// deltaFlow6 is deltaFlow over IPv6, which the program keeps in a table of
// its own.
func deltaFlow6(i int) classifier.Flow {
	f := deltaFlow(i)
	f.Remote = netip.AddrPortFrom(netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 5, 14: byte(i >> 8), 15: byte(i)}), f.Remote.Port())
	f.Local = netip.AddrPortFrom(netip.MustParseAddr("2001:db8::1"), f.Local.Port())
	return f
}

// TestFlowCapacityMemory: each family's flow table takes the capacity it
// is given, a flow beyond it is refused, and the memory the tables take up
// front (all of the IPv4 table, the IPv6 table's buckets) is about
// FlowEntryBytes a flow of capacity.
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
	for _, flow := range []func(int) classifier.Flow{deltaFlow, deltaFlow6} {
		for i := range 4 {
			if err := small.AddFlows([]classifier.Flow{flow(i)}); err != nil {
				t.Fatal(err)
			}
		}
		if err := small.AddFlows([]classifier.Flow{flow(4)}); err == nil {
			t.Fatalf("a fifth flow (%v) fitted a table of four", flow(4).Remote)
		}
	}
	if got, err := small.InstalledFlows(); err != nil || len(got) != 8 {
		t.Fatalf("%d flows installed (%v), want 8: four of each family", len(got), err)
	}
	per4, per6 := map[int]int{}, map[int]int{}
	for _, n := range []int{1 << 16, 1 << 20} {
		p, err := LoadWith(Options{FlowCapacity: n})
		if err != nil {
			t.Fatal(err)
		}
		per4[n], per6[n] = memlock(t, p.objs.Flows4.FD()), memlock(t, p.objs.Flows.FD())
		p.Close()
	}
	slope := func(per map[int]int) float64 { return float64(per[1<<20]-per[1<<16]) / float64(1<<20-1<<16) }
	bytes := slope(per4) + slope(per6)
	t.Logf("flow tables, IPv4 + IPv6: %d + %d bytes for 65,536 flows, %d + %d for 1,048,576: %.0f + %.0f bytes a flow",
		per4[1<<16], per6[1<<16], per4[1<<20], per6[1<<20], slope(per4), slope(per6))
	if bytes < FlowEntryBytes/2 || bytes > FlowEntryBytes*2 {
		t.Errorf("%.0f bytes a flow; FlowEntryBytes says %d", bytes, FlowEntryBytes)
	}
}
