package userstack

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// relink is the Link a stack keeps across bridge restarts: the stream
// underneath is replaced, while the LinkEndpoint, the stack and its
// connections above it stay. While no stream is attached, Send drops what
// it is given, as a wire with nobody at the far end would (TCP sends it
// again once a stream is back), and Recv waits for the next stream.
type relink struct {
	// lost is told, once per stream, that the stream failed.
	lost func(l Link, err error)

	// mu serialises the changes; each one stores a new state, so that
	// every packet sent and every batch received reads the stream with
	// one atomic load instead of taking a lock both directions share.
	mu    sync.Mutex
	state atomic.Pointer[relinkState]
}

// relinkState is one relink's state, never changed once stored.
type relinkState struct {
	cur     Link          // nil while the bridge is away
	changed chan struct{} // closed when this state is replaced
	closed  bool
}

// errRelinkClosed ends the receive loop once the stack closes.
var errRelinkClosed = errors.New("userstack: link closed")

func newRelink(l Link, lost func(Link, error)) *relink {
	r := &relink{lost: lost}
	r.state.Store(&relinkState{cur: l, changed: make(chan struct{})})
	return r
}

// replace stores the state that follows old and wakes whoever waits on
// old. r.mu is held.
func (r *relink) replace(old *relinkState, l Link, closed bool) {
	next := &relinkState{cur: l, changed: make(chan struct{}), closed: closed}
	r.state.Store(next)
	close(old.changed)
}

// set attaches l (nil: none) and wakes a Recv waiting for a stream.
func (r *relink) set(l Link) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if old := r.state.Load(); !old.closed {
		r.replace(old, l, false)
	}
}

// Close makes Recv return errRelinkClosed once the current stream's Recv
// returns (its owner closes the stream).
func (r *relink) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if old := r.state.Load(); !old.closed {
		r.replace(old, nil, true)
	}
	return nil
}

func (r *relink) current() (Link, <-chan struct{}, bool) {
	s := r.state.Load()
	return s.cur, s.changed, s.closed
}

// fail reports l's failure, unless l has been replaced already.
func (r *relink) fail(l Link, err error) {
	r.mu.Lock()
	old := r.state.Load()
	mine := old.cur == l && !old.closed
	if mine {
		r.replace(old, nil, false)
	}
	r.mu.Unlock()
	if mine && r.lost != nil {
		r.lost(l, err)
	}
}

// Recv implements Link.
func (r *relink) Recv(bufs [][]byte) (int, error) { return r.RecvMeta(bufs, nil) }

// RecvMeta implements MarkedLink; over a stream that carries no words they
// are 0.
func (r *relink) RecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	for {
		l, changed, closed := r.current()
		if closed {
			return 0, errRelinkClosed
		}
		if l == nil {
			<-changed
			continue
		}
		var n int
		var err error
		if ml, ok := l.(MarkedLink); ok && meta != nil {
			n, err = ml.RecvMeta(bufs, meta)
		} else {
			n, err = l.Recv(bufs)
			clear(meta[:min(max(n, 0), len(meta))])
		}
		if n > 0 || err == nil {
			return n, nil // an error with packets comes back on the next call
		}
		r.fail(l, err)
	}
}

// Send implements Link. Packets that no stream takes are dropped and
// reported as sent: the stack above must not take the bridge's absence
// for an error of its own, which would fail connections TCP can carry
// across the gap.
func (r *relink) Send(pkts [][]byte) (int, error) { return r.SendMeta(pkts, nil) }

// SendMeta implements MarkedLink; a stream that carries no words drops them.
func (r *relink) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	l, _, _ := r.current()
	if l == nil {
		return len(pkts), nil
	}
	var n int
	var err error
	if ml, ok := l.(MarkedLink); ok && meta != nil {
		n, err = ml.SendMeta(pkts, meta)
	} else {
		n, err = l.Send(pkts)
	}
	if err == nil || errors.Is(err, fabric.ErrTooBig) {
		return n, err
	}
	r.fail(l, err)
	return len(pkts), nil
}
