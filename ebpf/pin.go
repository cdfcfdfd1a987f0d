package ebpf

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// A program loaded with Options.PinDir keeps its XDP link and its tables in
// that directory of a bpf file system:
//
//	PinDir/link                  the bpf_link that attaches the program
//	PinDir/program-BUILD         the program
//	PinDir/tables-LAYOUT/flows4  exact IPv4 flows
//	PinDir/tables-LAYOUT/flows   exact IPv6 flows
//	PinDir/tables-LAYOUT/listeners
//	PinDir/tables-LAYOUT/rulesets
//	PinDir/tables-LAYOUT/spreads   listeners' spread tables (spread.go)
//
// The link keeps the program attached after the process exits or dies; the
// tables keep every claim. The next LoadWith of the same directory adopts
// the tables when their layout is this program's, and Attach swaps the new
// program into the pinned link, so the interface is never without a
// program. LAYOUT names the layout of the tables' keys and values: a
// program whose structs differ finds no tables of its layout and starts
// with empty ones. BUILD names the object file and the load options: a
// successor of the same build takes the program over with all its maps
// instead of loading it, which spares it the verifier, the longest part
// of loading.
//
// A successor holds every listener, spread or not, until it is claimed
// again, and empties the spread tables; Update builds them anew. They are
// pinned all the same, so that the predecessor's program, which runs until
// Attach swaps the successor in, reads the spread tables that the listener
// entries name.

// HoldStream is the stream id adopted flows and listeners steer to until
// their application claims them again: no stream has it (stream ids fit in
// 24 bits), so the bridge drops their frames instead of the kernel
// resetting them.
const HoldStream = math.MaxUint32

// linkPin is the name of the pinned link in a pin directory.
const linkPin = "link"

// pinnedTables are the maps a program hands to its successor. The counters,
// the fragment table and the socket maps are each program's own.
var pinnedTables = []string{bpfMapFlows4, bpfMapFlows, bpfMapListeners, bpfMapRulesets, bpfMapSpreads}

// tablesDir is the directory of this program's table layout. The IPv4
// flow key is in the tag, so tables pinned before IPv4 flows had a table of
// their own (when flows held them all) are not adopted: the successor
// starts with empty tables and Adoption.Replaced says why.
var tablesDir = "tables-" + layoutTag(bpfFbFlow4Key{}, bpfFbFlowKey{}, bpfFbListenKey{}, bpfFbTarget{}, bpfFbListener{}, bpfFbRuleset{}, bpfFbSpread{})

// layoutTag is a short hash of the names, offsets and sizes of the fields of
// vs, recursively.
func layoutTag(vs ...any) string {
	h := fnv.New64a()
	var walk func(t reflect.Type)
	walk = func(t reflect.Type) {
		fmt.Fprintf(h, "%s:%d{", t.Kind(), t.Size())
		switch t.Kind() {
		case reflect.Struct:
			for i := range t.NumField() {
				f := t.Field(i)
				fmt.Fprintf(h, "%s@%d:", f.Name, f.Offset)
				walk(f.Type)
			}
		case reflect.Array:
			fmt.Fprintf(h, "%d*", t.Len())
			walk(t.Elem())
		}
		fmt.Fprint(h, "}")
	}
	for _, v := range vs {
		walk(reflect.TypeOf(v))
	}
	return fmt.Sprintf("%016x", h.Sum64())[:12]
}

// Adoption is what a program loaded with Options.PinDir took over from the
// previous program pinned there.
type Adoption struct {
	// Program: the predecessor's program was of the same build and
	// options, and is this one now, with its maps and counters.
	Program bool
	// Tables: the flows, listeners and rules were kept. Flows and listeners
	// steer to HoldStream until claimed again (HeldFlows, HeldListeners of
	// them are left) or ReleaseHeld removes them; the rules stay until the
	// first Update.
	Tables                   bool
	HeldFlows, HeldListeners int
	// Link: Attach swapped this program into the pinned link.
	Link bool
	// Replaced says why pinned objects that were there were not used.
	Replaced []string
}

// Adoption reports what the program took over from its predecessor.
func (p *Program) Adoption() Adoption {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.adoption
	a.HeldFlows, a.HeldListeners = len(p.heldFlows), len(p.heldListeners)
	a.Replaced = append([]string(nil), a.Replaced...)
	return a
}

// openPinnedTables opens the tables pinned under dir if they fit spec; else
// it says why not (nothing pinned: no reason).
func openPinnedTables(dir string, spec *ebpf.CollectionSpec) (map[string]*ebpf.Map, string) {
	base := filepath.Join(dir, tablesDir)
	if _, err := os.Stat(base); err != nil {
		others, _ := filepath.Glob(filepath.Join(dir, "tables-*"))
		if len(others) > 0 {
			return nil, fmt.Sprintf("pinned tables have another layout (%s, this program's is %s)", filepath.Base(others[0]), tablesDir)
		}
		return nil, ""
	}
	maps := map[string]*ebpf.Map{}
	closeAll := func() {
		for _, m := range maps {
			m.Close()
		}
	}
	for _, name := range pinnedTables {
		m, err := ebpf.LoadPinnedMap(filepath.Join(base, name), nil)
		if err != nil {
			closeAll()
			return nil, fmt.Sprintf("pinned %s: %v", name, err)
		}
		maps[name] = m
		if err := spec.Maps[name].Compatible(m); err != nil {
			closeAll()
			return nil, fmt.Sprintf("pinned %s does not fit: %v", name, err)
		}
	}
	return maps, ""
}

// buildID names the program that opts load: its object file and the
// options that change it.
func buildID(opts Options, testHooks bool) string {
	h := fnv.New64a()
	h.Write(_BpfBytes)
	fmt.Fprintf(h, "|%d|%v|%v", cmp.Or(opts.FlowCapacity, DefaultFlowCapacity), opts.DropUnbound, testHooks)
	return fmt.Sprintf("%016x", h.Sum64())[:12]
}

// reuse takes over the program pinned in the pin directory under build,
// with its maps, if it is there and its maps fit spec; it reports whether
// it did.
func (p *Program) reuse(spec *ebpf.CollectionSpec, build string) bool {
	prog, err := ebpf.LoadPinnedProgram(filepath.Join(p.pinDir, "program-"+build), nil)
	if err != nil {
		return false
	}
	byName := map[string]*ebpf.Map{}
	ok := false
	defer func() {
		if !ok {
			prog.Close()
			for _, m := range byName {
				m.Close()
			}
		}
	}()
	info, err := prog.Info()
	if err != nil {
		return false
	}
	ids, _ := info.MapIDs()
	for _, id := range ids {
		m, err := ebpf.NewMapFromID(id)
		if err != nil {
			return false
		}
		mi, err := m.Info()
		if err != nil {
			m.Close()
			return false
		}
		byName[mi.Name] = m
	}
	objs := bpfObjects{bpfPrograms: bpfPrograms{Fabricbridge: prog}}
	for name, dst := range map[string]**ebpf.Map{
		bpfMapEventCounters: &objs.EventCounters, bpfMapFlows: &objs.Flows, bpfMapFlows4: &objs.Flows4, bpfMapFragments: &objs.Fragments,
		bpfMapIngestXsks: &objs.IngestXsks, bpfMapLastMeta: &objs.LastMeta, bpfMapListeners: &objs.Listeners,
		bpfMapRuleCounters: &objs.RuleCounters, bpfMapRulesets: &objs.Rulesets, bpfMapSpreads: &objs.Spreads,
		bpfMapVerdictCounters: &objs.VerdictCounters, bpfMapXsks: &objs.Xsks,
		bpfMapStampSteered: &objs.StampSteered,
	} {
		m := byName[kernelName(name)]
		if m == nil || spec.Maps[name].Compatible(m) != nil {
			return false
		}
		*dst = m
		delete(byName, kernelName(name))
	}
	for _, m := range byName { // .rodata and the like: the program holds them
		m.Close()
	}
	byName = nil
	p.objs, ok = objs, true
	return true
}

// pinProgram pins the program under build, in place of any other.
func (p *Program) pinProgram(build string) error {
	old, _ := filepath.Glob(filepath.Join(p.pinDir, "program-*"))
	for _, o := range old {
		if err := os.Remove(o); err != nil {
			return fmt.Errorf("ebpf: remove pinned program: %w", err)
		}
	}
	c, err := p.objs.Fabricbridge.Clone()
	if err != nil {
		return fmt.Errorf("ebpf: pin program: %w", err)
	}
	defer c.Close()
	if err := c.Pin(filepath.Join(p.pinDir, "program-"+build)); err != nil {
		return fmt.Errorf("ebpf: pin program: %w", err)
	}
	return nil
}

// pinTables pins the program's tables under dir, in place of any there.
func (p *Program) pinTables(dir string) error {
	old, _ := filepath.Glob(filepath.Join(dir, "tables-*"))
	for _, o := range old {
		if err := os.RemoveAll(o); err != nil {
			return fmt.Errorf("ebpf: remove pinned tables: %w", err)
		}
	}
	base := filepath.Join(dir, tablesDir)
	if err := os.MkdirAll(base, 0o700); err != nil {
		return fmt.Errorf("ebpf: pin tables: %w", err)
	}
	for name, m := range map[string]*ebpf.Map{bpfMapFlows4: p.objs.Flows4, bpfMapFlows: p.objs.Flows, bpfMapListeners: p.objs.Listeners, bpfMapRulesets: p.objs.Rulesets, bpfMapSpreads: p.objs.Spreads} {
		// The program's maps are clones, unpinned as far as the library
		// knows, so that closing them never removes the pins.
		c, err := m.Clone()
		if err != nil {
			return fmt.Errorf("ebpf: pin %s: %w", name, err)
		}
		err = c.Pin(filepath.Join(base, name))
		c.Close()
		if err != nil {
			return fmt.Errorf("ebpf: pin %s: %w", name, err)
		}
	}
	return nil
}

// hold points every adopted flow and listener at HoldStream, a listener with
// a spread too, and remembers them as held: their applications belong to
// the previous daemon, whose stream ids the next one gives to others. Then
// it empties the spread tables, which no listener names any more.
func (p *Program) hold() error {
	flows, err := p.readFlows()
	if err != nil {
		return fmt.Errorf("ebpf: pinned flows: %w", err)
	}
	listeners, err := keysOf[bpfFbListenKey, bpfFbListener](p.objs.Listeners)
	if err != nil {
		return fmt.Errorf("ebpf: read pinned listeners: %w", err)
	}
	for k := range flows {
		m, key := p.flowTable(&k)
		if err := holdEntry(m, key, func(v *bpfFbTarget) { v.StreamId = HoldStream }); err != nil {
			return fmt.Errorf("ebpf: hold flow: %w", err)
		}
		p.heldFlows[k] = struct{}{}
	}
	for _, k := range listeners {
		if err := holdEntry(p.objs.Listeners, &k, func(v *bpfFbListener) { v.StreamId, v.Spread = HoldStream, 0 }); err != nil {
			return fmt.Errorf("ebpf: hold listener: %w", err)
		}
		p.heldListeners[k] = struct{}{}
	}
	return p.forgetSpreads()
}

// keysOf lists the keys of hash map m.
func keysOf[K, V any](m *ebpf.Map) ([]K, error) {
	var (
		k    K
		v    V
		keys []K
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	return keys, it.Err()
}

// holdEntry has hold rewrite the entry of key k, which keeps its rule id
// (its counter); an entry gone meanwhile stays gone.
func holdEntry[V any](m *ebpf.Map, k any, hold func(*V)) error {
	var v V
	if err := m.Lookup(k, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		return err
	}
	hold(&v)
	err := m.Update(k, &v, ebpf.UpdateExist)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil
	}
	return err
}

// ReleaseHeld removes the adopted flows and listeners that no application
// claimed again, so that their frames go to the kernel once more (their
// applications are gone). It returns how many it removed.
func (p *Program) ReleaseHeld() (flows, listeners int, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k := range p.heldFlows {
		if err := p.deleteFlow(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return flows, listeners, fmt.Errorf("ebpf: release held flow: %w", err)
		}
		delete(p.heldFlows, k)
		flows++
	}
	for k := range p.heldListeners {
		if err := p.objs.Listeners.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return flows, listeners, fmt.Errorf("ebpf: release held listener: %w", err)
		}
		delete(p.heldListeners, k)
		listeners++
	}
	return flows, listeners, nil
}

// adoptLink swaps the program into the link pinned in its directory, if
// there is one on ifindex in mode; a pinned link that is not is detached,
// and the reason noted. It reports whether the program is attached now.
func (p *Program) adoptLink(ifindex int, mode Mode) (bool, error) {
	path := filepath.Join(p.pinDir, linkPin)
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		p.adoption.Replaced = append(p.adoption.Replaced, fmt.Sprintf("pinned link: %v", err))
		return false, os.Remove(path)
	}
	why := linkMismatch(l, ifindex, mode)
	if why == "" {
		if err := l.Update(p.objs.Fabricbridge); err != nil {
			why = fmt.Sprintf("update: %v", err)
		}
	}
	if why != "" {
		p.adoption.Replaced = append(p.adoption.Replaced, "pinned link: "+why)
		err := l.Unpin()
		return false, errors.Join(err, l.Close())
	}
	p.attached, p.ifindex, p.mode = l, ifindex, mode
	p.adoption.Link = true
	return true, nil
}

// linkMismatch says why pinned link l cannot carry a program for ifindex in
// mode, or "".
func linkMismatch(l link.Link, ifindex int, mode Mode) string {
	info, err := l.Info()
	if err != nil {
		return err.Error()
	}
	x := info.XDP()
	if x == nil {
		return fmt.Sprintf("a %v link, not XDP", info.Type)
	}
	if int(x.Ifindex) != ifindex {
		return fmt.Sprintf("on ifindex %d, not %d (the interface went away)", x.Ifindex, ifindex)
	}
	nl, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return err.Error()
	}
	got := ModeNative
	if a := nl.Attrs().Xdp; a != nil && a.AttachMode == xdpAttachedSKB {
		got = ModeGeneric
	}
	if got != mode {
		return fmt.Sprintf("attached in %v mode, wanted %v", got, mode)
	}
	return ""
}

// Leave closes the program's descriptors but leaves it steering: attached
// through its pinned link, with its pinned tables, for the next LoadWith
// of the same Options.PinDir to adopt. Frames it steers while no socket is
// bound are dropped (Options.DropUnbound), not reset by the kernel.
// Without a PinDir, or not attached, it is Close.
func (p *Program) Leave() error {
	p.mu.Lock()
	keep := p.pinDir != "" && p.attached != nil
	if keep {
		// A pinned link stays attached after its last descriptor closes.
		err := p.attached.Close()
		p.attached = nil
		p.mu.Unlock()
		return errors.Join(err, p.objs.Close())
	}
	p.mu.Unlock()
	return p.Close()
}

// PinnedLink reports the interface that the link pinned in dir attaches
// to: 0 when it attaches to nothing any more (its interface was deleted),
// ok false when there is none (or dir is "").
func PinnedLink(dir string) (ifindex int, ok bool, err error) {
	if dir == "" {
		return 0, false, nil
	}
	l, err := link.LoadPinnedLink(filepath.Join(dir, linkPin), nil)
	if errors.Is(err, os.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return 0, true, err
	}
	if x := info.XDP(); x != nil {
		return int(x.Ifindex), true, nil
	}
	return 0, true, nil
}

// RemovePins detaches the program that a link pinned in dir attaches and
// removes dir with everything pinned in it: what an operator does to give
// an interface back for good once its daemon has stopped (a running
// program holds its own link, which it detaches itself on Close). It
// reports whether there was a link.
func RemovePins(dir string) (detached bool, err error) {
	l, err := link.LoadPinnedLink(filepath.Join(dir, linkPin), nil)
	switch {
	case err == nil:
		detached = true
		// Detach at once, whoever else holds the link.
		if derr := l.Detach(); derr != nil && !errors.Is(derr, unix.EINVAL) && !errors.Is(derr, ebpf.ErrNotSupported) {
			err = fmt.Errorf("detach: %w", derr)
		}
		err = errors.Join(err, l.Unpin(), l.Close())
	case errors.Is(err, os.ErrNotExist):
		err = nil
	}
	if rerr := os.RemoveAll(dir); rerr != nil {
		err = errors.Join(err, rerr)
	}
	if err != nil {
		return detached, fmt.Errorf("ebpf: remove pins in %s: %w", dir, err)
	}
	return detached, nil
}

// IsBPFFS reports whether dir lies on a bpf file system, where pins live.
func IsBPFFS(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}

// String says what was adopted and what replaced, for the log.
func (a Adoption) String() string {
	var parts []string
	if a.Link {
		parts = append(parts, "link")
	}
	if a.Tables {
		parts = append(parts, fmt.Sprintf("tables (%d flows, %d listeners held)", a.HeldFlows, a.HeldListeners))
	}
	if a.Program {
		parts = append(parts, "program")
	}
	if len(parts) == 0 {
		parts = append(parts, "nothing")
	}
	s := "adopted " + strings.Join(parts, " and ")
	if len(a.Replaced) > 0 {
		s += "; replaced: " + strings.Join(a.Replaced, "; ")
	}
	return s
}
