// Package maglev builds Maglev consistent-hash lookup tables (Eisenbud et al.,
// NSDI 2016) that spread the new connections of one listener over the
// instances of its application.
//
// Every box of a cluster must send a given flow to the same instance, or a
// connection that ECMP moves from one box to another lands on an instance
// that has never heard of it. So a table depends only on its inputs: the
// set of instance names (their order does not matter), a seed and a size.
// Two boxes that agree on those build byte-identical tables, with no
// exchange between them.
//
//	t, err := maglev.New([]string{"web-b", "web-a"}, 7, maglev.DefaultSize)
//	owner := t.Owner(flowHash) // "web-a" or "web-b"
//
// A Transition pairs the table before a membership change with the one
// after, giving each slot its previous owner too: the "second chance" that
// keeps established connections where they are (docs/scale-out.md).
package maglev

import (
	"encoding/binary"
	"fmt"
	"math/big"
	"net/netip"
	"slices"
)

// DefaultSize is the table size for up to 655 instances: a prime, so that
// every instance's probe sequence visits every slot, and at least 100 times
// the instance count, which bounds the imbalance between instances to about
// 1 % (the paper's recommendation).
const DefaultSize = 65537

// MaxSize bounds a table to 16 MiB of slots; tables are built on every
// membership change and copied into the data plane.
const MaxSize = 1<<22 - 3 // 4,194,301, the largest prime below 2^22

// minRatio is how many slots each instance needs at least, for balance.
const minRatio = 100

// NoOwner is what Index returns for a table with no instances.
const NoOwner = -1

// Table maps a flow hash to one of a sorted list of instances.
type Table struct {
	instances []string
	slots     []int32 // index into instances, per slot
	seed      uint64
}

// New builds the table of instances (names must be unique and non-empty) for
// seed, with size slots. size must be a prime of at least 100 times the
// number of instances; DefaultSize fits up to 655 instances. An empty
// instance list gives a table whose every slot has NoOwner.
func New(instances []string, seed uint64, size int) (*Table, error) {
	if size < 2 || size > MaxSize || !big.NewInt(int64(size)).ProbablyPrime(0) {
		return nil, fmt.Errorf("maglev: table size %d is not a prime between 2 and %d", size, MaxSize)
	}
	sorted := slices.Clone(instances)
	slices.Sort(sorted)
	for i, name := range sorted {
		if name == "" {
			return nil, fmt.Errorf("maglev: an instance has an empty name")
		}
		if i > 0 && sorted[i-1] == name {
			return nil, fmt.Errorf("maglev: instance %q is listed twice", name)
		}
	}
	if len(sorted) > 0 && size/len(sorted) < minRatio {
		return nil, fmt.Errorf("maglev: %d slots for %d instances; a balanced table needs at least %d",
			size, len(sorted), minRatio*len(sorted))
	}
	t := &Table{instances: sorted, slots: make([]int32, size), seed: seed}
	t.populate()
	return t, nil
}

// populate is the paper's algorithm: instances take turns claiming the next
// free slot of their own permutation of the table, so each gets size/n
// slots, give or take one, and a change of one instance disturbs little
// more than that instance's share.
func (t *Table) populate() {
	size := uint64(len(t.slots))
	for i := range t.slots {
		t.slots[i] = NoOwner
	}
	n := len(t.instances)
	if n == 0 {
		return
	}
	offset := make([]uint64, n)
	skip := make([]uint64, n)
	next := make([]uint64, n) // how far along its permutation each instance is
	for i, name := range t.instances {
		offset[i] = NameHash(t.seed, 0, name) % size
		skip[i] = NameHash(t.seed, 1, name)%(size-1) + 1
	}
	for filled := uint64(0); ; {
		for i := range n {
			slot := (offset[i] + next[i]*skip[i]) % size
			for t.slots[slot] != NoOwner {
				next[i]++
				slot = (offset[i] + next[i]*skip[i]) % size
			}
			t.slots[slot] = int32(i)
			next[i]++
			if filled++; filled == size {
				return
			}
		}
	}
}

// NameHash is the hash every consistent assignment of this module derives
// from an instance's name, the seed and a salt (a Maglev table: 0 for an
// instance's offset, 1 for its skip; portslice: the block number). It is
// FNV-1a followed by SplitMix64's finaliser: fixed, so that every box and
// every version of fabricbridge agrees, and well mixed, so that similar
// names ("web-1", "web-2") get unrelated values.
func NameHash(seed uint64, salt uint32, name string) uint64 {
	const (
		fnvOffset = 14695981039346656037
		fnvPrime  = 1099511628211
	)
	h := uint64(fnvOffset)
	var prefix [12]byte
	binary.LittleEndian.PutUint64(prefix[:8], seed)
	binary.LittleEndian.PutUint32(prefix[8:], salt)
	for _, b := range prefix {
		h = (h ^ uint64(b)) * fnvPrime
	}
	for i := 0; i < len(name); i++ {
		h = (h ^ uint64(name[i])) * fnvPrime
	}
	return mix64(h)
}

// mix64 is SplitMix64's finaliser.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Size is the number of slots.
func (t *Table) Size() int { return len(t.slots) }

// Seed is the seed the table was built with.
func (t *Table) Seed() uint64 { return t.seed }

// Instances returns the instance names, sorted; Index's results index it.
func (t *Table) Instances() []string { return slices.Clone(t.instances) }

// Slot is the slot a flow hash falls in.
func (t *Table) Slot(flowHash uint64) int { return int(flowHash % uint64(len(t.slots))) }

// Index returns the position in Instances of the owner of flowHash, or
// NoOwner if the table is empty.
func (t *Table) Index(flowHash uint64) int { return int(t.slots[t.Slot(flowHash)]) }

// Owner returns the name of the instance that owns flowHash, or "" if the
// table is empty.
func (t *Table) Owner(flowHash uint64) string {
	if i := t.Index(flowHash); i != NoOwner {
		return t.instances[i]
	}
	return ""
}

// SlotOwner returns the name of the instance that owns slot, or "".
func (t *Table) SlotOwner(slot int) string {
	if i := t.slots[slot]; i != NoOwner {
		return t.instances[i]
	}
	return ""
}

// Counts returns how many slots each instance owns, by name.
func (t *Table) Counts() map[string]int {
	counts := make(map[string]int, len(t.instances))
	for _, i := range t.slots {
		if i != NoOwner {
			counts[t.instances[i]]++
		}
	}
	return counts
}

// Moved returns the fraction of slots whose owner differs between a and b,
// which must have the same size. After one instance of n joins or leaves,
// the ideal is 1/n (or 1/(n+1)): only the slots that instance gains or loses.
func Moved(a, b *Table) float64 {
	if len(a.slots) != len(b.slots) {
		panic("maglev: Moved on tables of different sizes")
	}
	moved := 0
	for s := range a.slots {
		if a.SlotOwner(s) != b.SlotOwner(s) {
			moved++
		}
	}
	return float64(moved) / float64(len(a.slots))
}

// FlowHash is the hash that picks a connection's slot: of the protocol, the
// source and destination addresses (IPv4 as IPv4-mapped IPv6, so that one
// function serves both) and ports of its packets towards the service.
// Every box must compute the same value for the same connection, which
// rules out the kernel's skb hash (seeded per boot); this one is fixed,
// and simple enough for the XDP program to compute identically: each
// 64-bit word of the tuple is folded in with a multiply and SplitMix64's
// finaliser.
func FlowHash(seed uint64, proto uint8, src, dst netip.Addr, srcPort, dstPort uint16) uint64 {
	s, d := src.As16(), dst.As16()
	return FlowHash16(seed, proto, &s, &d, srcPort, dstPort)
}

// FlowHash16 is FlowHash on addresses in their 16-byte form (IPv4 as
// IPv4-mapped IPv6), for callers that hold the bytes.
func FlowHash16(seed uint64, proto uint8, src, dst *[16]byte, srcPort, dstPort uint16) uint64 {
	h := mix64(seed ^ uint64(proto)<<32 ^ uint64(srcPort)<<16 ^ uint64(dstPort))
	for _, w := range [4]uint64{
		binary.BigEndian.Uint64(src[:8]), binary.BigEndian.Uint64(src[8:]),
		binary.BigEndian.Uint64(dst[:8]), binary.BigEndian.Uint64(dst[8:]),
	} {
		h = mix64(h ^ w*0x9e3779b97f4a7c15)
	}
	return h
}
