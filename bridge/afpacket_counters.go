package bridge

import (
	"sync/atomic"

	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
)

// afpCounters is what the reference classifier decided on one AF_PACKET
// queue, kept as the XDP program keeps its per-CPU maps (per verdict and
// per flow, listener or rule id), so the operator sees the same counters on
// either path. The queue's loop is the only writer, so it adds with a load
// and a store (no locked instruction per frame); readers on other threads
// load atomically and see whole values.
type afpCounters struct {
	verdicts [classifier.NumVerdicts]atomicCounter
	rules    [classifier.MaxRuleID + 1]atomicCounter
}

type atomicCounter struct{ packets, bytes atomic.Uint64 }

// add is for the counter's single writer.
func (c *atomicCounter) add(n int) {
	c.packets.Store(c.packets.Load() + 1)
	c.bytes.Store(c.bytes.Load() + uint64(n))
}

func (c *afpCounters) count(m *classifier.Meta, n int) {
	if m.Verdict < classifier.NumVerdicts {
		c.verdicts[m.Verdict].add(n)
	}
	if m.RuleID != 0 && m.RuleID <= classifier.MaxRuleID {
		c.rules[m.RuleID].add(n)
	}
}

// VerdictCounters are the classifier's counters per verdict, and its
// events: the XDP program's (ebpf.Program.Counters) or, on the AF_PACKET
// path, the reference classifier's summed over queues, in the same shape
// (the events stay zero: they are XDP's).
func (b *Bridge) VerdictCounters() (c fbebpf.Counters, err error) {
	if b.prog != nil {
		return b.prog.Counters()
	}
	for _, ar := range b.afpacket().rxs {
		for v := range ar.counts.verdicts {
			c.Verdicts[v].Packets += ar.counts.verdicts[v].packets.Load()
			c.Verdicts[v].Bytes += ar.counts.verdicts[v].bytes.Load()
		}
	}
	return c, nil
}

// RuleCounters are the classifier's counters per flow, listener and rule
// id, as VerdictCounters are per verdict; ids that matched nothing are
// left out.
func (b *Bridge) RuleCounters() (map[uint32]fbebpf.Counter, error) {
	if b.prog != nil {
		return b.prog.RuleCounters()
	}
	rules := map[uint32]fbebpf.Counter{}
	for _, ar := range b.afpacket().rxs {
		for id := range ar.counts.rules {
			if p := ar.counts.rules[id].packets.Load(); p != 0 {
				r := rules[uint32(id)]
				r.Packets += p
				r.Bytes += ar.counts.rules[id].bytes.Load()
				rules[uint32(id)] = r
			}
		}
	}
	return rules, nil
}

// afpacket is the AF_PACKET path's shared state, empty on the XDP paths.
func (b *Bridge) afpacket() *afpShared {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.afp == nil {
		return &afpShared{}
	}
	return b.afp
}
