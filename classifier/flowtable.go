package classifier

import (
	"fmt"
	"hash/maphash"
	"iter"
	"sync"
	"sync/atomic"
)

// flowTable is the exact-flow table of Tables. Flows come and go one at a
// time (an application's connect and close), while every receive loop looks
// them up, so lookups take no lock and never allocate, and an add or remove
// costs the same whatever the number of flows: open addressing with linear
// probing over atomic pointers to immutable entries. A removed entry leaves
// a tombstone, so that a probe chain a reader is walking never breaks; the
// table is rebuilt into a fresh slot array (readers keep the old one until
// their lookup ends) when entries and tombstones fill three quarters of it.
type flowTable struct {
	mu    sync.Mutex // writers
	cur   atomic.Pointer[flowSlots]
	live  int // entries
	taken int // entries and tombstones
}

type flowSlots struct {
	seed maphash.Seed
	mask uint64
	slot []atomic.Pointer[flowEntry]
}

type flowEntry struct {
	key    FlowKey
	target Target
}

// tombstone marks a slot whose entry was removed.
var tombstone = new(flowEntry)

const minFlowSlots = 16

func newFlowTable(n int) *flowTable {
	t := &flowTable{}
	t.cur.Store(newFlowSlots(n))
	return t
}

// newFlowSlots has room for n entries at most half full.
func newFlowSlots(n int) *flowSlots {
	size := minFlowSlots
	for size < 2*n {
		size *= 2
	}
	return &flowSlots{seed: maphash.MakeSeed(), mask: uint64(size - 1), slot: make([]atomic.Pointer[flowEntry], size)}
}

func (s *flowSlots) home(k *FlowKey) uint64 {
	var b [38]byte
	b[0], b[1] = k.Family, k.Proto
	b[2], b[3] = byte(k.SrcPort), byte(k.SrcPort>>8)
	b[4], b[5] = byte(k.DstPort), byte(k.DstPort>>8)
	copy(b[6:], k.Src[:])
	copy(b[22:], k.Dst[:])
	return maphash.Bytes(s.seed, b[:]) & s.mask
}

// find returns the entry of k, if there is one.
func (s *flowSlots) find(k *FlowKey) (*flowEntry, bool) {
	for i := s.home(k); ; i = (i + 1) & s.mask {
		e := s.slot[i].Load()
		if e == nil {
			return nil, false
		}
		if e != tombstone && e.key == *k {
			return e, true
		}
	}
}

func (t *flowTable) lookup(k *FlowKey) (Target, bool) {
	if e, ok := t.cur.Load().find(k); ok {
		return e.target, true
	}
	return Target{}, false
}

// put adds or replaces k's entry.
func (t *flowTable) put(k FlowKey, v Target) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if (t.taken+1)*4 > len(t.cur.Load().slot)*3 {
		t.rebuild(t.live + 1)
	}
	s := t.cur.Load()
	free := int64(-1)
	for i := s.home(&k); ; i = (i + 1) & s.mask {
		e := s.slot[i].Load()
		switch {
		case e == tombstone:
			if free < 0 {
				free = int64(i)
			}
			continue
		case e == nil:
			if free < 0 {
				free = int64(i)
				t.taken++
			}
			s.slot[free].Store(&flowEntry{key: k, target: v})
			t.live++
			return
		case e.key == k:
			s.slot[i].Store(&flowEntry{key: k, target: v})
			return
		}
	}
}

// remove deletes k's entry and reports whether there was one.
func (t *flowTable) remove(k FlowKey) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.cur.Load()
	for i := s.home(&k); ; i = (i + 1) & s.mask {
		e := s.slot[i].Load()
		if e == nil {
			return false
		}
		if e != tombstone && e.key == k {
			s.slot[i].Store(tombstone)
			t.live--
			return true
		}
	}
}

// rebuild moves the live entries into a fresh slot array with room for
// want entries, leaving the tombstones behind. Amortised over the adds
// that filled the old array, it keeps an add O(1).
func (t *flowTable) rebuild(want int) {
	old := t.cur.Load()
	s := newFlowSlots(want)
	for i := range old.slot {
		e := old.slot[i].Load()
		if e == nil || e == tombstone {
			continue
		}
		j := s.home(&e.key)
		for s.slot[j].Load() != nil {
			j = (j + 1) & s.mask
		}
		s.slot[j].Store(e)
	}
	t.taken = t.live
	t.cur.Store(s)
}

func (t *flowTable) all() iter.Seq2[FlowKey, Target] {
	return func(yield func(FlowKey, Target) bool) {
		s := t.cur.Load()
		for i := range s.slot {
			e := s.slot[i].Load()
			if e == nil || e == tombstone {
				continue
			}
			if !yield(e.key, e.target) {
				return
			}
		}
	}
}

func (t *flowTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.live
}

// AddFlow makes f steer in t at once, for every Classifier over t and every
// reader of Flows: the delta a flow claim makes, without compiling the
// tables again. A flow of the same tuple is replaced. Flows changed this
// way are t's own: a Compile of the same rule set gives equal tables.
func (t *Tables) AddFlow(f Flow) error {
	if errs := f.check("flow"); len(errs) > 0 {
		return errs[0]
	}
	t.flows.put(f.Key(), Target{Stream: f.Stream, Rule: f.ID})
	return nil
}

// RemoveFlow stops f's tuple steering in t and reports whether it did.
func (t *Tables) RemoveFlow(f Flow) bool { return t.flows.remove(f.Key()) }

// NumFlows is the number of exact flows in t.
func (t *Tables) NumFlows() int { return t.flows.len() }

// check reports what is wrong with f on its own (not whether its tuple is
// another flow's).
func (f Flow) check(what string) []error {
	var errs []error
	if f.ID == 0 || f.ID > MaxRuleID {
		errs = append(errs, fmt.Errorf("%s: id %d outside 1..%d", what, f.ID, MaxRuleID))
	}
	if f.Protocol != ProtoTCP && f.Protocol != ProtoUDP {
		errs = append(errs, fmt.Errorf("%s: protocol must be tcp or udp, not %v", what, f.Protocol))
	}
	if !f.Remote.IsValid() || !f.Local.IsValid() {
		errs = append(errs, fmt.Errorf("%s: remote and local must both be address:port", what))
	} else if f.Remote.Addr().Is4() != f.Local.Addr().Is4() {
		errs = append(errs, fmt.Errorf("%s: remote %v and local %v are of different families", what, f.Remote, f.Local))
	}
	if f.Stream == 0 {
		errs = append(errs, fmt.Errorf("%s: stream must not be 0", what))
	}
	return errs
}
