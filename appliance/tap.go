package appliance

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/capture"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// A tap captures one application stream by standing between the bridge and
// the stream while a capture runs: the bridge is given one end of a fresh
// stream pair instead of the application's stream, and two relay
// goroutines copy packets across, showing each one to the capture. It needs
// nothing of the bridge but AddStream and RemoveStream, and costs nothing
// when no capture runs. While it runs each packet is copied once more; the
// two switches (in and out) each lose the few packets in flight at that
// moment, which the bridge counts as no_stream drops.
type tap struct {
	orig       *fabric.Stream // the application's stream, bridge side
	bEnd, aEnd *fabric.Stream // the pair: bEnd is the bridge's, aEnd the relay's
	see        func(capture.Direction, time.Time, []byte)
	gone       chan struct{} // closed when the tap ends
	wg         sync.WaitGroup
	once       sync.Once
}

// relayBatch is how many packets one relay step moves.
const relayBatch = 64

func newTap(orig *fabric.Stream, see func(capture.Direction, time.Time, []byte)) (*tap, error) {
	slot := (orig.MaxPayload() + 8 + 63) &^ 63
	b, a, err := fabric.NewPair(fabric.Config{SlotSize: slot})
	if err != nil {
		return nil, err
	}
	return &tap{orig: orig, bEnd: b, aEnd: a, see: see, gone: make(chan struct{})}, nil
}

// start runs the relays; the caller has just handed bEnd to the bridge in
// place of orig.
func (t *tap) start() {
	t.wg.Add(2)
	go t.relay(capture.In, t.aEnd, t.orig)  // wire -> application
	go t.relay(capture.Out, t.orig, t.aEnd) // application -> wire
}

func (t *tap) relay(dir capture.Direction, from, to *fabric.Stream) {
	defer t.wg.Done()
	bufs := make([][]byte, relayBatch)
	for i := range bufs {
		bufs[i] = make([]byte, from.MaxPayload())
	}
	for {
		select {
		case <-t.gone:
			return
		default:
		}
		n, err := from.RecvTimeout(bufs, 20*time.Millisecond)
		now := time.Now()
		for _, p := range bufs[:n] {
			t.see(dir, now, p)
		}
		if n > 0 {
			if _, serr := to.Send(bufs[:n]); serr != nil && !errors.Is(serr, fabric.ErrTimeout) {
				return
			}
		}
		if err != nil && !errors.Is(err, fabric.ErrTimeout) {
			return // the application or the pair is gone
		}
		for i := range bufs[:n] {
			bufs[i] = bufs[i][:cap(bufs[i])]
		}
	}
}

// end stops the relays and releases the pair. The bridge must no longer
// use bEnd, and orig must not yet be back in the bridge: the relays touch
// orig until end returns.
func (t *tap) end() {
	t.once.Do(func() {
		close(t.gone)
		t.aEnd.Close() // unblocks a relay waiting in Send
		t.wg.Wait()
		t.bEnd.Close()
	})
}

// Tap starts capturing stream id: see is shown every packet, both ways,
// until stop is called or the stream goes (gone is closed then).
func (p *bridgePlane) Tap(id uint32, see func(capture.Direction, time.Time, []byte)) (stop func(), gone <-chan struct{}, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.gone(); err != nil {
		return nil, nil, err
	}
	e := p.streams[id]
	if e == nil {
		return nil, nil, fmt.Errorf("no stream %d", id)
	}
	if e.tap != nil {
		return nil, nil, fmt.Errorf("stream %d is already being captured", id)
	}
	t, err := newTap(e.s, see)
	if err != nil {
		return nil, nil, err
	}
	if err := p.b.RemoveStream(id); err != nil {
		t.end()
		return nil, nil, err
	}
	if err := p.b.AddStream(id, t.bEnd, e.own); err != nil {
		t.end()
		if rerr := p.b.AddStream(id, e.s, e.own); rerr != nil {
			return nil, nil, errors.Join(err, fmt.Errorf("stream %d lost: %w", id, rerr))
		}
		return nil, nil, err
	}
	t.start()
	e.tap = t
	stop = func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if e.tap != t || p.closed {
			return // the stream went, or the bridge closed: already ended
		}
		e.tap = nil
		p.b.RemoveStream(id)
		t.end()
		if err := p.b.AddStream(id, e.s, e.own); err != nil {
			p.log.Error("capture ended but the stream could not be given back to the bridge", "stream", id, "error", err)
		}
	}
	return stop, t.gone, nil
}
