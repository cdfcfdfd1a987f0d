package nft

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"sync"
	"syscall"
	"testing"

	vnetns "github.com/vishvananda/netns"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func deltaFlow(i int) classifier.Flow {
	local, remote := netip.MustParseAddr("198.18.0.1"), netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)})
	if i%4 == 0 {
		local, remote = netip.MustParseAddr("2001:db8::1"), netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 1, 14: byte(i >> 8), 15: byte(i)})
	}
	return classifier.Flow{ID: 9, Protocol: classifier.ProtoTCP, Stream: 1,
		Remote: netip.AddrPortFrom(remote, 443), Local: netip.AddrPortFrom(local, uint16(10000+i))}
}

// openTable opens a table on a fresh veth in a test namespace.
func openTable(t *testing.T, tab *classifier.Tables) *Table {
	testenv.RequirePrivileged(t)
	br, _, v := topology.Pair(t, topology.VethOptions{})
	var h vnetns.NsHandle
	if err := br.Do(func() (err error) { h, err = vnetns.Get(); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	hide, err := Open(h, v.A.Name, tab)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hide.Close() })
	return hide
}

// TestFlowDeltas: flows added and removed one at a time, from several
// goroutines at once (their transactions grouped), leave the kernel's sets
// equal to those of the compiled tables of the flows left; a whole Update
// afterwards finds nothing to change.
func TestFlowDeltas(t *testing.T) {
	base, _ := classifier.Compile(&classifier.RuleSet{Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoUDP, Port: 53, Stream: 2}}})
	hide := openTable(t, base)
	held := make([]map[int]bool, 8)
	var wg sync.WaitGroup
	for g := range held {
		held[g] = map[int]bool{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 5))
			for range 60 {
				i := g*1000 + rng.IntN(20)
				var err error
				if held[g][i] {
					err = hide.RemoveFlows([]classifier.Flow{deltaFlow(i)})
					delete(held[g], i)
				} else {
					err = hide.AddFlows([]classifier.Flow{deltaFlow(i)})
					held[g][i] = true
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	set := classifier.RuleSet{Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoUDP, Port: 53, Stream: 2}}}
	for _, h := range held {
		for i := range h {
			set.Flows = append(set.Flows, deltaFlow(i))
		}
	}
	want, err := classifier.Compile(&set)
	if err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		got, err := hide.Installed()
		if err != nil {
			t.Fatal(err)
		}
		if w := Elements(want); !reflect.DeepEqual(got, w) {
			t.Fatalf("%s: the kernel's sets\n%v\nwant\n%v", when, got, w)
		}
	}
	check("after deltas")
	if err := hide.Update(want); err != nil {
		t.Fatal(err)
	}
	check("after a whole update")
	if err := hide.RemoveFlows([]classifier.Flow{deltaFlow(99999)}); err != nil {
		t.Fatalf("removing a flow never added: %v", err)
	}
}

// TestFlowElementErrors: a change the kernel refuses comes back as its
// errno, and the runner goes on: a flow element of a table that does not
// exist, the delete of one the set lacks.
func TestFlowElementErrors(t *testing.T) {
	base, _ := classifier.Compile(&classifier.RuleSet{})
	hide := openTable(t, base)
	k := deltaFlow(1).Key()
	if err := <-hide.run.submitElems("fabricbridge_nosuch", elemChange{flows: []classifier.FlowKey{k}, add: true}); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("adding to a table that does not exist: %v, want ENOENT", err)
	}
	if err := <-hide.run.submitElems(hide.table, elemChange{flows: []classifier.FlowKey{k}}); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("deleting an element the set lacks: %v, want ENOENT", err)
	}
	if err := hide.AddFlows([]classifier.Flow{deltaFlow(2), deltaFlow(4)}); err != nil {
		t.Fatal(err)
	}
	want, _ := classifier.Compile(&classifier.RuleSet{Flows: []classifier.Flow{deltaFlow(2), deltaFlow(4)}})
	if got, err := hide.Installed(); err != nil || !reflect.DeepEqual(got, Elements(want)) {
		t.Fatalf("after the refusals and an add: %v %v, want %v", got, err, Elements(want))
	}
}
