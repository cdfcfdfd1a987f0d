package ebpf

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// Spread tables (classifier.Spread) in the kernel.
//
// Each distinct spread of a Tables is one inner map of the spreads map,
// found by content: listeners with equal spreads (a wildcard listener's two
// families, or listeners of one application on several ports that share a
// seed) share a table, and an Update that leaves a spread as it was writes
// nothing. A changed spread is a new table under a fresh index, filled
// before the listener entry moves to it in one atomic update; the old table
// stays through the next Update, for frames that read the listener entry
// just before it moved, and its index is reused no sooner than the Update
// after that (FB_SPREAD_INDICES).

const (
	// MaxSpreads is how many distinct spreads the program holds: each is
	// an array of MaxSpreadSlots slots, half a megabyte of kernel memory.
	MaxSpreads = int(bpfFbLimitFB_MAX_SPREADS)
	// MaxSpreadSlots is the most slots a spread may have in the kernel,
	// maglev.DefaultSize; package classifier allows more.
	MaxSpreadSlots = int(bpfFbLimitFB_MAX_SPREAD_SLOTS)
)

// spreadSum names a spread's content: its seed and slots.
type spreadSum [sha256.Size]byte

// spreadState is what Program keeps of its spread tables.
type spreadState struct {
	// spec makes a fresh inner map for every new table.
	spec *ebpf.MapSpec
	// index holds the installed tables by content.
	index map[spreadSum]uint32
	// lingering are the indices of tables the last Update let go of.
	lingering []uint32
}

// wantedSpreads is the spreads of one Tables: the sum of each listener's
// spread, and one spread of each sum.
type wantedSpreads struct {
	byKey map[classifier.ListenKey]spreadSum
	bySum map[spreadSum]*classifier.Spread
}

// spreadsOf sums the spreads of t's listeners and checks that the kernel
// can hold them.
func spreadsOf(t *classifier.Tables) (wantedSpreads, error) {
	w := wantedSpreads{byKey: map[classifier.ListenKey]spreadSum{}, bySum: map[spreadSum]*classifier.Spread{}}
	seen := map[*classifier.Spread]spreadSum{} // a wildcard listener's families share one
	for k := range t.Listeners() {
		sp := t.Spread(k)
		if sp == nil {
			continue
		}
		sum, ok := seen[sp]
		if !ok {
			if n := len(sp.Slots); n == 0 || n > MaxSpreadSlots {
				return w, fmt.Errorf("ebpf: a spread of %d slots, want 1..%d", n, MaxSpreadSlots)
			}
			sum = sumSpread(sp)
			seen[sp] = sum
		}
		w.byKey[k] = sum
		w.bySum[sum] = sp
	}
	if len(w.bySum) > MaxSpreads {
		return w, fmt.Errorf("ebpf: %d distinct listener spreads, at most %d", len(w.bySum), MaxSpreads)
	}
	return w, nil
}

func sumSpread(sp *classifier.Spread) spreadSum {
	h := sha256.New()
	var buf [4096]byte
	b := binary.LittleEndian.AppendUint64(buf[:0], sp.Seed)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(sp.Slots)))
	for _, s := range sp.Slots {
		if len(b)+8 > len(buf) {
			h.Write(b)
			b = buf[:0]
		}
		b = binary.LittleEndian.AppendUint32(b, s.Current)
		b = binary.LittleEndian.AppendUint32(b, s.Previous)
	}
	h.Write(b)
	return spreadSum(h.Sum(nil))
}

// installSpreads clears the tables lingering from the Update before last's
// changes and installs the tables of w that are not in the kernel yet. It
// returns the index of every listener key's table.
func (p *Program) installSpreads(w wantedSpreads) (map[classifier.ListenKey]uint32, error) {
	st := &p.spreads
	resting := map[uint32]bool{}
	for _, i := range st.lingering {
		if err := p.objs.Spreads.Delete(i); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, fmt.Errorf("ebpf: clear spread %d: %w", i, err)
		}
		resting[i] = true
	}
	st.lingering = nil
	used := map[uint32]bool{}
	for _, i := range st.index {
		used[i] = true
	}
	next := uint32(1)
	var table *bpfFbSpread // half a megabyte: one per Update, reused
	for sum, sp := range w.bySum {
		if _, ok := st.index[sum]; ok {
			continue
		}
		for used[next] || resting[next] {
			next++
		}
		if next >= uint32(bpfFbLimitFB_SPREAD_INDICES) {
			return nil, fmt.Errorf("ebpf: no free spread index") // FB_SPREAD_INDICES forbids it
		}
		if table == nil {
			table = new(bpfFbSpread)
		}
		if err := p.putSpread(next, table, sp); err != nil {
			return nil, err
		}
		st.index[sum] = next
		used[next] = true
	}
	out := make(map[classifier.ListenKey]uint32, len(w.byKey))
	for k, sum := range w.byKey {
		out[k] = st.index[sum]
	}
	return out, nil
}

// putSpread fills a new inner map with sp, table serving as the buffer, and
// puts it under index.
func (p *Program) putSpread(index uint32, table *bpfFbSpread, sp *classifier.Spread) error {
	table.Seed, table.Nslots = sp.Seed, uint32(len(sp.Slots))
	for i, s := range sp.Slots {
		table.Slots[i] = bpfFbSlot{Current: s.Current, Previous: s.Previous}
	}
	inner, err := ebpf.NewMap(p.spreads.spec)
	if err != nil {
		return fmt.Errorf("ebpf: new spread map: %w", err)
	}
	// The outer map holds its own reference; ours goes when this returns.
	defer inner.Close()
	if err := inner.Put(uint32(0), table); err != nil {
		return fmt.Errorf("ebpf: fill spread map: %w", err)
	}
	if err := p.objs.Spreads.Put(index, inner); err != nil {
		return fmt.Errorf("ebpf: put spread map: %w", err)
	}
	return nil
}

// releaseSpreads lets go of the installed tables w does not hold, once no
// listener entry points to them any more.
func (p *Program) releaseSpreads(w wantedSpreads) {
	st := &p.spreads
	for sum, i := range st.index {
		if _, ok := w.bySum[sum]; !ok {
			delete(st.index, sum)
			st.lingering = append(st.lingering, i)
		}
	}
}

// forgetSpreads clears every index of adopted spread tables: hold has
// pointed every listener entry that named one at none.
func (p *Program) forgetSpreads() error {
	clear(p.spreads.index)
	p.spreads.lingering = nil
	for i := uint32(1); i < uint32(bpfFbLimitFB_SPREAD_INDICES); i++ {
		if err := p.objs.Spreads.Delete(i); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("ebpf: clear adopted spread %d: %w", i, err)
		}
	}
	return nil
}
