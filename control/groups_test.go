package control

import (
	"errors"
	"io"
	"log/slog"
	"math"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
	"github.com/fabricbridge/fabricbridge/classifier/portslice"
)

// groupRange is the reserved range of the group tests: 13 blocks of 8
// ports, the last one of 4.
var groupRange = classifier.PortRange{Lo: 40000, Hi: 40099}

func newGroupRegistry(t *testing.T, dp Dataplane, deadline time.Duration) *registry {
	t.Helper()
	r, err := newRegistry(dp, groupRange, 100, Static{}, SpreadConfig{DrainDeadline: deadline, Settle: -1},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.stopDrains)
	return r
}

// instance registers instance of app with r.
func instance(t *testing.T, r *registry, app, instance string) *app {
	t.Helper()
	pol := Policy{Addrs: []netip.Addr{boxA}, MaxFlows: 1000, MaxPorts: 1000}
	a, err := r.register(app, instance, app, pol, 0, func(id uint32, own classifier.Ownership) error {
		return r.dp.AddStream(id, nil, own)
	})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func listen80(t *testing.T, r *registry, a *app) *claim {
	t.Helper()
	c, err := r.listen(a, classifier.ProtoTCP, netip.Addr{}, 80)
	if err != nil {
		t.Fatalf("%s/%s: %v", a.name, a.instance, err)
	}
	return c
}

// listenerOn is the listener the registry would install for port.
func listenerOn(t *testing.T, r *registry, port uint16) *classifier.Listener {
	t.Helper()
	r.mu.Lock()
	set := r.ruleSet()
	r.mu.Unlock()
	var found *classifier.Listener
	for i, l := range set.Listeners {
		if l.Port == port {
			if found != nil {
				t.Fatalf("two listeners on port %d", port)
			}
			found = &set.Listeners[i]
		}
	}
	return found
}

func spreadOn(t *testing.T, r *registry, port uint16) []classifier.Slot {
	t.Helper()
	l := listenerOn(t, r, port)
	if l == nil || l.Spread == nil {
		t.Fatalf("port %d: listener %+v has no Spread", port, l)
	}
	if l.Spread.Seed != DefaultSpreadSeed || len(l.Spread.Slots) != maglev.DefaultSize {
		t.Fatalf("port %d: seed %#x and %d slots, want %#x and %d", port, l.Spread.Seed, len(l.Spread.Slots), DefaultSpreadSeed, maglev.DefaultSize)
	}
	return l.Spread.Slots
}

// streamsIn says which streams are some slot's Current and which some
// slot's Previous.
func streamsIn(slots []classifier.Slot) (current, previous map[uint32]int) {
	current, previous = map[uint32]int{}, map[uint32]int{}
	for _, s := range slots {
		current[s.Current]++
		if s.Previous != 0 {
			previous[s.Previous]++
		}
	}
	return current, previous
}

// TestInstancesShareAListener: a second instance that listens on the same
// port joins the first one's listener instead of being refused, and the
// listener's Spread sends each about half the slots; the slots it took
// remember the first as previous owner. A registry that does not group
// fails here (port_in_use, or no Spread).
func TestInstancesShareAListener(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	a, b := instance(t, r, "web", "a"), instance(t, r, "web", "b")
	listen80(t, r, a)
	if l := listenerOn(t, r, 80); l == nil || l.Spread != nil || l.Stream != a.stream {
		t.Fatalf("one instance: listener %+v, want a plain one to stream %d", l, a.stream)
	}
	listen80(t, r, b)
	slots := spreadOn(t, r, 80)
	current, _ := streamsIn(slots)
	if len(current) != 2 {
		t.Fatalf("current owners %v, want streams %d and %d", current, a.stream, b.stream)
	}
	for _, s := range []uint32{a.stream, b.stream} {
		if share := float64(current[s]) / float64(len(slots)); math.Abs(share-0.5) > 0.02 {
			t.Errorf("stream %d owns %.3f of the slots, want 0.5 ± 0.02", s, share)
		}
	}
	for i, s := range slots {
		want := uint32(0)
		if s.Current == b.stream {
			want = a.stream // b took the slot from a, which may hold its connections
		}
		if s.Previous != want {
			t.Fatalf("slot %d: %+v, want previous %d", i, s, want)
		}
	}
	groups := r.groupsInfo()
	if len(groups) != 1 || !slices.Equal(groups[0].Instances, []string{"a", "b"}) || len(groups[0].Draining) != 0 ||
		groups[0].Digest != spreadDigest(DefaultSpreadSeed, []string{"a", "b"}) {
		t.Errorf("groups %+v", groups)
	}
}

// TestJoinKeepsEstablishedConnections: a third instance takes about a
// third of the slots; each slot that changes hands remembers its owner
// before (Maglev also moves a few slots between the old instances), and
// every other slot is as it was.
func TestJoinKeepsEstablishedConnections(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	a, b, c := instance(t, r, "web", "a"), instance(t, r, "web", "b"), instance(t, r, "web", "c")
	listen80(t, r, a)
	listen80(t, r, b)
	before := spreadOn(t, r, 80)
	listen80(t, r, c)
	after := spreadOn(t, r, 80)
	moved := 0
	for i := range after {
		switch {
		case after[i].Current != before[i].Current:
			if after[i].Current == c.stream {
				moved++
			}
			if after[i].Previous != before[i].Current {
				t.Fatalf("slot %d moved from %+v to %+v: want it to remember %d", i, before[i], after[i], before[i].Current)
			}
		case after[i] != before[i]:
			t.Fatalf("slot %d kept its owner but changed from %+v to %+v", i, before[i], after[i])
		}
	}
	if share := float64(moved) / float64(len(after)); math.Abs(share-1.0/3) > 0.02 {
		t.Errorf("c took %.3f of the slots, want about 1/3", share)
	}
}

// TestBoxesBuildTheSameSpread: two registries (two boxes) that see the
// same instances join in the same order build the same Spread slot for
// slot, previous owners included; in another order, the same current
// owners (previous owners follow each box's history).
func TestBoxesBuildTheSameSpread(t *testing.T) {
	build := func(order []string) ([]classifier.Slot, map[uint32]string) {
		r := newGroupRegistry(t, newRecorder(), time.Minute)
		names := map[uint32]string{0: ""}
		for _, name := range order {
			a := instance(t, r, "web", name)
			names[a.stream] = name
			listen80(t, r, a)
		}
		return spreadOn(t, r, 80), names
	}
	x, _ := build([]string{"web-1", "web-2", "web-3"})
	y, _ := build([]string{"web-1", "web-2", "web-3"})
	if !slices.Equal(x, y) {
		t.Fatal("two boxes fed the same instances in the same order built different Spreads")
	}
	p, pn := build([]string{"web-1", "web-2", "web-3"})
	q, qn := build([]string{"web-3", "web-1", "web-2"})
	for i := range p {
		if pn[p[i].Current] != qn[q[i].Current] {
			t.Fatalf("slot %d: current owner %q on one box, %q on the other", i, pn[p[i].Current], qn[q[i].Current])
		}
	}
}

// TestLeaseEndForgetsTheInstance: an instance whose lease ends owns no
// slot, and no slot keeps it as previous owner: its connections are gone.
func TestLeaseEndForgetsTheInstance(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	a, b, c := instance(t, r, "web", "a"), instance(t, r, "web", "b"), instance(t, r, "web", "c")
	for _, x := range []*app{a, b, c} {
		listen80(t, r, x)
	}
	if _, previous := streamsIn(spreadOn(t, r, 80)); previous[b.stream] == 0 {
		t.Fatal("b is nobody's previous owner before it goes: the test proves nothing")
	}
	if err := r.unregister(b); err != nil {
		t.Fatal(err)
	}
	current, previous := streamsIn(spreadOn(t, r, 80))
	if current[b.stream] != 0 || previous[b.stream] != 0 {
		t.Errorf("b's stream still owns %d slots and is previous owner of %d", current[b.stream], previous[b.stream])
	}
	if current[a.stream] == 0 || current[c.stream] == 0 {
		t.Errorf("current owners %v, want a and c", current)
	}
	if err := r.unregister(a); err != nil {
		t.Fatal(err)
	}
	if err := r.unregister(c); err != nil {
		t.Fatal(err)
	}
	if l := listenerOn(t, r, 80); l != nil || len(r.groupsInfo()) != 0 {
		t.Errorf("every instance gone, yet listener %+v and groups %+v", l, r.groupsInfo())
	}
}

// TestDrainKeepsEstablishedUntilTheDeadline: a draining instance owns no
// slot but stays previous owner, holding its claim, until the deadline;
// then it is forgotten and gives the listener up.
func TestDrainKeepsEstablishedUntilTheDeadline(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	a, b := instance(t, r, "web", "a"), instance(t, r, "web", "b")
	listen80(t, r, a)
	listen80(t, r, b)
	if err := r.drain(b); err != nil {
		t.Fatal(err)
	}
	current, previous := streamsIn(spreadOn(t, r, 80))
	if current[b.stream] != 0 || previous[b.stream] == 0 || current[a.stream] != maglev.DefaultSize {
		t.Fatalf("draining b: owners %v, previous %v; want a everywhere and b as previous owner", current, previous)
	}
	if g := r.groupsInfo(); len(g) != 1 || !slices.Equal(g[0].Instances, []string{"a"}) || !slices.Equal(g[0].Draining, []string{"b"}) {
		t.Errorf("groups %+v", g)
	}
	if b.listeners != 1 || b.portRefs[classifier.PortClaim{Proto: classifier.ProtoTCP, Port: 80}] == 0 {
		t.Error("a draining instance lost its claim on the port")
	}
	if _, err := r.listen(b, classifier.ProtoTCP, netip.Addr{}, 81); !errors.Is(err, ErrNotPermitted) {
		t.Errorf("a draining instance listens anew: %v", err)
	}
	r.expireDrains(r.now().Add(30 * time.Second)) // before the deadline: nothing happens
	if _, previous := streamsIn(spreadOn(t, r, 80)); previous[b.stream] == 0 {
		t.Fatal("forgotten before its deadline")
	}
	r.expireDrains(r.now().Add(2 * time.Minute))
	if l := listenerOn(t, r, 80); l == nil || l.Spread != nil || l.Stream != a.stream {
		t.Errorf("after b's deadline: listener %+v, want a plain one to a", l)
	}
	if b.listeners != 0 {
		t.Errorf("b holds %d listeners after its drain ended", b.listeners)
	}
	if s := r.drains; s != (DrainStats{Started: 1, Expired: 1}) {
		t.Errorf("drain counts %+v", s)
	}
}

// TestDrainDeadlineTimer: the deadline ends a drain without anybody asking.
func TestDrainDeadlineTimer(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), 50*time.Millisecond)
	a, b := instance(t, r, "web", "a"), instance(t, r, "web", "b")
	listen80(t, r, a)
	listen80(t, r, b)
	if err := r.drain(a); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		g := r.groupsInfo()
		if len(g) == 1 && len(g[0].Draining) == 0 && slices.Equal(g[0].Instances, []string{"b"}) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("5 s after a 50 ms deadline: groups %+v", g)
		}
	}
}

// TestReleaseDrainsOneListener: an instance that releases a shared
// listener drains from that listener only; the last instance taking new
// connections releases at once.
func TestReleaseDrainsOneListener(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	a, b := instance(t, r, "web", "a"), instance(t, r, "web", "b")
	var c80 *claim
	for _, x := range []*app{a, b} {
		c := listen80(t, r, x)
		if x == b {
			c80 = c
		}
		if _, err := r.listen(x, classifier.ProtoTCP, netip.Addr{}, 81); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.release(b, c80.id); err != nil {
		t.Fatal(err)
	}
	for _, g := range r.groupsInfo() {
		want := []string(nil)
		if g.Port == 80 {
			want = []string{"b"}
		}
		if !slices.Equal(g.Draining, want) {
			t.Errorf("port %d: draining %v, want %v", g.Port, g.Draining, want)
		}
	}
	if err := r.release(b, c80.id); !errors.Is(err, ErrUnknownClaim) {
		t.Errorf("releasing a draining claim again: %v", err)
	}
	if _, previous := streamsIn(spreadOn(t, r, 80)); previous[b.stream] == 0 {
		t.Error("released, b is no previous owner: its connections would be reset")
	}
	solo := instance(t, r, "solo", "x")
	c, err := r.listen(solo, classifier.ProtoTCP, netip.Addr{}, 82)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.release(solo, c.id); err != nil {
		t.Fatal(err)
	}
	if l := listenerOn(t, r, 82); l != nil || solo.listeners != 0 {
		t.Errorf("a sole instance released its listener, yet %+v stays", l)
	}
}

// TestOnlyInstancesShare: another application, the same application
// without an instance name, or an instance on another address of the
// port, is refused as before; an instance name is one instance's only.
func TestOnlyInstancesShare(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	a := instance(t, r, "web", "a")
	listen80(t, r, a)
	for _, x := range []struct {
		app, instance string
		addr          netip.Addr
	}{{"api", "a", netip.Addr{}}, {"web", "", netip.Addr{}}, {"web", "b", boxA}} {
		other := instance(t, r, x.app, x.instance)
		if _, err := r.listen(other, classifier.ProtoTCP, x.addr, 80); !errors.Is(err, ErrPortInUse) {
			t.Errorf("%s/%q on %v: %v, want ErrPortInUse", x.app, x.instance, x.addr, err)
		}
	}
	exclusive := instance(t, r, "svc", "")
	if _, err := r.listen(exclusive, classifier.ProtoTCP, netip.Addr{}, 90); err != nil {
		t.Fatal(err)
	}
	if _, err := r.listen(instance(t, r, "svc", "b"), classifier.ProtoTCP, netip.Addr{}, 90); !errors.Is(err, ErrPortInUse) {
		t.Errorf("an instance joined an exclusive listener: %v", err)
	}
	pol := Policy{Addrs: []netip.Addr{boxA}}
	if _, err := r.register("web", "a", "web", pol, 0, func(uint32, classifier.Ownership) error { return nil }); !errors.Is(err, ErrNameTaken) {
		t.Errorf("a second instance named a: %v, want ErrNameTaken", err)
	}
}

// sliceOwners is the assignment the registry must have made for these
// instances (names "app/instance").
func sliceOwners(t *testing.T, names ...string) *portslice.Assignment {
	t.Helper()
	s, err := portslice.Assign(names, DefaultSpreadSeed, groupRange.Lo, groupRange.Hi, minBlockPorts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// blockRulesIn maps each block rule of the installed tables (by its first
// port) to its stream.
func blockRulesIn(t *testing.T, tables *classifier.Tables) map[uint16]uint32 {
	t.Helper()
	out := map[uint16]uint32{}
	for _, rule := range tables.Rules() {
		if rule.Action == classifier.ActionSteer && rule.Proto == 0 && groupRange.Contains(rule.DstPorts.Lo) {
			if (rule.DstPorts.Lo-groupRange.Lo)%minBlockPorts != 0 || rule.DstPorts.Hi != min(rule.DstPorts.Lo+minBlockPorts-1, groupRange.Hi) {
				t.Fatalf("rule %+v is no block", rule)
			}
			out[rule.DstPorts.Lo] = rule.Stream
		}
	}
	return out
}

// TestInstancesConnectFromTheirBlocks: an instance's connections come from
// its own blocks of the reserved range, and every block is steered to its
// instance in the installed tables.
func TestInstancesConnectFromTheirBlocks(t *testing.T) {
	dp := newRecorder()
	r := newGroupRegistry(t, dp, time.Minute)
	// Another application's instance takes blocks of the same range: a
	// block rule steers by port alone, so no two instances may share one.
	a, b, other := instance(t, r, "web", "a"), instance(t, r, "web", "b"), instance(t, r, "api", "a")
	owners := sliceOwners(t, "web/a", "web/b", "api/a")
	for i := range 20 {
		for _, x := range []*app{a, b, other} {
			c, err := r.connect(x, classifier.ProtoTCP, boxA, benchRemote(i))
			if err != nil {
				t.Fatal(err)
			}
			if got := owners.Owner(c.port); got != instanceKey(x) {
				t.Fatalf("%s connects from port %d, a port of %s's block", instanceKey(x), c.port, got)
			}
		}
	}
	rules := blockRulesIn(t, dp.current())
	if len(rules) != 13 {
		t.Fatalf("%d block rules, want 13", len(rules))
	}
	streams := map[string]uint32{"web/a": a.stream, "web/b": b.stream, "api/a": other.stream}
	for lo, stream := range rules {
		if want := streams[owners.Owner(lo)]; stream != want {
			t.Errorf("block %d steers to %d, want %d", lo, stream, want)
		}
	}
}

// TestMovedBlocksStayWithTheirHolder: when an instance joins, the blocks it
// takes from an instance that still has connections from them stay steered
// to that instance, and the newcomer opens no connection from them, until
// those connections end. With and without the data plane's deltas.
func TestMovedBlocksStayWithTheirHolder(t *testing.T) {
	for _, delta := range []bool{false, true} {
		var dp Dataplane = newRecorder()
		tables := dp.(*recorder).current
		if delta {
			fdp := newFlowRecorder()
			dp, tables = fdp, fdp.current
		}
		r := newGroupRegistry(t, dp, time.Minute)
		a := instance(t, r, "web", "a")
		held := map[uint16][]*claim{} // a's flows by block
		for i := range 100 {
			c, err := r.connect(a, classifier.ProtoTCP, boxA, benchRemote(i))
			if err != nil {
				t.Fatal(err)
			}
			lo := c.port - (c.port-groupRange.Lo)%minBlockPorts
			held[lo] = append(held[lo], c)
		}
		b := instance(t, r, "web", "b")
		owners := sliceOwners(t, "web/a", "web/b")
		var moved []uint16
		for lo, stream := range blockRulesIn(t, tables()) {
			if stream != a.stream {
				t.Errorf("delta %v: block %d steers to %d while a holds every port of it", delta, lo, stream)
			}
			if owners.Owner(lo) == "web/b" {
				moved = append(moved, lo)
			}
		}
		if len(moved) == 0 {
			t.Fatal("no block moved to b: the test proves nothing")
		}
		if _, err := r.connect(b, classifier.ProtoTCP, boxA, benchRemote(1000)); !errors.Is(err, ErrNoPorts) {
			t.Fatalf("delta %v: b connects while a holds every port of its blocks: %v", delta, err)
		}
		lo := moved[0]
		for _, c := range held[lo] {
			if err := r.release(a, c.id); err != nil {
				t.Fatal(err)
			}
		}
		if got := blockRulesIn(t, tables())[lo]; got != b.stream {
			t.Errorf("delta %v: a's last connection from block %d ended, yet it steers to %d, not b (%d)", delta, lo, got, b.stream)
		}
		c, err := r.connect(b, classifier.ProtoTCP, boxA, benchRemote(1001))
		if err != nil {
			t.Fatalf("delta %v: %v", delta, err)
		}
		if c.port < lo || c.port >= lo+minBlockPorts {
			t.Errorf("delta %v: b connects from %d, outside the one block it may use (%d)", delta, c.port, lo)
		}
	}
}

// TestInstancesOverTheWire: instances name themselves at register; they
// share a listener, drain by asking or by the operator's Server.Drain, and
// a second process under a taken instance name is refused.
func TestInstancesOverTheWire(t *testing.T) {
	f := newFixture(t, nil)
	dial := func(instance string) *Client {
		c, err := DialLocal(ctx(t), f.path, "web")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetInstance(instance)
		return c
	}
	register := func(c *Client) {
		t.Helper()
		_, st, err := c.RegisterLocal(ctx(t), 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
	}
	a, b := dial("web-a"), dial("web-b")
	register(a)
	register(b)
	for _, c := range []*Client{a, b} {
		if _, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 8080); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := dial("web-a").RegisterLocal(ctx(t), 0, 0); !errors.Is(err, ErrNameTaken) {
		t.Errorf("a second web-a: %v, want ErrNameTaken", err)
	}
	if _, _, err := dial("web a").RegisterLocal(ctx(t), 0, 0); !errors.Is(err, ErrBadRequest) {
		t.Errorf("instance name with a space: %v, want ErrBadRequest", err)
	}
	other, _, _ := f.register("other")
	if _, err := other.Listen(ctx(t), "tcp", netip.Addr{}, 8080); !errors.Is(err, ErrPortInUse) {
		t.Errorf("another application on the shared port: %v, want ErrPortInUse", err)
	}
	if err := other.Drain(ctx(t)); !errors.Is(err, ErrNotPermitted) {
		t.Errorf("an application without instance name drains: %v, want ErrNotPermitted", err)
	}
	if err := b.Drain(ctx(t)); err != nil {
		t.Fatal(err)
	}
	g := f.srv.Groups()
	if len(g) != 1 || g[0].App != "web" || g[0].Port != 8080 || !slices.Equal(g[0].Instances, []string{"web-a"}) || !slices.Equal(g[0].Draining, []string{"web-b"}) {
		t.Fatalf("after web-b drained: groups %+v", g)
	}
	if err := f.srv.Drain("web", "nobody"); !errors.Is(err, ErrNotRegistered) {
		t.Errorf("draining an unknown instance: %v", err)
	}
	if err := f.srv.Drain("web", "web-a"); err != nil {
		t.Fatal(err)
	}
	// Both drain: nobody else can take the listener, so both keep it.
	if g := f.srv.Groups(); !slices.Equal(g[0].Instances, []string{"web-a", "web-b"}) || len(g[0].Draining) != 2 {
		t.Errorf("both drained: groups %+v", g)
	}
	if s := f.srv.DrainStats(); s.Started != 2 {
		t.Errorf("drain counts %+v, want 2 started", s)
	}
}

// TestSettleTakesInstancesAsOneSet: while a box has just started, the
// instances that come back to it one after another make one table, not a
// chain of joins that would pass slots from hand to hand; a draining one
// is the previous owner of the slots it would hold. After the settle time,
// a join is a join again. Without the settle time every slot the first
// instance held before the second came would remember it.
func TestSettleTakesInstancesAsOneSet(t *testing.T) {
	r := newGroupRegistry(t, newRecorder(), time.Minute)
	r.settled = r.now().Add(time.Hour)
	a, b, c := instance(t, r, "web", "a"), instance(t, r, "web", "b"), instance(t, r, "web", "c")
	listen80(t, r, a)
	listen80(t, r, b)
	if err := r.drain(b); err != nil {
		t.Fatal(err)
	}
	listen80(t, r, c)
	cur, prev := streamsIn(spreadOn(t, r, 80))
	if cur[b.stream] != 0 || cur[a.stream] == 0 || cur[c.stream] == 0 {
		t.Fatalf("settling: current owners %v; want a and c, not the draining b", cur)
	}
	// Maglev moves a few slots between a and c too when b leaves a
	// table; those remember a or c, which costs nothing.
	if prev[a.stream]+prev[c.stream] > maglev.DefaultSize/100 || prev[b.stream] == 0 {
		t.Fatalf("settling: previous owners %v; want b, the draining instance, and hardly anyone else", prev)
	}
	want, err := maglev.New([]string{"a", "b", "c"}, DefaultSpreadSeed, maglev.DefaultSize)
	if err != nil {
		t.Fatal(err)
	}
	if got := prev[b.stream]; got != want.Counts()["b"] {
		t.Errorf("b is the previous owner of %d slots, want the %d it holds in a table of all three", got, want.Counts()["b"])
	}

	r.settled = r.now()
	d := instance(t, r, "web", "d")
	listen80(t, r, d)
	if _, after := streamsIn(spreadOn(t, r, 80)); after[a.stream] < maglev.DefaultSize/10 || after[c.stream] < maglev.DefaultSize/10 {
		t.Errorf("settled: a join left previous owners %v; a's and c's moved slots should remember them", after)
	}
}
