package fabric

import (
	"sync/atomic"
)

// creditGate is the sender's half of APEnet+-style flow control. The
// receiver periodically publishes how many packets it has consumed; the
// sender may have at most high packets outstanding, and once it hits high
// it stops until outstanding falls to low or below. The hysteresis keeps
// the sender from restarting for every single credit, and because credits
// are published ahead of need the sender rarely waits a round trip.
type creditGate struct {
	high, low uint32
	sent      uint32        // packets sent (sender goroutine only)
	acked     atomic.Uint32 // consumed count last published by the peer
	stopped   bool
}

// allowance is how many packets may be sent now.
func (g *creditGate) allowance() int {
	out := g.sent - g.acked.Load()
	if g.stopped {
		if out > g.low {
			return 0
		}
		g.stopped = false
	}
	if out >= g.high {
		g.stopped = true
		return 0
	}
	return int(g.high - out)
}

// update accepts a credit only if it lies between the last one and what
// was sent: a stale, replayed or forged value cannot open the window.
func (g *creditGate) update(consumed uint32, sent uint32) bool {
	old := g.acked.Load()
	if consumed-old > sent-old {
		return false
	}
	g.acked.Store(consumed)
	return true
}
