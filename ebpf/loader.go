// Package ebpf holds fabricbridge's XDP classifier (fabricbridge.c, compiled
// with bpf2go; the generated files are committed) and the Go side that loads
// it, attaches it to an interface, keeps its tables in step with a
// classifier.RuleSet and reads its counters.
//
// The program realises package classifier's semantics in the kernel; the tests
// prove the two equal on generated and fuzzed frames.
package ebpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// Mode is how the program is attached to an interface.
type Mode int

// Attach modes.
const (
	// ModeAuto tries native, then generic.
	ModeAuto Mode = iota
	// ModeNative runs the program in the driver, before an skb exists.
	ModeNative
	// ModeGeneric runs it on the skb path: works on any interface, slower.
	ModeGeneric
)

func (m Mode) String() string {
	switch m {
	case ModeAuto:
		return "auto"
	case ModeNative:
		return "native"
	case ModeGeneric:
		return "generic"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// Program is the loaded classifier. Its methods are safe for concurrent use.
type Program struct {
	objs bpfObjects
	// ruleSetSpec makes a fresh inner rule map on every update.
	ruleSetSpec *ebpf.MapSpec

	mu        sync.Mutex
	attached  link.Link
	ifindex   int
	mode      Mode
	flows     map[bpfFbFlowKey]bpfFbTarget
	listeners map[bpfFbListenKey]bpfFbListener
	spreads   spreadState

	// With Options.PinDir (pin.go): what was adopted, and the adopted
	// entries no claim has overwritten yet.
	pinDir        string
	adoption      Adoption
	heldFlows     map[bpfFbFlowKey]struct{}
	heldListeners map[bpfFbListenKey]struct{}
}

// DefaultFlowCapacity is the size of each exact-flow table unless Options
// say otherwise.
const DefaultFlowCapacity = 262144

// FlowEntryBytes is about what one flow of capacity costs in kernel memory
// up front: a slot of the IPv4 table (a BPF hash map that preallocates every
// slot: key, value, the element's header and bucket; 88 bytes) and a bucket
// of the IPv6 table (16 bytes), which allocates an element when a flow is
// added. Measured on Linux 6.18 with TestFlowCapacityMemory.
const FlowEntryBytes = 104

// Options change how the program is loaded. The zero value is the default.
type Options struct {
	// FlowCapacity is how many exact flows of each family the program's
	// tables hold (a claim beyond it is refused); 0 means
	// DefaultFlowCapacity. About FlowEntryBytes of kernel memory a flow
	// is taken up front; IPv6 flows take theirs as they are added.
	FlowCapacity int
	// DropUnbound drops a steered frame that finds no AF_XDP socket on its
	// queue, where the default passes it to the kernel. The kernel has no
	// socket for an application's tuple and would answer a TCP segment
	// with a reset; dropped, the segment is sent again later.
	DropUnbound bool
	// PinDir, if set, is a directory on a bpf file system, one per
	// interface and daemon, where the program pins its link and tables so
	// that it keeps steering after the process exits (see Leave), and
	// from which it adopts a predecessor's (see pin.go and Adoption).
	PinDir string
}

// Load loads the program and its maps into the kernel. The tables start empty:
// everything passes to the kernel until Update.
func Load() (*Program, error) { return LoadWith(Options{}) }

// LoadWith is Load with options.
func LoadWith(opts Options) (*Program, error) { return load(opts, false) }

// load is LoadWith with the test hooks: testHooks has every classification
// copied to the last_meta map, and ingest frames stripped even when no
// socket is bound, so that a test run shows the stripped frame.
func load(opts Options, testHooks bool) (*Program, error) {
	spec, err := loadBpf()
	if err != nil {
		return nil, err
	}
	if opts.FlowCapacity < 0 || opts.FlowCapacity > 1<<27 {
		return nil, fmt.Errorf("ebpf: flow capacity %d outside 0..%d", opts.FlowCapacity, 1<<27)
	}
	if opts.FlowCapacity > 0 {
		spec.Maps[bpfMapFlows4].MaxEntries = uint32(opts.FlowCapacity)
		spec.Maps[bpfMapFlows].MaxEntries = uint32(opts.FlowCapacity)
	}
	if opts.DropUnbound {
		if err := spec.Variables[bpfVarDropUnbound].Set(uint32(1)); err != nil {
			return nil, fmt.Errorf("ebpf: %s: %w", bpfVarDropUnbound, err)
		}
	}
	if testHooks {
		for _, name := range []string{bpfVarRecordLast, bpfVarStripUnbound} {
			if err := spec.Variables[name].Set(uint32(1)); err != nil {
				return nil, fmt.Errorf("ebpf: %s: %w", name, err)
			}
		}
	}
	inner := spec.Maps[bpfMapRulesets].InnerMap
	if inner == nil {
		return nil, errors.New("ebpf: rulesets has no inner map spec")
	}
	spreadInner := spec.Maps[bpfMapSpreads].InnerMap
	if spreadInner == nil {
		return nil, errors.New("ebpf: spreads has no inner map spec")
	}
	p := &Program{
		ruleSetSpec:   inner.Copy(),
		flows:         map[bpfFbFlowKey]bpfFbTarget{},
		listeners:     map[bpfFbListenKey]bpfFbListener{},
		spreads:       spreadState{spec: spreadInner.Copy(), index: map[spreadSum]uint32{}},
		pinDir:        opts.PinDir,
		heldFlows:     map[bpfFbFlowKey]struct{}{},
		heldListeners: map[bpfFbListenKey]struct{}{},
	}
	build := buildID(opts, testHooks)
	if p.pinDir != "" && p.reuse(spec, build) {
		p.adoption.Program, p.adoption.Tables = true, true
		if err := p.hold(); err != nil {
			p.objs.Close()
			return nil, err
		}
		return p, nil
	}
	var adopt map[string]*ebpf.Map
	if p.pinDir != "" {
		var why string
		if adopt, why = openPinnedTables(p.pinDir, spec); why != "" {
			p.adoption.Replaced = append(p.adoption.Replaced, why)
		}
	}
	err = spec.LoadAndAssign(&p.objs, &ebpf.CollectionOptions{MapReplacements: adopt})
	for _, m := range adopt {
		m.Close() // the collection holds clones
	}
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("ebpf: verifier refused the program: %+v", verr)
		}
		return nil, fmt.Errorf("ebpf: load: %w", err)
	}
	if adopt != nil {
		// The rules stay as the predecessor left them until the first
		// Update: they are the configuration's, not any application's.
		p.adoption.Tables = true
		err = p.hold()
	} else {
		err = p.installRules(nil)
		if err == nil && p.pinDir != "" {
			err = p.pinTables(p.pinDir)
		}
	}
	if err == nil && p.pinDir != "" {
		err = p.pinProgram(build)
	}
	if err != nil {
		p.objs.Close()
		return nil, err
	}
	return p, nil
}

// Close detaches the program if attached and releases it and its maps;
// with Options.PinDir it removes the pins too (Leave keeps them).
func (p *Program) Close() error {
	err := p.Detach()
	err = errors.Join(err, p.objs.Close())
	if p.pinDir != "" {
		if rerr := os.RemoveAll(p.pinDir); rerr != nil {
			err = errors.Join(err, fmt.Errorf("ebpf: remove pins: %w", rerr))
		}
	}
	return err
}

// Attach attaches the program to the interface. With ModeAuto it tries native
// mode first and falls back to generic; the mode it got is returned, because
// generic mode is much slower and users must know when they run in it.
//
// With Options.PinDir, a link pinned there on the same interface in the
// same mode (ModeAuto: native) is taken over: the program replaces its
// predecessor in it atomically. Otherwise the new link is pinned there.
func (p *Program) Attach(ifindex int, mode Mode) (Mode, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.attached != nil {
		return p.mode, fmt.Errorf("ebpf: already attached to ifindex %d", p.ifindex)
	}
	if p.pinDir != "" {
		want := mode
		if want == ModeAuto {
			want = ModeNative
		}
		if ok, err := p.adoptLink(ifindex, want); ok || err != nil {
			return want, err
		}
	}
	try := []Mode{mode}
	if mode == ModeAuto {
		try = []Mode{ModeNative, ModeGeneric}
	}
	var errs []error
	for _, m := range try {
		flags := link.XDPDriverMode
		if m == ModeGeneric {
			flags = link.XDPGenericMode
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: p.objs.Fabricbridge, Interface: ifindex, Flags: flags})
		if err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", m, err))
			continue
		}
		if p.pinDir != "" {
			if err := l.Pin(filepath.Join(p.pinDir, linkPin)); err != nil {
				l.Close()
				return 0, fmt.Errorf("ebpf: pin link: %w", err)
			}
		}
		p.attached, p.ifindex, p.mode = l, ifindex, m
		return m, nil
	}
	return 0, fmt.Errorf("ebpf: attach to ifindex %d: %w", ifindex, errors.Join(errs...))
}

// Mode reports how the program is attached, and whether it is.
func (p *Program) Mode() (Mode, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode, p.attached != nil
}

// Detach removes the program from its interface; without one it does nothing.
// The attachment is a BPF link owned by this process, so a crashed process
// leaves nothing attached behind it, unless the link is pinned
// (Options.PinDir): Detach unpins it.
func (p *Program) Detach() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.attached == nil {
		return nil
	}
	var err error
	if p.pinDir != "" {
		if uerr := p.attached.Unpin(); uerr != nil && !errors.Is(uerr, os.ErrNotExist) {
			err = uerr
		}
	}
	err = errors.Join(err, p.attached.Close())
	p.attached = nil
	if err != nil {
		return fmt.Errorf("ebpf: detach from ifindex %d: %w", p.ifindex, err)
	}
	return nil
}

// Program returns the classifier program, for BPF_PROG_TEST_RUN and for
// callers that attach it themselves.
func (p *Program) Program() *ebpf.Program { return p.objs.Fabricbridge }

// XSKMap is the map of AF_XDP sockets that steered frames are redirected to,
// indexed by receive queue.
func (p *Program) XSKMap() *ebpf.Map { return p.objs.Xsks }

// IngestXSKMap is the map of AF_XDP sockets for ingest frames, by queue.
// Frames redirected there are stripped to their UDP payload and carry a
// classifier.IngestMeta in front (see classifier.Ingest); with no socket on
// the queue a frame goes to the kernel whole.
func (p *Program) IngestXSKMap() *ebpf.Map { return p.objs.IngestXsks }

// StampSteered has steered frames carry their RX timestamp
// (classifier.Meta.RxTimestampNs, CLOCK_MONOTONIC) or leave it 0, as they
// do after Load. Turn it on only while something reads the timestamps, a
// packet capture: reading the clock is a large part of a steered frame's
// cost where the clock is a hypervisor's. Ingest frames are always
// stamped. The setting is the program's: a program adopted from a pin
// directory keeps its predecessor's until set.
func (p *Program) StampSteered(on bool) error {
	var v uint32
	if on {
		v = 1
	}
	if err := p.objs.StampSteered.Put(uint32(0), v); err != nil {
		return fmt.Errorf("ebpf: stamp steered frames: %w", err)
	}
	return nil
}

// StampsSteered reports whether steered frames carry their RX timestamp
// (StampSteered).
func (p *Program) StampsSteered() (bool, error) {
	var v uint32
	if err := p.objs.StampSteered.Lookup(uint32(0), &v); err != nil {
		return false, fmt.Errorf("ebpf: stamp steered frames: %w", err)
	}
	return v != 0, nil
}

// FlowCapacity is how many exact flows of each family the program's tables
// hold.
func (p *Program) FlowCapacity() int { return int(p.objs.Flows4.MaxEntries()) }

// flowKey is f's key as this package keeps it, whatever its family; the
// program keeps IPv4 flows under a shorter key in a table of their own
// (fabricbridge.h, fb_flow4_key), and flowTable picks table and key.
func flowKey(k classifier.FlowKey) bpfFbFlowKey {
	return bpfFbFlowKey{Family: k.Family, Proto: k.Proto, Sport: k.SrcPort, Dport: k.DstPort, Src: words64(k.Src), Dst: words64(k.Dst)}
}

// flowTable is the program's table of the flow keyed k and k as that table
// keys it.
func (p *Program) flowTable(k *bpfFbFlowKey) (*ebpf.Map, any) {
	if k.Family == ipv4 {
		return p.objs.Flows4, flow4Key(k)
	}
	return p.objs.Flows, k
}

// ipv4 is classifier's family of IPv4 flows.
const ipv4 = 4

// flow4Key is IPv4 flow k in the IPv4 table's form: an address is the first
// four bytes of its Addr16.
func flow4Key(k *bpfFbFlowKey) *bpfFbFlow4Key {
	return &bpfFbFlow4Key{Src: addr4(k.Src), Dst: addr4(k.Dst), Sport: k.Sport, Dport: k.Dport, Proto: k.Proto}
}

// flowOf4 is the key of the flow that the IPv4 table keys as k.
func flowOf4(k *bpfFbFlow4Key) bpfFbFlowKey {
	return bpfFbFlowKey{Family: ipv4, Proto: k.Proto, Sport: k.Sport, Dport: k.Dport, Src: words4(k.Src), Dst: words4(k.Dst)}
}

// addr4 and words4 convert between an IPv4 address as the wide words hold
// it and as a uint32 holds it, keeping its bytes in order in memory.
func addr4(w [2]uint64) uint32 {
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], w[0])
	return binary.NativeEndian.Uint32(b[:4])
}

func words4(a uint32) [2]uint64 {
	var b [8]byte
	binary.NativeEndian.PutUint32(b[:4], a)
	return [2]uint64{binary.NativeEndian.Uint64(b[:])}
}

// putFlow and deleteFlow write and delete one flow in its table.
func (p *Program) putFlow(k *bpfFbFlowKey, v *bpfFbTarget) error {
	m, key := p.flowTable(k)
	return m.Put(key, v)
}

func (p *Program) deleteFlow(k *bpfFbFlowKey) error {
	m, key := p.flowTable(k)
	return m.Delete(key)
}

// AddFlows installs flows one map update each, without touching anything
// else: the delta of a flow claim. A flow of the same tuple is replaced.
// On an error (the table is full) the flows before the failing one stay.
func (p *Program) AddFlows(flows []classifier.Flow) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, f := range flows {
		k, v := flowKey(f.Key()), bpfFbTarget{StreamId: f.Stream, RuleId: f.ID}
		if err := p.putFlow(&k, &v); err != nil {
			return fmt.Errorf("ebpf: add flow %v -> %v: %w", f.Remote, f.Local, err)
		}
		p.flows[k] = v
		delete(p.heldFlows, k)
	}
	return nil
}

// removeChunk bounds how many flows RemoveFlows deletes per hold of the
// program's lock, so that other applications' claims interleave with a
// large release.
const removeChunk = 1024

// RemoveFlows deletes flows one map delete each; a flow not installed is
// no error.
func (p *Program) RemoveFlows(flows []classifier.Flow) error {
	for len(flows) > 0 {
		n := min(len(flows), removeChunk)
		if err := p.removeFlows(flows[:n]); err != nil {
			return err
		}
		flows = flows[n:]
	}
	return nil
}

func (p *Program) removeFlows(flows []classifier.Flow) error {
	var keys4 []bpfFbFlow4Key
	var keys6 []bpfFbFlowKey
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, f := range flows {
		k := flowKey(f.Key())
		delete(p.flows, k)
		if k.Family == ipv4 {
			keys4 = append(keys4, *flow4Key(&k))
		} else {
			keys6 = append(keys6, k)
		}
	}
	if err := deleteBatch(p.objs.Flows4, keys4); err != nil {
		return fmt.Errorf("ebpf: remove flows: %w", err)
	}
	if err := deleteBatch(p.objs.Flows, keys6); err != nil {
		return fmt.Errorf("ebpf: remove flows: %w", err)
	}
	return nil
}

// deleteBatch deletes keys from m, one syscall for them all where the
// kernel has batch operations; a key m lacks is no error.
func deleteBatch[K any](m *ebpf.Map, keys []K) error {
	// The kernel stops at a key it lacks, which is then skipped.
	for len(keys) > 0 {
		n, err := m.BatchDelete(keys, nil)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ebpf.ErrKeyNotExist):
			keys = keys[n+1:]
		case errors.Is(err, ebpf.ErrNotSupported):
			return deleteEach(m, keys)
		default:
			return err
		}
	}
	return nil
}

// deleteEach is deleteBatch for kernels without batch operations.
func deleteEach[K any](m *ebpf.Map, keys []K) error {
	for _, k := range keys {
		if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}

// InstalledFlows reads the exact-flow tables back from the kernel.
func (p *Program) InstalledFlows() (map[classifier.FlowKey]classifier.Target, error) {
	flows, err := p.readFlows()
	if err != nil {
		return nil, err
	}
	out := map[classifier.FlowKey]classifier.Target{}
	for k, v := range flows {
		fk := classifier.FlowKey{Family: k.Family, Proto: k.Proto, SrcPort: k.Sport, DstPort: k.Dport}
		ne := binary.NativeEndian
		for i, w := range k.Src {
			ne.PutUint64(fk.Src[8*i:], w)
		}
		for i, w := range k.Dst {
			ne.PutUint64(fk.Dst[8*i:], w)
		}
		out[fk] = classifier.Target{Stream: v.StreamId, Rule: v.RuleId}
	}
	return out, nil
}

// readFlows reads both flow tables, keyed as this package keys flows.
func (p *Program) readFlows() (map[bpfFbFlowKey]bpfFbTarget, error) {
	out := map[bpfFbFlowKey]bpfFbTarget{}
	var (
		k4 bpfFbFlow4Key
		k  bpfFbFlowKey
		v  bpfFbTarget
	)
	it := p.objs.Flows4.Iterate()
	for it.Next(&k4, &v) {
		out[flowOf4(&k4)] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("ebpf: read IPv4 flows: %w", err)
	}
	it = p.objs.Flows.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("ebpf: read flows: %w", err)
	}
	return out, nil
}

// Update makes t the program's tables without a window in which a frame is
// classified by neither the old nor the new tables. The spread tables that
// are new go in first (spread.go), then new and changed flows and listeners
// (each map update is atomic; a listener's entry names its spread table),
// then the rule set is replaced whole by swapping its inner map, then stale
// flows and listeners are deleted. In every intermediate state a frame's
// first hit is one the old or the new tables would also give it: a stale
// entry can only be hit by frames the old tables sent there, and the rules
// are reached only when neither old nor new entries match.
//
// Update refuses tables with more than MaxSpreads distinct spreads, or a
// spread of more than MaxSpreadSlots slots, before it changes anything.
func (p *Program) Update(t *classifier.Tables) error {
	flows := map[bpfFbFlowKey]bpfFbTarget{}
	for k, v := range t.Flows() {
		flows[flowKey(k)] = target(v)
	}
	spreads, err := spreadsOf(t)
	if err != nil {
		return err
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	spreadIndex, err := p.installSpreads(spreads)
	if err != nil {
		return err
	}
	listeners := map[bpfFbListenKey]bpfFbListener{}
	for k, v := range t.Listeners() {
		key := bpfFbListenKey{Family: k.Family, Proto: k.Proto, Port: k.Port, Addr: words32(k.Addr)}
		listeners[key] = bpfFbListener{StreamId: v.Stream, RuleId: v.Rule, Spread: spreadIndex[k]}
	}
	if err := putChanged(p.putFlow, p.flows, flows, p.heldFlows); err != nil {
		return fmt.Errorf("ebpf: flows: %w", err)
	}
	if err := putChanged(p.putListener, p.listeners, listeners, p.heldListeners); err != nil {
		return fmt.Errorf("ebpf: listeners: %w", err)
	}
	if err := p.installRules(t.Rules()); err != nil {
		return err
	}
	if err := deleteStale(p.deleteFlow, p.flows, flows); err != nil {
		return fmt.Errorf("ebpf: flows: %w", err)
	}
	if err := deleteStale(p.deleteListener, p.listeners, listeners); err != nil {
		return fmt.Errorf("ebpf: listeners: %w", err)
	}
	p.releaseSpreads(spreads)
	return nil
}

// words64 and words32 put an address into the wide words the C structs hold
// it in, keeping its bytes in order in memory.
func words64(a classifier.Addr16) [2]uint64 {
	ne := binary.NativeEndian
	return [2]uint64{ne.Uint64(a[0:]), ne.Uint64(a[8:])}
}

func words32(a classifier.Addr16) [4]uint32 {
	ne := binary.NativeEndian
	return [4]uint32{ne.Uint32(a[0:]), ne.Uint32(a[4:]), ne.Uint32(a[8:]), ne.Uint32(a[12:])}
}

func target(t classifier.Target) bpfFbTarget {
	return bpfFbTarget{StreamId: t.Stream, RuleId: t.Rule}
}

// putListener and deleteListener are putFlow and deleteFlow for the one
// listeners table.
func (p *Program) putListener(k *bpfFbListenKey, v *bpfFbListener) error {
	return p.objs.Listeners.Put(k, v)
}

func (p *Program) deleteListener(k *bpfFbListenKey) error {
	return p.objs.Listeners.Delete(k)
}

// putChanged writes with put the entries of want that installed lacks or
// holds differently, and records them in installed; an entry written is no
// longer held.
func putChanged[K, V comparable](put func(*K, *V) error, installed, want map[K]V, held map[K]struct{}) error {
	for k, v := range want {
		if old, ok := installed[k]; ok && old == v {
			continue
		}
		if err := put(&k, &v); err != nil {
			return err
		}
		installed[k] = v
		delete(held, k)
	}
	return nil
}

// deleteStale removes with del the entries of installed that want lacks.
func deleteStale[K, V comparable](del func(*K) error, installed, want map[K]V) error {
	for k := range maps.Clone(installed) {
		if _, ok := want[k]; ok {
			continue
		}
		if err := del(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
		delete(installed, k)
	}
	return nil
}

func (p *Program) installRules(rules []classifier.CompiledRule) error {
	if len(rules) > classifier.MaxRules {
		return fmt.Errorf("ebpf: %d rules, at most %d", len(rules), classifier.MaxRules)
	}
	set := new(bpfFbRuleset)
	set.Count = uint32(len(rules))
	for i, r := range rules {
		set.Rules[i] = bpfFbRule{
			Id: r.ID, StreamId: r.Stream, Action: uint8(r.Action),
			Family: r.Family, Proto: r.Proto, Vlan: r.VLAN,
			SportLo: r.SrcPorts.Lo, SportHi: r.SrcPorts.Hi,
			DportLo: r.DstPorts.Lo, DportHi: r.DstPorts.Hi,
			SrcNet: words64(r.SrcNet), SrcMask: words64(r.SrcMask),
			DstNet: words64(r.DstNet), DstMask: words64(r.DstMask),
		}
	}
	inner, err := ebpf.NewMap(p.ruleSetSpec)
	if err != nil {
		return fmt.Errorf("ebpf: new rule map: %w", err)
	}
	// The outer map holds its own reference; ours goes when this returns.
	defer inner.Close()
	if err := inner.Put(uint32(0), set); err != nil {
		return fmt.Errorf("ebpf: fill rule map: %w", err)
	}
	if err := p.objs.Rulesets.Put(uint32(0), inner); err != nil {
		return fmt.Errorf("ebpf: swap rule map: %w", err)
	}
	return nil
}

// Counter is a packet and byte count.
type Counter struct {
	Packets, Bytes uint64
}

// Counters are the program's counters summed over CPUs.
type Counters struct {
	Verdicts       [classifier.NumVerdicts]Counter
	RedirectFailed uint64 // steered or ingested with no AF_XDP socket on the queue
	MetaFailed     uint64 // the driver left no room for metadata
	StripFailed    uint64 // an ingest frame could not be stripped (passed whole)
}

// Counters reads the per-verdict and event counters.
func (p *Program) Counters() (Counters, error) {
	var c Counters
	for v := range c.Verdicts {
		n, err := sumCounter(p.objs.VerdictCounters, uint32(v))
		if err != nil {
			return c, fmt.Errorf("ebpf: verdict counters: %w", err)
		}
		c.Verdicts[v] = n
	}
	for key, dst := range map[bpfFbEvent]*uint64{
		bpfFbEventFB_EVENT_REDIRECT_FAILED: &c.RedirectFailed,
		bpfFbEventFB_EVENT_META_FAILED:     &c.MetaFailed,
		bpfFbEventFB_EVENT_STRIP_FAILED:    &c.StripFailed,
	} {
		var per []uint64
		if err := p.objs.EventCounters.Lookup(uint32(key), &per); err != nil {
			return c, fmt.Errorf("ebpf: event counters: %w", err)
		}
		for _, n := range per {
			*dst += n
		}
	}
	return c, nil
}

// RuleCounter reads the counter of one flow, listener or rule id.
func (p *Program) RuleCounter(id uint32) (Counter, error) {
	if id == 0 || id > classifier.MaxRuleID {
		return Counter{}, fmt.Errorf("ebpf: rule id %d outside 1..%d", id, classifier.MaxRuleID)
	}
	return sumCounter(p.objs.RuleCounters, id)
}

// RuleCounters reads the counters of every id that has counted something.
//
// The table is a per-CPU array of every possible id, so it is read in
// batches (BPF_MAP_LOOKUP_BATCH, Linux 5.6). An element at a time it took
// two system calls per id, 32,768 in all: 81 ms of the daemon's CPU for
// every metrics scrape on a 2-vCPU VM, against 1.2 ms in batches
// (BenchmarkRuleCounters).
func (p *Program) RuleCounters() (map[uint32]Counter, error) {
	out := map[uint32]Counter{}
	err := readCounters(p.objs.RuleCounters, func(id uint32, c Counter) {
		if c.Packets != 0 {
			out[id] = c
		}
	})
	if err != nil {
		return nil, fmt.Errorf("ebpf: rule counters: %w", err)
	}
	return out, nil
}

// counterBatch is how many ids readCounters asks for at once.
const counterBatch = 1024

// readCounters calls f with every element of a per-CPU array of counters,
// summed over CPUs, in batches where the kernel offers them and an element
// at a time where it does not.
func readCounters(m *ebpf.Map, f func(uint32, Counter)) error {
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return err
	}
	keys := make([]uint32, counterBatch)
	per := make([]bpfFbCounter, counterBatch*ncpu)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, per, nil)
		for i := range n {
			f(keys[i], sumCPUs(per[i*ncpu:(i+1)*ncpu]))
		}
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
			return nil
		case errors.Is(err, ebpf.ErrNotSupported) && n == 0:
			return iterateCounters(m, f)
		case err != nil:
			return err
		}
	}
}

func iterateCounters(m *ebpf.Map, f func(uint32, Counter)) error {
	var (
		key uint32
		per []bpfFbCounter
	)
	it := m.Iterate()
	for it.Next(&key, &per) {
		f(key, sumCPUs(per))
	}
	return it.Err()
}

func sumCounter(m *ebpf.Map, key uint32) (Counter, error) {
	per := make([]bpfFbCounter, 0, runtime.NumCPU())
	if err := m.Lookup(key, &per); err != nil {
		return Counter{}, err
	}
	return sumCPUs(per), nil
}

func sumCPUs(per []bpfFbCounter) Counter {
	var sum Counter
	for _, c := range per {
		sum.Packets += c.Packets
		sum.Bytes += c.Bytes
	}
	return sum
}

// ResetFragments empties the fragment table.
func (p *Program) ResetFragments() error {
	var (
		key  bpfFbFragKey
		keys []bpfFbFragKey
		val  bpfFbFragResult
	)
	it := p.objs.Fragments.Iterate()
	for it.Next(&key, &val) {
		keys = append(keys, key)
	}
	if err := it.Err(); err != nil {
		return err
	}
	for _, k := range keys {
		if err := p.objs.Fragments.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}
