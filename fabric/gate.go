package fabric

import (
	"sync"
	"sync/atomic"
)

// gate guards one direction of a Stream (its Send side or its receive
// side). It does what a sync.Mutex and a packet counter did before, with
// fewer locked instructions on the path of an uncontended call:
//
//   - one word holds the packet count of the direction (in the bits above
//     gateShift) and the flags: busy (a caller is inside), waiter (a
//     contending caller waits to be poked), closed, broken;
//   - entering is one load and one compare-and-swap that sets busy, and
//     fails at once if the stream is closed or broken, so the state check
//     is the same load;
//   - leaving is one atomic add that clears busy and adds the packets the
//     call moved: counter and unlock in one instruction.
//
// A sync.Mutex plus an atomic counter cost three locked instructions per
// call (lock, unlock, count); the gate costs two. Contention (two
// goroutines sending on one stream at once, or Close waiting for a caller
// to leave) takes the slow path: contenders queue on q, the one at its
// head sets waiter and sleeps on wake, and a caller that leaves with
// waiter set pokes wake. Close sets closed (new entries fail at once),
// pokes wake (a queued contender then sees closed and gives up), and then
// enters the gate itself and never leaves it, which is what makes
// unmapping the region safe: nobody can be inside, nobody can enter.
type gate struct {
	w    atomic.Uint64
	q    sync.Mutex    // contended entries, one at a time
	wake chan struct{} // capacity 1; a poke for the contender at q's head
}

const (
	gateBusy   = 1 << 0
	gateWaiter = 1 << 1
	gateClosed = 1 << 2
	gateBroken = 1 << 3
	gateShift  = 4 // the count lives above the flags: 2^60 packets
	gateDead   = gateClosed | gateBroken
)

func (g *gate) init() { g.wake = make(chan struct{}, 1) }

// enter lets the caller in unless the stream is closed or broken (then it
// returns false). It waits while another caller is inside.
func (g *gate) enter() bool {
	w := g.w.Load()
	if w&(gateBusy|gateDead) == 0 && g.w.CompareAndSwap(w, w|gateBusy) {
		return true
	}
	return g.enterSlow(gateDead)
}

// enterSlow waits for the gate to be free; it gives up (false) as soon as
// any bit of stop is set.
func (g *gate) enterSlow(stop uint64) bool {
	g.q.Lock()
	defer g.q.Unlock()
	for {
		w := g.w.Load()
		switch {
		case w&stop != 0:
			return false
		case w&gateBusy == 0:
			// Taking the gate clears waiter: only q's holder ever waits
			// on wake, and that is us.
			if g.w.CompareAndSwap(w, (w|gateBusy)&^gateWaiter) {
				return true
			}
		case w&gateWaiter != 0 || g.w.CompareAndSwap(w, w|gateWaiter):
			// The holder's leave (or Close) comes after our flag and pokes
			// wake; a stale poke only makes us look again.
			<-g.wake
		}
	}
}

// leave lets the next caller in and adds n to the direction's count.
func (g *gate) leave(n int) {
	if g.w.Add(uint64(n)<<gateShift-gateBusy)&gateWaiter != 0 {
		g.poke()
	}
}

// add counts n packets without leaving (a caller about to wait long).
func (g *gate) add(n int) {
	if n > 0 {
		g.w.Add(uint64(n) << gateShift)
	}
}

func (g *gate) poke() {
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// count is the number of packets this direction has moved.
func (g *gate) count() uint64 { return g.w.Load() >> gateShift }

// mark sets a state flag (gateClosed or gateBroken) and wakes a queued
// contender so that it sees it.
func (g *gate) mark(flag uint64) {
	g.w.Or(flag)
	g.poke()
}

// seal waits until no caller is inside, then keeps the gate busy for
// good. The caller has set gateClosed first, so no new caller gets in.
func (g *gate) seal() { g.enterSlow(0) }
