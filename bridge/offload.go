package bridge

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge/offload"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// OffloadConfig tunes the engine StartOffload runs. Zero fields take
// package offload's defaults.
type OffloadConfig struct {
	// BusyPoll, if positive, turns on busy polling on the engine's AF_XDP
	// sockets (the XDP paths only).
	BusyPoll time.Duration
	// Priority, if positive, runs the engine's socket loops at this
	// SCHED_FIFO priority (see offload.Config.Priority; the XDP paths
	// only: on the AF_PACKET path the bridge's own loops feed the engine).
	Priority int
}

// Offload is the UDP offload engine at work for a bridge: it fills the
// rings given to StartOffload with the datagrams of the ingest rules.
type Offload struct {
	b   *Bridge
	eng *offload.Engine
	fed bool // the bridge's AF_PACKET loops feed eng
}

// StartOffload starts the UDP offload engine: the datagrams an ingest rule
// matches go, headers stripped, into rings[the rule's buffer id]. On the
// XDP paths the engine reads AF_XDP sockets of its own, beside the
// bridge's on every queue the bridge serves that is in use and sharing
// their UMEMs (the kernel allows one UMEM per queue), which the program's
// IngestXSKMap feeds; a bridge that follows the queues in use gives the
// engine the queues that come into use too. On the AF_PACKET path the
// bridge's loops classify and strip the datagrams themselves and feed the
// engine, and the nftables table hides them from the kernel. Consumers see the same rings either way; only the
// latency differs (see package offload).
//
// Call it on a thread in the interface's network namespace, as Open. Run
// one Offload at a time, and close it before the bridge (its sockets share
// the bridge's UMEMs) and before the rings.
func (b *Bridge) StartOffload(cfg OffloadConfig, rings map[uint32]*ingest.Ring) (_ *Offload, err error) {
	o := &Offload{b: b}
	if b.prog != nil {
		if err := b.startEngine(o, cfg); err != nil {
			return nil, err
		}
	} else {
		o.eng, o.fed = offload.StartFed(), true
		b.log.Warn("ingest runs on the bridge's AF_PACKET path: RX times from the packet socket, latency floor of its block timeout", "path", b.Mode())
	}
	defer func() {
		if err != nil {
			o.Close()
		}
	}()
	// Every ring is in place before the first datagram is fed, so none
	// meets an engine without its ring.
	for _, id := range slices.Sorted(maps.Keys(rings)) {
		if err := o.eng.Attach(id, rings[id]); err != nil {
			return nil, fmt.Errorf("bridge: offload ring %d: %w", id, err)
		}
	}
	if o.fed {
		if err := b.setIngest(o.eng); err != nil {
			return nil, fmt.Errorf("bridge: offload engine: %w", err)
		}
	}
	return o, nil
}

// startEngine starts o's engine on the XDP paths, on the queues the
// bridge serves that are in use (a socket on a queue out of use fails to
// bind), and makes the bridge hand it the queues that come into use later
// (queuesChanged). Both happen under b.mu, so that no queue comes into use
// between the two unseen; the engine looks up the bridge's UMEMs with
// b.mu held.
func (b *Bridge) startEngine(o *Offload, cfg OffloadConfig) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("bridge: closed")
	}
	var queues []int
	for _, q := range b.queues {
		if q.id < b.inUse {
			queues = append(queues, q.id)
		}
	}
	var err error
	o.eng, err = offload.Start(offload.Config{
		Program: b.prog, Ifindex: b.ifindex, Queues: queues, Umem: b.umemLocked,
		BusyPoll: cfg.BusyPoll, Priority: cfg.Priority,
	})
	if err != nil {
		return fmt.Errorf("bridge: offload engine: %w", err)
	}
	b.engine = o.eng
	return nil
}

// Stats are the engine's counters.
func (o *Offload) Stats() offload.Stats { return o.eng.Stats() }

// Close stops the engine. The rings stay open: they belong to the caller.
func (o *Offload) Close() error {
	var errs []error
	if o.fed {
		errs = append(errs, o.b.setIngest(nil))
	} else {
		o.b.mu.Lock()
		if o.b.engine == o.eng {
			o.b.engine = nil
		}
		o.b.mu.Unlock()
	}
	return errors.Join(append(errs, o.eng.Close())...)
}

// setIngest makes the AF_PACKET path feed ingest datagrams to e, an engine
// made by offload.StartFed: each loop classifies an ingest frame, strips it
// as the XDP program would (classifier.Ingest, stamped with the packet
// socket's RX time on the XDP program's clock) and hands it to its own
// Feeder, so the rings e fills look the same as on the XDP paths; frames
// the classifier judges malformed are counted as e's Stats.Refused. A nil e
// stops feeding. While an engine is fed, the nftables table hides the
// ingest rules' frames from the kernel (see package classifier/nft). On
// the XDP paths it is an error: there the engine reads its own AF_XDP
// sockets.
//
// A loop may finish the block it is in with the previous engine after
// setIngest returns; closing that engine is safe at any time (it shuts its
// rings to late feeders first).
func (b *Bridge) setIngest(e *offload.Engine) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.afp == nil {
		return errors.New("bridge: feeding an offload engine is for the AF_PACKET path; on " + b.path.String() + " the engine reads its own sockets")
	}
	fs := make([]*offload.Feeder, len(b.afp.rxs))
	if e != nil {
		for i, ar := range b.afp.rxs {
			var err error
			if fs[i], err = e.NewFeeder(ar.queue); err != nil {
				return err
			}
		}
	}
	t := b.tables.Load()
	if t == nil {
		var err error
		if t, err = classifier.Compile(&classifier.RuleSet{}); err != nil {
			return err
		}
	}
	// Feed first, then hide: in between, an ingest frame reaches both the
	// engine and the kernel, rather than neither.
	for i, ar := range b.afp.rxs {
		ar.feed.Store(fs[i])
	}
	if err := b.afp.hide.UpdateIngestFed(t, e != nil); err != nil {
		return fmt.Errorf("bridge: %w", err)
	}
	return nil
}
