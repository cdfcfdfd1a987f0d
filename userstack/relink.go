package userstack

import (
	"errors"
	"sync"

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

	mu      sync.Mutex
	cur     Link          // nil while the bridge is away
	changed chan struct{} // closed, and replaced, when cur changes or the relink closes
	closed  bool
}

// errRelinkClosed ends the receive loop once the stack closes.
var errRelinkClosed = errors.New("userstack: link closed")

func newRelink(l Link, lost func(Link, error)) *relink {
	return &relink{cur: l, lost: lost, changed: make(chan struct{})}
}

// set attaches l (nil: none) and wakes a Recv waiting for a stream.
func (r *relink) set(l Link) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.cur = l
	close(r.changed)
	r.changed = make(chan struct{})
}

// Close makes Recv return errRelinkClosed once the current stream's Recv
// returns (its owner closes the stream).
func (r *relink) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.closed = true
		r.cur = nil
		close(r.changed)
	}
	return nil
}

func (r *relink) current() (Link, <-chan struct{}, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cur, r.changed, r.closed
}

// fail reports l's failure, unless l has been replaced already.
func (r *relink) fail(l Link, err error) {
	r.mu.Lock()
	mine := r.cur == l && !r.closed
	if mine {
		r.cur = nil
		close(r.changed)
		r.changed = make(chan struct{})
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
