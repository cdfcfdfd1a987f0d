package offload

import (
	"errors"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// StartFed starts an engine without sockets, for a receive path that
// classifies frames itself: the bridge's AF_PACKET path, where no XDP
// program strips frames or redirects them. Each of that path's receive
// loops takes a Feeder and hands it what classifier.Classify and
// classifier.Ingest make of an ingest frame — the same IngestMeta and
// stripped frame the XDP program would have produced — and the engine puts
// them into the attached rings exactly as its socket loops do, so a
// consumer cannot tell which path filled its ring. One loop of the
// engine's own closes windows on time while no datagram arrives.
func StartFed() *Engine {
	e := &Engine{fed: true, wakefd: -1, kick: make(chan struct{}, 1), done: make(chan struct{})}
	empty := map[uint32]*attached{}
	e.rings.Store(&empty)
	e.wg.Add(1)
	go e.windows()
	return e
}

// idleTick is how often an idle fed engine ticks its rings, as often as
// the XDP loop's sleep wakes.
const idleTick = 100 * time.Millisecond

// windows closes the windows of a fed engine's rings: it sleeps until the
// earliest open buffer's window ends, or, with none open, until a feeder
// appends something or idleTick passes (the rings time consumers'
// releases at each tick, see ingest.Stats).
func (e *Engine) windows() {
	defer e.wg.Done()
	t := time.NewTimer(time.Hour)
	t.Stop()
	for !e.stop.Load() {
		next, open := e.tick()
		if !open {
			t.Reset(idleTick)
			select {
			case <-e.kick:
			case <-t.C:
			case <-e.done:
			}
			t.Stop()
			continue
		}
		d := time.Duration(int64(next - ingest.Now()))
		if d <= 0 {
			continue
		}
		t.Reset(d)
		select {
		case <-t.C:
		case <-e.done:
			t.Stop()
		}
	}
}

// Feeder is one receive loop's entrance to a fed engine. Only that loop
// uses it; a batch is any run of Add and Refused calls ended by End.
type Feeder struct {
	e       *Engine
	queue   int
	a       appender
	inBatch bool
	c       counters
}

// NewFeeder returns the feeder of the loop serving receive queue (the
// engine's Stats report its counters under that queue).
func (e *Engine) NewFeeder(queue int) (*Feeder, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case !e.fed:
		return nil, errors.New("ingest: feeders are for engines made by StartFed")
	case e.closed:
		return nil, errors.New("ingest: engine closed")
	}
	f := &Feeder{e: e, queue: queue}
	e.feeders = append(e.feeders, f)
	return f, nil
}

// Add appends one datagram: m is what classifier.Ingest returned for the
// frame, with RxTimestampNs set (CLOCK_MONOTONIC, ingest.Now's clock),
// and stripped is the frame without Ingest's strip bytes. The payload is
// copied before Add returns. Until End the feeder holds the ring of the
// last buffer id, so that several loops' batches do not interleave inside
// a ring.
func (f *Feeder) Add(m *classifier.IngestMeta, stripped []byte) {
	if !f.inBatch {
		f.a.begin(f.e)
		f.inBatch = true
	}
	f.a.c.received++
	f.a.add(m, stripped)
}

// Refused counts a frame the loop's classifier judged malformed; it never
// reaches a ring (Stats.Refused).
func (f *Feeder) Refused() { f.a.c.refused++ }

// End ends the batch: it lets go of the ring it holds, publishes the
// counters and, if a datagram went into a ring, makes sure the engine
// closes its window on time. Call it before the frames passed to Add go
// back to the kernel, and at least whenever the loop is about to sleep.
func (f *Feeder) End() {
	if !f.inBatch && f.a.c == (batchCounts{}) {
		return
	}
	f.a.end()
	f.inBatch = false
	appended := f.a.c.appended
	f.c.add(&f.a.c)
	if appended > 0 {
		select {
		case f.e.kick <- struct{}{}:
		default:
		}
	}
}
