package control

import (
	"fmt"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/portslice"
)

// This file gives each instance its own blocks of the reserved range for
// the connections it opens, and steers each block to its instance, so that
// return traffic reaches the instance through a box that never saw the
// connection (docs/scale-out.md, Outbound connections).
//
// The blocks are assigned over every registered instance of every
// application (named "app/instance"), not per application: a block rule
// matches on the destination port alone, so two applications' instances
// must never be given the same block.

// Block sizes: at least minBlockPorts ports, and at most maxBlocks blocks
// (so that the rules fit the classifier's MaxRules beside the static
// ones). Both follow from the reserved range alone, which every box of a
// cluster must have the same.
const (
	minBlockPorts = 8
	maxBlocks     = 256
)

// portSlices is the reserved range's blocks and who steers each.
type portSlices struct {
	assign *portslice.Assignment
	lo     uint16
	size   int // ports per block
	blocks []portslice.Block
	owner  []*app // per block, by the assignment
	// hold is, per block, the instance that owned it before the last
	// change and still has connections from its ports (nil: none). Such a
	// block stays steered to it, and neither it nor the new owner opens
	// connections from it, until those end.
	hold []*app
	ids  []uint32 // the block rules' ids
}

// instanceKey names an instance across applications.
func instanceKey(a *app) string { return a.name + "/" + a.instance }

// blockSize is the ports per block for the reserved range lo-hi.
func blockSize(lo, hi uint16) int {
	n := int(hi) - int(lo) + 1
	return max(minBlockPorts, (n+maxBlocks-1)/maxBlocks)
}

// reslice assigns the blocks anew after an instance came or went, keeping
// each moved block steered to its old owner while that has connections
// from it. With no instance, or no reserved range, there are no blocks.
// restore puts the previous assignment back. Call with mu held.
func (r *registry) reslice() (restore func(), err error) {
	old := r.slices
	restore = func() { r.slices = old }
	if r.ephemeral.IsAny() {
		return restore, nil
	}
	names := make([]string, 0, len(r.instances))
	for key := range r.instances {
		names = append(names, key)
	}
	if len(names) == 0 {
		r.slices = nil
		if old != nil {
			for _, id := range old.ids {
				r.usedIDs[id] = false
			}
			restore = func() {
				for _, id := range old.ids {
					r.usedIDs[id] = true
				}
				r.slices = old
			}
		}
		return restore, nil
	}
	lo, hi := r.ephemeral.Lo, r.ephemeral.Hi
	size := blockSize(lo, hi)
	assign, err := portslice.Assign(names, r.spread.Seed, lo, hi, size)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoPorts, err)
	}
	s := &portSlices{assign: assign, lo: lo, size: size}
	for p := int(lo); p <= int(hi); p += size {
		s.blocks = append(s.blocks, portslice.Block{Lo: uint16(p), Hi: uint16(min(p+size-1, int(hi)))})
	}
	s.owner = make([]*app, len(s.blocks))
	s.hold = make([]*app, len(s.blocks))
	for i, b := range s.blocks {
		s.owner[i] = r.instances[assign.Owner(b.Lo)]
	}
	if old != nil {
		s.ids = old.ids
		for i := range s.blocks {
			for _, was := range [...]*app{old.hold[i], old.owner[i]} {
				if was != nil && was != s.owner[i] && r.apps[was.stream] == was && r.holdsFlowsIn(was, i) {
					s.hold[i] = was
					break
				}
			}
		}
	} else {
		for range s.blocks {
			id, ok := r.allocID()
			if !ok {
				for _, id := range s.ids {
					r.usedIDs[id] = false
				}
				return nil, quotaErr(ReasonQuotaIDs, "no free rule ids for the reserved range's %d port blocks", len(s.blocks))
			}
			s.ids = append(s.ids, id)
		}
		restore = func() {
			for _, id := range s.ids {
				r.usedIDs[id] = false
			}
			r.slices = old
		}
	}
	r.slices = s
	return restore, nil
}

// block is the index of the block that holds port, if any.
func (s *portSlices) block(port uint16) (int, bool) {
	if port < s.lo {
		return 0, false
	}
	i := (int(port) - int(s.lo)) / s.size
	return i, i < len(s.blocks)
}

// usable reports whether instance a may open connections from block i: it
// owns the block and nobody else still has connections from it.
func (r *registry) usable(a *app, i int) bool {
	s := r.slices
	h := s.hold[i]
	return s.owner[i] == a && (h == nil || h == a || r.apps[h.stream] != h)
}

// usablePort is usable for the block of port.
func (r *registry) usablePort(a *app, port uint16) bool {
	i, ok := r.slices.block(port)
	return ok && r.usable(a, i)
}

// holdsFlowsIn reports whether a has a connection from a port of block i.
func (r *registry) holdsFlowsIn(a *app, i int) bool {
	b := r.slices.blocks[i]
	for p := int(b.Lo); p <= int(b.Hi); p++ {
		for _, proto := range [...]classifier.Protocol{classifier.ProtoTCP, classifier.ProtoUDP} {
			for _, c := range r.byPort[portKey{proto, uint16(p)}] {
				if c.stream == a.stream && !c.listener {
					return true
				}
			}
		}
	}
	return false
}

// unhold ends the hold of the block of c, a flow claim a gave up, when it
// was a's last connection from that block. The block's rule then steers
// to the new owner: rulesStale tells the delta paths to apply the tables.
// Call with mu held, after c is unindexed.
func (r *registry) unhold(a *app, c *claim) {
	if c.listener || a.instance == "" || r.slices == nil {
		return
	}
	if i, ok := r.slices.block(c.port); ok && r.slices.hold[i] == a && !r.holdsFlowsIn(a, i) {
		r.slices.hold[i] = nil
		r.rulesStale = true
	}
}

// instancePort takes a free port of proto from instance a's blocks,
// continuing after the last port given.
func (r *registry) instancePort(a *app, proto classifier.Protocol) (uint16, error) {
	s := r.slices
	pp := r.pools[proto]
	var mine []int
	for i := range s.blocks {
		if r.usable(a, i) {
			mine = append(mine, i)
		}
	}
	if len(mine) == 0 {
		return 0, fmt.Errorf("%w: instance %q has no block of the reserved range it may open connections from", ErrNoPorts, a.instance)
	}
	start := 0
	for k, i := range mine {
		if s.blocks[i].Hi > pp.cur {
			start = k
			break
		}
	}
	for k := range len(mine) + 1 {
		b := s.blocks[mine[(start+k)%len(mine)]]
		from := int(b.Lo)
		if k == 0 && pp.cur >= b.Lo && pp.cur < b.Hi {
			from = int(pp.cur) + 1
		}
		if pp.n > 0 {
			if q, ok := pp.from(from); ok && q <= int(b.Hi) {
				pp.cur = uint16(q)
				return uint16(q), nil
			}
		}
	}
	return 0, fmt.Errorf("%w: every %v port of instance %q's %d blocks of the reserved range is held", ErrNoPorts, proto, a.instance, len(mine))
}

// blockRules steer each block to its instance, or to the instance that
// still holds connections from it.
func (r *registry) blockRules() []classifier.Rule {
	s := r.slices
	if s == nil {
		return nil
	}
	out := make([]classifier.Rule, len(s.blocks))
	for i, b := range s.blocks {
		to := s.owner[i]
		if h := s.hold[i]; h != nil && r.apps[h.stream] == h {
			to = h
		}
		out[i] = classifier.Rule{ID: s.ids[i], Protocol: classifier.ProtoAny, DstPorts: classifier.PortRange{Lo: b.Lo, Hi: b.Hi},
			Action: classifier.ActionSteer, Stream: to.stream}
	}
	return out
}
