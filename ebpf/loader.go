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
	listeners map[bpfFbListenKey]bpfFbTarget
}

// Load loads the program and its maps into the kernel. The tables start empty:
// everything passes to the kernel until Update.
func Load() (*Program, error) { return load(false) }

// load is Load with the test hooks: testHooks has every classification
// copied to the last_meta map, and ingest frames stripped even when no
// socket is bound, so that a test run shows the stripped frame.
func load(testHooks bool) (*Program, error) {
	spec, err := loadBpf()
	if err != nil {
		return nil, err
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
	p := &Program{
		ruleSetSpec: inner.Copy(),
		flows:       map[bpfFbFlowKey]bpfFbTarget{},
		listeners:   map[bpfFbListenKey]bpfFbTarget{},
	}
	if err := spec.LoadAndAssign(&p.objs, nil); err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("ebpf: verifier refused the program: %+v", verr)
		}
		return nil, fmt.Errorf("ebpf: load: %w", err)
	}
	if err := p.installRules(nil); err != nil {
		p.objs.Close()
		return nil, err
	}
	return p, nil
}

// Close detaches the program if attached and releases it and its maps.
func (p *Program) Close() error {
	err := p.Detach()
	return errors.Join(err, p.objs.Close())
}

// Attach attaches the program to the interface. With ModeAuto it tries native
// mode first and falls back to generic; the mode it got is returned, because
// generic mode is much slower and users must know when they run in it.
func (p *Program) Attach(ifindex int, mode Mode) (Mode, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.attached != nil {
		return p.mode, fmt.Errorf("ebpf: already attached to ifindex %d", p.ifindex)
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
// leaves nothing attached behind it.
func (p *Program) Detach() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.attached == nil {
		return nil
	}
	err := p.attached.Close()
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

// Update makes t the program's tables without a window in which a frame is
// classified by neither the old nor the new tables. New and changed flows and
// listeners go in first (each map update is atomic), then the rule set is
// replaced whole by swapping its inner map, then stale flows and listeners are
// deleted. In every intermediate state a frame's first hit is one the old or
// the new tables would also give it: a stale entry can only be hit by frames
// the old tables sent there, and the rules are reached only when neither old
// nor new entries match.
func (p *Program) Update(t *classifier.Tables) error {
	flows := map[bpfFbFlowKey]bpfFbTarget{}
	for k, v := range t.Flows() {
		flows[bpfFbFlowKey{Family: k.Family, Proto: k.Proto, Sport: k.SrcPort, Dport: k.DstPort, Src: words64(k.Src), Dst: words64(k.Dst)}] = target(v)
	}
	listeners := map[bpfFbListenKey]bpfFbTarget{}
	for k, v := range t.Listeners() {
		listeners[bpfFbListenKey{Family: k.Family, Proto: k.Proto, Port: k.Port, Addr: words32(k.Addr)}] = target(v)
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	if err := putChanged(p.objs.Flows, p.flows, flows); err != nil {
		return fmt.Errorf("ebpf: flows: %w", err)
	}
	if err := putChanged(p.objs.Listeners, p.listeners, listeners); err != nil {
		return fmt.Errorf("ebpf: listeners: %w", err)
	}
	if err := p.installRules(t.Rules()); err != nil {
		return err
	}
	if err := deleteStale(p.objs.Flows, p.flows, flows); err != nil {
		return fmt.Errorf("ebpf: flows: %w", err)
	}
	if err := deleteStale(p.objs.Listeners, p.listeners, listeners); err != nil {
		return fmt.Errorf("ebpf: listeners: %w", err)
	}
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

// putChanged writes the entries of want that installed lacks or holds
// differently, and records them in installed.
func putChanged[K comparable](m *ebpf.Map, installed, want map[K]bpfFbTarget) error {
	for k, v := range want {
		if old, ok := installed[k]; ok && old == v {
			continue
		}
		if err := m.Put(&k, &v); err != nil {
			return err
		}
		installed[k] = v
	}
	return nil
}

// deleteStale removes the entries of installed that want lacks.
func deleteStale[K comparable](m *ebpf.Map, installed, want map[K]bpfFbTarget) error {
	for k := range maps.Clone(installed) {
		if _, ok := want[k]; ok {
			continue
		}
		if err := m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
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
func (p *Program) RuleCounters() (map[uint32]Counter, error) {
	out := map[uint32]Counter{}
	var (
		key uint32
		per []bpfFbCounter
	)
	it := p.objs.RuleCounters.Iterate()
	for it.Next(&key, &per) {
		if sum := sumCPUs(per); sum.Packets != 0 {
			out[key] = sum
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("ebpf: rule counters: %w", err)
	}
	return out, nil
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
