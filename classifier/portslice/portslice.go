// Package portslice gives each instance of an application its own part of
// the reserved port range, for its outgoing connections, identically on
// every box.
//
// The return traffic of a connection an instance dialled may arrive at any
// box behind ECMP, and every box must steer it to that instance. If each
// instance picks its source ports only from blocks of the range assigned
// to it, every box can steer by destination port alone, with one rule per
// block, and no box needs to hear of each connection.
//
// The range is cut into fixed blocks; each block goes to the instance with
// the highest rendezvous hash of (seed, block, name) (maglev.NameHash). So the assignment
// depends only on the set of names, like a Maglev table, and an instance
// joining or leaving moves only the blocks it takes or gives up (about 1/n
// of them): the other instances keep the ports of their connections.
package portslice

import (
	"fmt"
	"slices"

	"github.com/fabricbridge/fabricbridge/classifier/maglev"
)

// Block is a run of ports [Lo, Hi].
type Block struct{ Lo, Hi uint16 }

func (b Block) String() string { return fmt.Sprintf("%d-%d", b.Lo, b.Hi) }

// Assignment maps the blocks of a port range to instances.
type Assignment struct {
	blocks []Block
	owner  []string // per block
}

// Assign cuts [lo, hi] into blocks of blockSize ports (the last one may be
// shorter) and gives each to an instance. Every instance needs at least
// one block; more blocks per instance spread them more evenly.
func Assign(instances []string, seed uint64, lo, hi uint16, blockSize int) (*Assignment, error) {
	if lo == 0 || hi < lo || blockSize < 1 {
		return nil, fmt.Errorf("portslice: bad range %d-%d or block size %d", lo, hi, blockSize)
	}
	names := slices.Clone(instances)
	slices.Sort(names)
	if len(names) != len(slices.Compact(slices.Clone(names))) {
		return nil, fmt.Errorf("portslice: an instance is listed twice")
	}
	a := &Assignment{}
	for p := int(lo); p <= int(hi); p += blockSize {
		a.blocks = append(a.blocks, Block{uint16(p), uint16(min(p+blockSize-1, int(hi)))})
	}
	if len(names) > len(a.blocks) {
		return nil, fmt.Errorf("portslice: %d instances but only %d blocks of %d ports in %d-%d", len(names), len(a.blocks), blockSize, lo, hi)
	}
	a.owner = make([]string, len(a.blocks))
	for i := range a.blocks {
		var best uint64
		for _, name := range names {
			if w := maglev.NameHash(seed, uint32(i), name); a.owner[i] == "" || w > best {
				a.owner[i], best = name, w
			}
		}
	}
	return a, nil
}

// Blocks returns the blocks of name, in port order.
func (a *Assignment) Blocks(name string) []Block {
	var out []Block
	for i, o := range a.owner {
		if o == name {
			out = append(out, a.blocks[i])
		}
	}
	return out
}

// Owner returns the instance whose block holds port, or "" if the port is
// outside the range.
func (a *Assignment) Owner(port uint16) string {
	for i, b := range a.blocks {
		if b.Lo <= port && port <= b.Hi {
			return a.owner[i]
		}
	}
	return ""
}

// Moved lists the blocks whose owner differs between a and b (assignments
// of the same range and block size), with their owner in a: the blocks
// whose return traffic must stay steered to the old owner until its
// connections from them end, and from which neither owner may open new
// connections meanwhile.
func Moved(a, b *Assignment) map[Block]string {
	out := map[Block]string{}
	for i := range a.blocks {
		if i < len(b.owner) && a.owner[i] != b.owner[i] {
			out[a.blocks[i]] = a.owner[i]
		}
	}
	return out
}
