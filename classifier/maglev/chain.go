package maglev

import (
	"fmt"
	"slices"
)

// Chain is a table together with, for every slot, the owner the slot had
// before it last changed hands: Beamer's "daisy chain" of length one.
//
// A packet that opens a connection goes to the current owner. Any other
// packet goes to the current owner too; if that instance does not know the
// connection, it gets a second chance at the previous owner, which may
// have accepted it before the change. Every box derives the same chain
// from the same sequence of tables, so it does not matter which box ECMP
// picks, and no box keeps or exchanges per-connection state.
//
// A connection survives one change of its slot's owner. A slot that
// changes twice before the connection ends forgets the first owner: with
// Maglev each change moves only about 1/n of the slots, so that takes two
// changes hitting the same slot during one connection's life.
type Chain struct {
	current  *Table
	previous []string // per slot; "" where the slot has not changed hands
}

// NewChain starts a chain at t, with no previous owners.
func NewChain(t *Table) *Chain {
	return &Chain{current: t, previous: make([]string, t.Size())}
}

// Advance returns the chain after a membership change to next, which must
// have the chain's size. A slot whose owner changes remembers the owner it
// had; a slot that keeps its owner keeps what it remembered. c is not
// changed, so a data plane can keep using it until it switches over.
func (c *Chain) Advance(next *Table) (*Chain, error) {
	if next.Size() != c.current.Size() {
		return nil, fmt.Errorf("maglev: a chain of %d slots cannot advance to a table of %d", c.current.Size(), next.Size())
	}
	out := &Chain{current: next, previous: make([]string, next.Size())}
	for s := range out.previous {
		was, now := c.current.SlotOwner(s), next.SlotOwner(s)
		if was != now {
			out.previous[s] = was
		} else {
			out.previous[s] = c.previous[s]
		}
	}
	return out, nil
}

// AdvanceWithout is Advance for a change in which the instances gone left
// for good (died, or drained to their deadline): they hold no connection,
// so a slot that passes from one of them keeps the previous owner it had
// before — whose connections may well be alive, a drained instance's say
// — rather than remembering an owner with nothing to find; and gone are
// forgotten as previous owners everywhere.
func (c *Chain) AdvanceWithout(next *Table, gone ...string) (*Chain, error) {
	if next.Size() != c.current.Size() {
		return nil, fmt.Errorf("maglev: a chain of %d slots cannot advance to a table of %d", c.current.Size(), next.Size())
	}
	out := &Chain{current: next, previous: make([]string, next.Size())}
	for s := range out.previous {
		was, now := c.current.SlotOwner(s), next.SlotOwner(s)
		prev := c.previous[s]
		if was != now && !slices.Contains(gone, was) {
			prev = was
		}
		if slices.Contains(gone, prev) {
			prev = ""
		}
		out.previous[s] = prev
	}
	return out, nil
}

// Forget returns the chain without name as a previous owner: once an
// instance has died, or has drained and passed its deadline, it holds no
// connection that a second chance could find.
func (c *Chain) Forget(name string) *Chain {
	out := &Chain{current: c.current, previous: make([]string, len(c.previous))}
	for s, p := range c.previous {
		if p != name {
			out.previous[s] = p
		}
	}
	return out
}

// Table is the chain's current table.
func (c *Chain) Table() *Table { return c.current }

// Lookup returns the instance that gets a packet of flowHash first, and the
// one that gets its second chance ("" if there is none). previous is never
// equal to current.
func (c *Chain) Lookup(flowHash uint64) (current, previous string) {
	s := c.current.Slot(flowHash)
	current, previous = c.current.SlotOwner(s), c.previous[s]
	if previous == current {
		previous = ""
	}
	return current, previous
}
