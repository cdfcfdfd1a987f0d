package userstack

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// A bridge box whose daemon hangs (stopped, or stuck) ends neither its
// control connection, which its kernel keeps open, nor a shared-memory
// stream, which stays mapped: the txPath would go on writing into a ring
// that nobody reads while the routers have long moved the traffic to the
// other boxes. A remote stream notices only after its PeerTimeout, a local
// one never. So each bridge of a stack of several is probed on its control
// connection, whose reads the daemon's own goroutine answers: a ping every
// probeInterval, and a bridge that has not answered within probeTimeout is
// passed over by the txPath until it answers again. The ring itself says
// less: an idle or lightly loaded ring is consumed as little as a hung one.
// A bridge slow to answer because its control plane is busy (a request
// ahead of the ping) is passed over for as long; its packets leave through
// another box of the group, which is no harm.
//
// What the txPath wrote into the hung bridge's ring before it was passed
// over, up to probeInterval plus probeTimeout (a second), is lost; TCP
// sends it again through the next bridge.
const (
	probeInterval = 250 * time.Millisecond
	probeTimeout  = 750 * time.Millisecond
)

// startProbes probes every bridge until the returned function, which
// waits for them to end, is called. ping is Options.ping.
func (b *bridgeSet) startProbes(ping func(context.Context, string, *control.Client) error) func() error {
	if ping == nil {
		ping = func(ctx context.Context, _ string, c *control.Client) error { return c.Ping(ctx) }
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range b.atts {
		wg.Go(func() { b.probe(ctx, i, ping) })
	}
	return func() error {
		cancel()
		wg.Wait()
		return nil
	}
}

// probe pings bridge i while it is attached, until ctx ends, and reports
// the changes of its answering.
func (b *bridgeSet) probe(ctx context.Context, i int, ping func(context.Context, string, *control.Client) error) {
	tick := time.NewTicker(probeInterval)
	defer tick.Stop()
	var since time.Time // when it stopped answering
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		// A bridge that is away keeps its flag: the txPath passes over it
		// anyway, and once it is back it must answer first.
		c, _ := b.atts[i].current()
		if c == nil {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		err := ping(pctx, b.names[i], c)
		cancel()
		if ctx.Err() != nil {
			return
		}
		hung := errors.Is(err, context.DeadlineExceeded)
		if err != nil && !hung {
			continue // the connection ended: the attachment's to report
		}
		if b.tx.unresponsive[i].Swap(hung) == hung {
			continue
		}
		if hung {
			since = time.Now()
			b.eventsOf(i)(Event{Kind: BridgeUnresponsive, Err: fmt.Errorf("userstack: no answer to a ping within %v", probeTimeout)})
		} else {
			b.eventsOf(i)(Event{Kind: BridgeResponsive, Down: time.Since(since)})
		}
	}
}
