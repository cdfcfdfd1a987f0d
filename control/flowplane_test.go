package control

import (
	"errors"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// flowRecorder is a recorder that also takes deltas, and keeps flows and
// ownership as the deltas leave them.
type flowRecorder struct {
	*recorder
	flows map[classifier.FlowKey]classifier.Target
	ports map[uint32]map[classifier.PortClaim]bool
}

func newFlowRecorder() *flowRecorder {
	return &flowRecorder{recorder: newRecorder(), flows: map[classifier.FlowKey]classifier.Target{}, ports: map[uint32]map[classifier.PortClaim]bool{}}
}

func (f *flowRecorder) own(id uint32, own classifier.Ownership) {
	f.ports[id] = map[classifier.PortClaim]bool{}
	for _, p := range own.Ports {
		f.ports[id][p] = true
	}
}

func (f *flowRecorder) AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.own(id, own)
	return nil
}

func (f *flowRecorder) SetOwnership(id uint32, own classifier.Ownership) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.own(id, own)
	return nil
}

func (f *flowRecorder) RemoveStream(id uint32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.ports, id)
	return nil
}

func (f *flowRecorder) SetTables(t *classifier.Tables) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tables = t
	f.flows = maps.Collect(t.Flows())
	return nil
}

func (f *flowRecorder) AddFlows(flows []classifier.Flow) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, fl := range flows {
		f.flows[fl.Key()] = classifier.Target{Stream: fl.Stream, Rule: fl.ID}
	}
	return nil
}

func (f *flowRecorder) RemoveFlows(flows []classifier.Flow) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, fl := range flows {
		delete(f.flows, fl.Key())
	}
	return nil
}

func (f *flowRecorder) OwnPort(id uint32, p classifier.PortClaim, own bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ports[id] == nil {
		return errors.New("no such stream")
	}
	if own {
		f.ports[id][p] = true
	} else {
		delete(f.ports[id], p)
	}
	return nil
}

// TestDeltasKeepOwnershipAndFlows: after random claims, releases, exits and
// reloads, the flows the deltas left equal a compile's, and each stream's
// ownership, changed a port at a time, equals the one the registry would
// compute whole.
func TestDeltasKeepOwnershipAndFlows(t *testing.T) {
	dp := newFlowRecorder()
	web := AppStatic{Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoTCP, Port: 80}}}
	r, err := newRegistry(dp, classifier.PortRange{Lo: 20000, Hi: 20015}, 100, Static{Apps: map[string]AppStatic{"app1": web}}, SpreadConfig{}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if r.flowDP == nil {
		t.Fatal("the registry does not use the deltas")
	}
	pol := Policy{Addrs: []netip.Addr{benchLocal}, MaxFlows: 1000}
	register := func(name string) *app {
		a, err := r.register(name, "", name, pol, 0, func(id uint32, own classifier.Ownership) error { return dp.AddStream(id, nil, own) })
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	apps := []*app{register("app0"), register("app1"), register("app2")}
	rng := rand.New(rand.NewPCG(7, 7))
	held := map[*app][]uint64{}
	for n := range 3000 {
		a := apps[rng.IntN(len(apps))]
		switch k := rng.IntN(20); {
		case k < 11:
			// TCP to few remotes, so that ports are shared and run out.
			if c, err := r.connect(a, classifier.ProtoTCP, benchLocal, benchRemote(rng.IntN(8))); err == nil {
				held[a] = append(held[a], c.id)
			} else if !errors.Is(err, ErrNoPorts) {
				t.Fatal(err)
			}
		case k < 12:
			if c, err := r.listen(a, classifier.ProtoTCP, netip.Addr{}, uint16(1000+rng.IntN(4))); err == nil {
				held[a] = append(held[a], c.id)
			}
		case k < 18 && len(held[a]) > 0:
			j := rng.IntN(len(held[a]))
			if err := r.release(a, held[a][j]); err != nil {
				t.Fatal(err)
			}
			held[a] = slices.Delete(held[a], j, j+1)
		case k < 19:
			if err := r.unregister(a); err != nil {
				t.Fatal(err)
			}
			delete(held, a)
			i := slices.Index(apps, a)
			apps[i] = register(a.name)
		default:
			st := Static{}
			if n%2 == 0 {
				st.Apps = map[string]AppStatic{"app1": web}
			}
			if err := r.setStatic(st); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("%d flows, %d applications at the end", len(dp.flows), len(apps))
	want, err := r.compile()
	if err != nil {
		t.Fatal(err)
	}
	if w := maps.Collect(want.Flows()); !reflect.DeepEqual(dp.flows, w) {
		t.Fatalf("the deltas left %d flows, a compile has %d (or they differ)", len(dp.flows), len(w))
	}
	for _, a := range apps {
		w := map[classifier.PortClaim]bool{}
		for _, p := range a.ownership().Ports {
			w[p] = true
		}
		if !reflect.DeepEqual(dp.ports[a.stream], w) {
			t.Fatalf("%s: the stream owns %v, want %v", a.name, dp.ports[a.stream], w)
		}
	}
}

// TestPortsShareWithinAnApplicationOnly: when the range runs out, an
// application's new flows share its own ports towards other remotes, never
// another application's, and never twice to one remote.
func TestPortsShareWithinAnApplicationOnly(t *testing.T) {
	dp := newFlowRecorder()
	r, err := newRegistry(dp, classifier.PortRange{Lo: 20000, Hi: 20003}, 100, Static{}, SpreadConfig{}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Addrs: []netip.Addr{benchLocal}, MaxFlows: 1000}
	reg := func(name string) *app {
		a, err := r.register(name, "", name, pol, 0, func(id uint32, own classifier.Ownership) error { return dp.AddStream(id, nil, own) })
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	a, b := reg("a"), reg("b")
	remote := benchRemote(1)
	for i := range 4 {
		if _, err := r.connect(a, classifier.ProtoTCP, benchLocal, remote); err != nil {
			t.Fatalf("flow %d to one remote: %v", i, err)
		}
	}
	if _, err := r.connect(a, classifier.ProtoTCP, benchLocal, remote); !errors.Is(err, ErrNoPorts) {
		t.Fatalf("a fifth flow to the same remote over four ports: %v, want %v", err, ErrNoPorts)
	}
	ports := map[uint16]int{}
	for i := range 8 {
		c, err := r.connect(a, classifier.ProtoTCP, benchLocal, benchRemote(100+i))
		if err != nil {
			t.Fatalf("flow %d to another remote: %v", i, err)
		}
		ports[c.port]++
	}
	if len(ports) != 4 {
		t.Fatalf("shared flows used ports %v, want the four of the range", ports)
	}
	if _, err := r.connect(b, classifier.ProtoTCP, benchLocal, benchRemote(200)); !errors.Is(err, ErrNoPorts) {
		t.Fatalf("another application got a port of a full range: %v", err)
	}
	if c, err := r.connect(b, classifier.ProtoUDP, benchLocal, benchRemote(200)); err != nil || c.port < 20000 || c.port > 20003 {
		t.Fatalf("UDP has its own ports: %v, %v", c, err)
	}
	if len(dp.flows) != 13 {
		t.Fatalf("%d flows installed, want 13", len(dp.flows))
	}
}

// TestReusedPortStaysOwned: one application's connects and releases race
// on a small range, so a port one goroutine releases is at once the one
// another takes (the pool hands out the lowest free port). A port must be
// owned by the stream from the moment connect returns until release is
// called, whatever order the two reach the data plane in.
func TestReusedPortStaysOwned(t *testing.T) {
	dp := newFlowRecorder()
	r, err := newRegistry(dp, classifier.PortRange{Lo: 20000, Hi: 20003}, 100, Static{}, SpreadConfig{}, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Addrs: []netip.Addr{benchLocal}, MaxFlows: 1000, MaxPorts: 4}
	a, err := r.register("app", "", "app", pol, 0, func(id uint32, own classifier.Ownership) error { return dp.AddStream(id, nil, own) })
	if err != nil {
		t.Fatal(err)
	}
	owned := func(port uint16) bool {
		dp.mu.Lock()
		defer dp.mu.Unlock()
		return dp.ports[a.stream][classifier.PortClaim{Proto: classifier.ProtoUDP, Port: port}]
	}
	var wg sync.WaitGroup
	var lost atomic.Int64
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				c, err := r.connect(a, classifier.ProtoUDP, benchLocal, benchRemote(g*10000+i))
				if errors.Is(err, ErrNoPorts) {
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				runtime.Gosched()
				if !owned(c.port) {
					lost.Add(1)
				}
				if err := r.release(a, c.id); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := lost.Load(); n != 0 {
		t.Errorf("%d times a port held by a live claim was not owned by the stream", n)
	}
	if n := len(dp.ports[a.stream]); n != 0 {
		t.Errorf("%d ports still owned after every claim was released", n)
	}
}
