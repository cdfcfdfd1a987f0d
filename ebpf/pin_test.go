package ebpf

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func programID(t *testing.T, p *Program) uint32 {
	t.Helper()
	info, err := p.Program().Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return uint32(id)
}

// dialDropped checks that a TCP connection to addr is neither answered nor
// refused: its SYNs are dropped, where the kernel (no socket there) would
// reset them.
func dialDropped(t *testing.T, outside *topology.NS, addr netip.AddrPort) {
	t.Helper()
	err := outside.Do(func() error {
		c, err := net.DialTimeout("tcp", addr.String(), 300*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err
	})
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("dial %v: %v, want a timeout (SYN dropped, no reset)", addr, err)
	}
}

// TestPinnedProgramOutlivesItsOwner loads and attaches the program with a
// pin directory, leaves it (as a daemon that exits for a restart does) and
// has a second load adopt it: the program stays attached throughout and
// drops steered frames instead of letting the kernel reset them, a load
// of the same build takes the program itself over (no verifier), the
// adopted flows and listeners are held (steered to HoldStream) until
// claimed again or released, the link is taken over with no moment without
// a program, and tables of another size are replaced, not adopted. A
// listener spread over instances is held like any other, its spread table
// dropped until the claim brings a new one.
func TestPinnedProgramOutlivesItsOwner(t *testing.T) {
	testenv.RequirePrivileged(t)
	bridge, outside, v := topology.Pair(t, topology.VethOptions{})
	dir := filepath.Join(testenv.BPFFS(t), "ns", v.A.Name)
	local := v.A.Addr4.Addr()
	listen := netip.AddrPortFrom(local, 8080)
	opts := Options{PinDir: dir, DropUnbound: true, FlowCapacity: 4096}

	load := func(o Options) *Program {
		t.Helper()
		p, err := LoadWith(o)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	attach := func(p *Program) {
		t.Helper()
		if err := bridge.Do(func() error {
			_, err := p.Attach(v.A.Index, ModeNative)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}

	first := load(opts)
	if a := first.Adoption(); a.Tables || a.Link || len(a.Replaced) > 0 {
		t.Fatalf("nothing was pinned, yet: %v", a)
	}
	remote := netip.MustParseAddr("198.18.7.7")
	flow := classifier.Flow{ID: 21, Protocol: classifier.ProtoUDP, Local: netip.AddrPortFrom(local, 4000), Remote: netip.AddrPortFrom(remote, 53), Stream: 3}
	// IPv4 and IPv6 flows live in tables of their own; both are handed over.
	flow6 := classifier.Flow{ID: 22, Protocol: classifier.ProtoTCP, Local: netip.AddrPortFrom(netip.MustParseAddr("2001:db8::1"), 4000),
		Remote: netip.AddrPortFrom(netip.MustParseAddr("2001:db8::7"), 443), Stream: 4}
	tables, err := classifier.Compile(&classifier.RuleSet{
		Listeners: []classifier.Listener{{ID: 12, Protocol: classifier.ProtoTCP, Addr: local, Port: 8080, Stream: 1,
			Spread: &classifier.Spread{Seed: 7, Slots: []classifier.Slot{{Current: 1}, {Current: 2, Previous: 1}}}}},
		Rules: []classifier.Rule{{ID: 13, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(5001), Action: classifier.ActionDrop}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Update(tables); err != nil {
		t.Fatal(err)
	}
	if err := first.AddFlows([]classifier.Flow{flow, flow6}); err != nil {
		t.Fatal(err)
	}
	attach(first)
	firstID := programID(t, first)
	if err := first.Leave(); err != nil {
		t.Fatal(err)
	}

	// Nobody holds the program but its pins: it still steers, and with no
	// socket bound it drops.
	if id := bridge.XDPProgram(t, v.A.Name); id != firstID {
		t.Fatalf("after Leave the interface runs program %d, want %d (the one left)", id, firstID)
	}
	dialDropped(t, outside, listen)

	second := load(opts)
	a := second.Adoption()
	if !a.Program || !a.Tables || a.HeldFlows != 2 || a.HeldListeners != 1 || a.Link {
		t.Fatalf("second program: %v, want the same program and its tables with two flows and one listener held, the link not yet", a)
	}
	if id := programID(t, second); id != firstID {
		t.Errorf("the second load has program %d, want the first, %d, taken over", id, firstID)
	}
	flows, err := second.InstalledFlows()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []classifier.Flow{flow, flow6} {
		if got := flows[f.Key()]; got.Stream != HoldStream || got.Rule != f.ID {
			t.Errorf("adopted flow %v steers to %+v, want stream %d with its rule id %d", f.Remote, got, uint32(HoldStream), f.ID)
		}
	}
	key := bpfFbListenKey{Family: 4, Proto: uint8(classifier.ProtoTCP), Port: 8080, Addr: words32(classifier.ToAddr16(local))}
	var lv bpfFbListener
	if err := second.objs.Listeners.Lookup(&key, &lv); err != nil || lv.StreamId != HoldStream || lv.Spread != 0 || lv.RuleId != 12 {
		t.Errorf("adopted listener with a spread: %+v (%v), want stream %d, no spread, rule 12", lv, err, uint32(HoldStream))
	}
	for i := uint32(1); i < uint32(bpfFbLimitFB_SPREAD_INDICES); i++ {
		if id := spreadMapID(t, second, i); id != 0 {
			t.Errorf("adopted program still holds spread table %d (map %d) that no listener names", i, id)
		}
	}
	attach(second)
	if a := second.Adoption(); !a.Link {
		t.Errorf("the pinned link was not taken over: %v", a)
	}
	if id := bridge.XDPProgram(t, v.A.Name); id != programID(t, second) {
		t.Errorf("the interface runs program %d, want the second, %d", id, programID(t, second))
	}
	dialDropped(t, outside, listen)

	// The listener is claimed again (a new stream id), the flow is not:
	// releasing the held entries removes the flow only.
	tables, err = classifier.Compile(&classifier.RuleSet{
		Listeners: []classifier.Listener{{ID: 12, Protocol: classifier.ProtoTCP, Addr: local, Port: 8080, Stream: 9,
			Spread: &classifier.Spread{Seed: 7, Slots: []classifier.Slot{{Current: 9}, {Current: 10, Previous: 9}}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := second.Update(tables); err != nil {
		t.Fatal(err)
	}
	if a := second.Adoption(); a.HeldListeners != 0 || a.HeldFlows != 2 {
		t.Errorf("after the listener's claim: %v, want only the flows held", a)
	}
	if f, l, err := second.ReleaseHeld(); err != nil || f != 2 || l != 0 {
		t.Errorf("ReleaseHeld: %d flows, %d listeners, %v; want 2, 0", f, l, err)
	}
	if flows, _ := second.InstalledFlows(); len(flows) != 0 {
		t.Errorf("flows left after the release: %v", flows)
	}
	if err := second.objs.Listeners.Lookup(&key, &lv); err != nil || lv.StreamId != 9 || lv.Spread == 0 || spreadMapID(t, second, lv.Spread) == 0 {
		t.Errorf("the claimed listener steers to %+v (%v), want stream 9 and a spread table", lv, err)
	}
	if err := second.Leave(); err != nil {
		t.Fatal(err)
	}

	// Tables of another layout (as pinned before IPv4 flows had a table
	// of their own): not adopted, and the reason says so. Another build
	// (options) loads, since the same build would take over the pinned
	// program with its maps.
	if err := os.Rename(filepath.Join(dir, tablesDir), filepath.Join(dir, "tables-000000000000")); err != nil {
		t.Fatal(err)
	}
	rebuilt := opts
	rebuilt.DropUnbound = false
	relaid := load(rebuilt)
	if a := relaid.Adoption(); a.Tables || len(a.Replaced) != 1 || !strings.Contains(a.Replaced[0], "another layout") {
		t.Errorf("tables of another layout: %v, want them replaced for their layout", a)
	}
	if flows, _ := relaid.InstalledFlows(); len(flows) != 0 {
		t.Errorf("flows adopted from tables of another layout: %v", flows)
	}
	if old, _ := filepath.Glob(filepath.Join(dir, "tables-*")); len(old) != 1 || filepath.Base(old[0]) != tablesDir {
		t.Errorf("pinned tables after the replacement: %v, want only %s", old, tablesDir)
	}
	attach(relaid)
	if err := relaid.Leave(); err != nil {
		t.Fatal(err)
	}

	// Another flow capacity: the tables do not fit and are replaced, the
	// link is still taken over.
	resized := opts
	resized.FlowCapacity = 2048
	third := load(resized)
	if a := third.Adoption(); a.Program || a.Tables || len(a.Replaced) != 1 || !strings.Contains(a.Replaced[0], "MaxEntries") {
		t.Errorf("resized flow table: %v, want the program loaded anew and the tables replaced for their size", a)
	}
	if id := programID(t, third); id == firstID {
		t.Error("the resized program is the first one")
	}
	attach(third)
	if a := third.Adoption(); !a.Link {
		t.Errorf("resized: the link was not taken over: %v", a)
	}
	// Close gives everything back.
	if err := third.Close(); err != nil {
		t.Fatal(err)
	}
	if id := bridge.XDPProgram(t, v.A.Name); id != 0 {
		t.Errorf("program %d still attached after Close", id)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after Close: %v", err)
	}

	// What an operator runs once the daemon is gone for good.
	fourth := load(opts)
	attach(fourth)
	if err := fourth.Leave(); err != nil {
		t.Fatal(err)
	}
	if idx, ok, err := PinnedLink(dir); err != nil || !ok || idx != v.A.Index {
		t.Errorf("PinnedLink: %d, %v, %v; want %d", idx, ok, err, v.A.Index)
	}
	if detached, err := RemovePins(dir); err != nil || !detached {
		t.Fatalf("RemovePins: %v, %v", detached, err)
	}
	if id := bridge.XDPProgram(t, v.A.Name); id != 0 {
		t.Errorf("program %d still attached after RemovePins", id)
	}
	if _, ok, _ := PinnedLink(dir); ok {
		t.Error("a link is still pinned after RemovePins")
	}
}

// TestPinnedLinkOfADeletedInterface: a link whose interface went away is
// reported as attaching to nothing, and is not taken over.
func TestPinnedLinkOfADeletedInterface(t *testing.T) {
	testenv.RequirePrivileged(t)
	bridge, _, v := topology.Pair(t, topology.VethOptions{})
	dir := filepath.Join(testenv.BPFFS(t), "ns", v.A.Name)
	p, err := LoadWith(Options{PinDir: dir, FlowCapacity: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if err := bridge.Do(func() error { _, err := p.Attach(v.A.Index, ModeNative); return err }); err != nil {
		t.Fatal(err)
	}
	if err := p.Leave(); err != nil {
		t.Fatal(err)
	}
	bridge.DeleteLink(t, v.A.Name)
	if idx, ok, err := PinnedLink(dir); err != nil || !ok || idx != 0 {
		t.Errorf("PinnedLink after the interface went: %d, %v, %v; want 0, true", idx, ok, err)
	}
	if _, err := RemovePins(dir); err != nil {
		t.Fatal(err)
	}
}

// TestPinnedSpreadTablesAreShared: a successor of another build adopts the
// tables but not the program, which keeps running until Attach. The spread
// tables are among the adopted ones, so that the predecessor's program and
// the successor read the same tables under the indices the shared listener
// entries name, whichever runs when the successor's first Update lands.
func TestPinnedSpreadTablesAreShared(t *testing.T) {
	testenv.RequirePrivileged(t)
	bridge, _, v := topology.Pair(t, topology.VethOptions{})
	dir := filepath.Join(testenv.BPFFS(t), "ns", v.A.Name)
	local := v.A.Addr4.Addr()
	compile := func(stream uint32) *classifier.Tables {
		t.Helper()
		tables, err := classifier.Compile(&classifier.RuleSet{Listeners: []classifier.Listener{{ID: 12, Protocol: classifier.ProtoTCP, Addr: local, Port: 8080, Stream: stream,
			Spread: &classifier.Spread{Seed: uint64(stream), Slots: []classifier.Slot{{Current: stream}, {Current: stream + 1, Previous: stream}}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return tables
	}
	first, err := LoadWith(Options{PinDir: dir, DropUnbound: true, FlowCapacity: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Update(compile(1)); err != nil {
		t.Fatal(err)
	}
	if err := bridge.Do(func() error { _, err := first.Attach(v.A.Index, ModeNative); return err }); err != nil {
		t.Fatal(err)
	}
	firstID := programID(t, first)
	if err := first.Leave(); err != nil {
		t.Fatal(err)
	}

	second, err := LoadWith(Options{PinDir: dir, FlowCapacity: 1024}) // another build: frames of no socket pass
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if a := second.Adoption(); a.Program || !a.Tables || a.HeldListeners != 1 {
		t.Fatalf("%v, want the tables with one listener held, not the program", a)
	}
	if err := second.Update(compile(5)); err != nil {
		t.Fatal(err)
	}
	old, err := ebpf.NewProgramFromID(ebpf.ProgramID(firstID))
	if err != nil {
		t.Fatalf("the first program, still attached: %v", err)
	}
	defer old.Close()
	info, err := old.Info()
	if err != nil {
		t.Fatal(err)
	}
	oldMaps, _ := info.MapIDs()
	spreadsInfo, err := second.objs.Spreads.Info()
	if err != nil {
		t.Fatal(err)
	}
	spreadsID, _ := spreadsInfo.ID()
	if !slices.Contains(oldMaps, spreadsID) {
		t.Errorf("the running first program reads maps %v, not the successor's spreads map %d", oldMaps, spreadsID)
	}
	key := bpfFbListenKey{Family: 4, Proto: uint8(classifier.ProtoTCP), Port: 8080, Addr: words32(classifier.ToAddr16(local))}
	var lv bpfFbListener
	if err := second.objs.Listeners.Lookup(&key, &lv); err != nil || lv.StreamId != 5 || spreadMapID(t, second, lv.Spread) == 0 {
		t.Errorf("the claimed listener: %+v (%v), want stream 5 and a spread table", lv, err)
	}
}
