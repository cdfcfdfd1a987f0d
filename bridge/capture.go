package bridge

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// Direction says which way a packet crossed a stream.
type Direction uint8

const (
	// Inbound: from the wire into the application's stream.
	Inbound Direction = iota
	// Outbound: from the application's stream towards the wire.
	Outbound
)

func (d Direction) String() string {
	if d == Outbound {
		return "out"
	}
	return "in"
}

// CaptureFunc sees one IP packet crossing a stream. pkt is the bridge's own
// buffer (a UMEM frame or a ring slot) and is reused as soon as fn returns:
// fn must copy what it keeps, must not modify pkt, and must be fast and never
// block, since it runs on the data path (a slow consumer should drop, not
// wait). It may run concurrently on several loops: the loops of different
// queues receive for the stream, and one of them also sends for it.
type CaptureFunc func(dir Direction, pkt []byte, ts time.Time)

// captureHook boxes a CaptureFunc so that streamEntry holds it in one
// atomic pointer.
type captureHook struct{ fn CaptureFunc }

// SetCapture makes fn see every packet of stream id: on RX each packet
// copied into the stream (not the ones a full ring dropped), on TX each
// packet that passed verification (sent directly or through the kernel),
// both exactly the IP packet, as the application reads or wrote it. The
// timestamp is when the XDP program saw the frame on the XDP paths, else
// when the bridge handled the packet. A nil fn removes the hook. When
// SetCapture returns, no loop runs the previous fn any more, and every
// packet that reaches the application or leaves it from then on goes to the
// new one. While no hook is set the data path pays one atomic load per
// batch. The hook goes away with the stream (RemoveStream).
func (b *Bridge) SetCapture(id uint32, fn CaptureFunc) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("bridge: closed")
	}
	e := (*b.streams.Load())[id]
	if e == nil {
		return fmt.Errorf("bridge: no stream %d", id)
	}
	var h *captureHook
	if fn != nil {
		h = &captureHook{fn: fn}
	}
	had := e.capture.Load() != nil
	// The XDP program reads the clock for steered frames only while a
	// capture wants the time: on before the first hook sees a frame, off
	// once the last is gone.
	if fn != nil && !had && b.captures == 0 {
		if err := b.stampSteered(true); err != nil {
			return err
		}
	}
	e.capture.Store(h)
	switch {
	case fn != nil && !had:
		b.captures++
	case fn == nil && had:
		if b.captures--; b.captures == 0 {
			b.stampSteered(false)
		}
	}
	// Wait until no loop still works on a batch that loaded the old hook:
	// the RX sides through their epochs, the stream's TX side by a round
	// trip through its loop's commands (run between rounds, on the loop).
	b.quiesce()
	done := make(chan struct{})
	b.queues[e.txQueue].tx.command(txCmd{done: done})
	<-done
	return nil
}

// stampSteered has the XDP program stamp steered frames, or stop.
func (b *Bridge) stampSteered(on bool) error {
	if b.prog == nil {
		return nil
	}
	if err := b.prog.StampSteered(on); err != nil {
		return fmt.Errorf("bridge: receive timestamps for the capture: %w", err)
	}
	return nil
}

// monoClock converts CLOCK_MONOTONIC nanoseconds (the XDP program's
// bpf_ktime_get_ns) to wall time, by an offset taken once.
type monoClock struct{ offset int64 }

func newMonoClock() monoClock {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return monoClock{}
	}
	return monoClock{offset: time.Now().UnixNano() - ts.Nano()}
}

// wall is the wall time of monotonic ns, or now if ns is 0 (no timestamp).
func (c monoClock) wall(ns uint64, now time.Time) time.Time {
	if ns == 0 || c.offset == 0 {
		return now
	}
	return time.Unix(0, int64(ns)+c.offset)
}
