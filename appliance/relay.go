package appliance

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// farLink is what a relay needs of a remote application's stream:
// *fabric.RemoteStream, or in tests the application side of a shm pair.
type farLink interface {
	fabric.Link
	Tick()
	Health() fabric.Health
}

// relayBatch is how many packets one pump moves per round (the bridge's
// batch).
const relayBatch = 64

// relay serves a remote application's GENEVE stream through a local stream
// pair, because the bridge serves shared-memory streams only: the pair's
// bridge end goes to bridge.AddStream, and two pumps copy packets between
// the pair's application end and the remote stream, one goroutine each way,
// a batch at a time, into buffers allocated once. That costs one copy and
// one hand-off per packet more than a bridge that carried remote streams
// itself would.
//
// Backpressure passes through: a remote application without credit stops
// the outbound pump, so the bridge's ring into the pair fills and drops (and
// counts) as it would for a slow local application; a full pair TX ring
// stops the inbound pump, so the remote stream stops granting credit. When
// either side dies, both pumps end and both sides are closed: the remote
// application sees its stream broken, the bridge sees the pair's stream
// broken (its health says so) until the lease's end removes it.
type relay struct {
	far    farLink        // the remote application's stream
	near   *fabric.Stream // application end of the local pair
	bridge *fabric.Stream // bridge end of the local pair, served by the bridge

	pumps   sync.WaitGroup
	stopped sync.Once
	closed  sync.Once
	dropped atomic.Uint64 // packets one side carried that the other cannot (too big)
}

// newRelay makes the local pair, sized by cfg, for far. Nothing moves until
// start.
func newRelay(far farLink, cfg fabric.Config) (*relay, error) {
	bs, near, err := fabric.NewPair(cfg)
	if err != nil {
		return nil, err
	}
	return &relay{far: far, near: near, bridge: bs}, nil
}

// start runs the two pumps.
func (r *relay) start() {
	r.pumps.Add(2)
	go r.pump(r.far, r.near) // remote application -> bridge
	go r.pump(r.near, r.far) // bridge -> remote application
}

// pump moves packets from one side to the other until either fails.
func (r *relay) pump(from, to fabric.Link) {
	defer r.pumps.Done()
	defer r.stop()
	bufs := make([][]byte, relayBatch)
	for i := range bufs {
		bufs[i] = make([]byte, from.MaxPayload())
	}
	for {
		for i := range bufs {
			bufs[i] = bufs[i][:cap(bufs[i])]
		}
		n, err := from.Recv(bufs)
		if n > 0 && !r.forward(to, bufs[:n]) {
			return
		}
		if err != nil {
			return
		}
	}
}

// forward sends pkts, dropping and counting any that to refuses as too big
// (the rest still go); it reports false once to has failed.
func (r *relay) forward(to fabric.Link, pkts [][]byte) bool {
	for len(pkts) > 0 {
		n, err := to.Send(pkts)
		if err == nil {
			return true
		}
		if !errors.Is(err, fabric.ErrTooBig) || n >= len(pkts) {
			return false
		}
		r.dropped.Add(1)
		pkts = pkts[n+1:]
	}
	return true
}

// stop closes both sides the pumps use, which ends both pumps.
func (r *relay) stop() {
	r.stopped.Do(func() {
		r.far.Close()
		r.near.Close()
	})
}

// close ends the relay and releases the pair; the bridge must have let go
// of the bridge end first (bridge.RemoveStream). It returns once neither
// pump runs; calling it again does nothing.
func (r *relay) close() {
	r.closed.Do(func() {
		r.stop()
		r.pumps.Wait()
		r.bridge.Close()
	})
}

// health is the worse of the two streams' states.
func (r *relay) health() fabric.Health {
	return max(r.far.Health(), r.bridge.Health())
}

// tick ends a health interval on both streams.
func (r *relay) tick() {
	r.far.Tick()
	r.bridge.Tick()
}
