package fabric

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// EventQueue lets one goroutine (the bridge's TX loop) wait for packets on
// many streams (their BridgeEnds, of either transport) at once. It is the tripwire generalised: a stream found
// empty gets its consumer flag armed and stays armed, costing nothing,
// until its application publishes; that publish signals the stream's
// eventfd once, epoll reports it, and the stream is handed to the caller.
// Work per event is O(1) whatever the number of streams; streams that stay
// busy are handed back round after round without any system call.
//
// Dead streams leave by themselves. A stream that is closed (by any
// goroutine, at any time) or broken (its owner's Send or Recv returned the
// error) is dropped by the next Wait that looks at it: its token becomes
// free and Stream returns nil for it. Closing a queued stream is always
// safe; the queue holds on to its mapping and eventfd until it has dropped
// it, and releases them then (or in Remove or Close). A stream whose
// application has gone but which still holds packets is not dead yet: Wait
// reports it, the caller drains it, and the receive that finds it empty
// returns ErrPeerGone and breaks it. (A RemoteBridge, broken by its peer
// rather than by its owner, leaves once closed or removed.)
//
// Not safe for concurrent use, except that streams may be closed
// concurrently.
type EventQueue struct {
	epfd    int
	slots   []BridgeEnd // by token; nil = free
	free    []int
	pending []int  // tokens handed out by the last Wait, to re-check
	inOut   []bool // token is in the caller's out slice this round
	inPend  []bool // token is in pending
	events  [64]unix.EpollEvent
	buf     [8]byte
	// Spin is how long Wait polls the streams of its last round before it
	// sleeps in epoll.
	Spin   time.Duration
	sleeps atomic.Uint64
	count  int
}

// NewEventQueue creates an empty queue.
func NewEventQueue() (*EventQueue, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("fabric: epoll_create1: %w", err)
	}
	return &EventQueue{epfd: fd, Spin: defaultSpin}, nil
}

// Close drops every stream still registered (releasing those already
// closed) and releases the epoll instance. Streams stay open.
func (q *EventQueue) Close() error {
	for tok, s := range q.slots {
		if s != nil {
			q.detach(tok)
		}
	}
	return unix.Close(q.epfd)
}

// Sleeps counts epoll_wait calls that found nothing ready beforehand.
func (q *EventQueue) Sleeps() uint64 { return q.sleeps.Load() }

// Len is the number of streams registered.
func (q *EventQueue) Len() int { return q.count }

// Add registers a bridge end and returns its token. The end is
// immediately reported by the next Wait, so packets queued before Add are
// not missed. An end belongs to at most one queue.
func (q *EventQueue) Add(s BridgeEnd) (int, error) {
	t := s.tenant()
	t.lifeMu.Lock()
	defer t.lifeMu.Unlock()
	if s.cond().closed.Load() {
		return 0, ErrClosed
	}
	if t.queue != nil {
		return 0, errors.New("fabric: stream is already in an EventQueue")
	}
	var tok int
	if n := len(q.free); n > 0 {
		tok, q.free = q.free[n-1], q.free[:n-1]
	} else {
		tok = len(q.slots)
		q.slots = append(q.slots, nil)
		q.inOut = append(q.inOut, false)
		q.inPend = append(q.inPend, false)
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(tok)}
	if err := unix.EpollCtl(q.epfd, unix.EPOLL_CTL_ADD, s.wakeFd(), &ev); err != nil {
		q.free = append(q.free, tok)
		return 0, fmt.Errorf("fabric: epoll_ctl: %w", err)
	}
	t.queue = q
	q.slots[tok] = s
	q.count++
	q.pend(tok)
	return tok, nil
}

// Remove unregisters a stream (a no-op if it is not registered here, for
// instance because a Wait already dropped it as dead).
func (q *EventQueue) Remove(s BridgeEnd) {
	for tok, x := range q.slots {
		if x == s {
			if q.inPend[tok] {
				for i, p := range q.pending {
					if p == tok {
						q.pending = append(q.pending[:i], q.pending[i+1:]...)
						break
					}
				}
				q.inPend[tok] = false
			}
			q.detach(tok)
			return
		}
	}
}

// detach forgets the stream under tok (the caller has taken it off the
// pending list) and finishes a Close that ran while it was queued.
func (q *EventQueue) detach(tok int) {
	s := q.slots[tok]
	unix.EpollCtl(q.epfd, unix.EPOLL_CTL_DEL, s.wakeFd(), nil)
	q.slots[tok] = nil
	q.free = append(q.free, tok)
	q.count--
	t := s.tenant()
	t.lifeMu.Lock()
	t.queue = nil
	late := t.releaseLate
	t.lifeMu.Unlock()
	if late {
		s.release()
	}
}

// Stream returns the stream registered under tok, or nil if the token is
// free (never used, removed, or dropped as dead). A token handed out by
// Wait stays valid until the next Wait.
func (q *EventQueue) Stream(tok int) BridgeEnd {
	if tok < 0 || tok >= len(q.slots) {
		return nil
	}
	return q.slots[tok]
}

// readyOrArm re-checks a stream handed out last round; if it is empty it
// arms its tripwire and checks once more, so a publish that raced with the
// arming is either seen here or signalled through epoll.
func (q *EventQueue) readyOrArm(s BridgeEnd) bool {
	if s.dataReady() {
		return true
	}
	atomic.SwapUint32(s.armFlag(), 1) // a full barrier before the re-check
	if s.dataReady() {
		atomic.StoreUint32(s.armFlag(), 0)
		return true
	}
	return false
}

func (q *EventQueue) pend(tok int) {
	if !q.inPend[tok] {
		q.inPend[tok] = true
		q.pending = append(q.pending, tok)
	}
}

func (q *EventQueue) emit(out []int, n int, tok int) int {
	if n < len(out) && !q.inOut[tok] {
		q.inOut[tok] = true
		out[n] = tok
		n++
	}
	return n
}

// Wait fills out with tokens of streams that have packets (or whose
// application has gone: the caller finds out by receiving from them) and
// returns how many. It drops dead streams it comes across (see
// EventQueue). The caller should drain each returned stream — or take a fair
// batch from it — before the next Wait, which re-checks exactly those
// streams: it polls them for up to Spin, and arms the tripwire of the ones
// that stay empty before sleeping in epoll. timeout < 0 waits forever;
// when it expires Wait returns 0, nil.
func (q *EventQueue) Wait(out []int, timeout time.Duration) (int, error) {
	n := 0
	start := time.Now()
	// Poll the unarmed streams (last round's) while spinning.
	for {
		n = q.scan(out, n, false)
		if n > 0 || len(q.pending) == 0 || time.Since(start) >= q.Spin {
			break
		}
	}
	if n == 0 {
		n = q.scan(out, n, true) // arm each empty one, catching late publishes
	}
	if n == 0 {
		ms := -1
		if timeout >= 0 {
			left := timeout - time.Since(start)
			if left < 0 {
				left = 0
			}
			ms = int((left + time.Millisecond - 1) / time.Millisecond)
		}
		q.sleeps.Add(1)
		var err error
		if n, err = q.harvest(out, ms); err != nil {
			return 0, err
		}
	}
	q.settle(out, n)
	return n, nil
}

// harvest waits up to ms milliseconds (-1: forever) for signalled streams
// and moves them to out (or pending, when out is full).
func (q *EventQueue) harvest(out []int, ms int) (int, error) {
	n := 0
	k, err := unix.EpollWait(q.epfd, q.events[:], ms)
	if err != nil && err != unix.EINTR {
		return 0, err
	}
	for i := 0; i < k; i++ {
		tok := int(q.events[i].Fd)
		if tok < 0 || tok >= len(q.slots) || q.slots[tok] == nil {
			continue
		}
		if q.slots[tok].gone() {
			if !q.inPend[tok] && !q.inOut[tok] {
				q.detach(tok)
			}
			continue // a pending one goes in the next scan
		}
		eventfdDrain(q.slots[tok].wakeFd(), &q.buf)
		if n < len(out) && !q.inPend[tok] {
			n = q.emit(out, n, tok)
		} else {
			q.pend(tok)
		}
	}
	return n, nil
}

// settle puts the streams handed out this round on the pending list, to
// be re-checked (and armed if empty) by the next round.
func (q *EventQueue) settle(out []int, n int) {
	for i := 0; i < n; i++ {
		q.inOut[out[i]] = false
		q.pend(out[i])
	}
}

// Fd is the epoll descriptor behind the queue. It becomes readable when an
// armed stream is signalled, so a caller that also waits for other
// descriptors (the bridge's AF_XDP socket) can sleep in one poll(2) on all
// of them. Sleep on it only after Poll returned 0: that arms every stream.
// Reading is done by Poll and Wait; never read or modify it directly.
func (q *EventQueue) Fd() int { return q.epfd }

// Poll is Wait without spinning or sleeping: it reports the streams that
// have packets now, collecting the signals already delivered. When it
// returns 0 every stream is armed, so a publish from then on makes Fd
// readable; the caller may sleep on Fd beside its other descriptors and
// call Poll again when it wakes.
func (q *EventQueue) Poll(out []int) (int, error) {
	n := q.scan(out, 0, false)
	if n == 0 {
		n = q.scan(out, 0, true)
	}
	if n == 0 {
		var err error
		if n, err = q.harvest(out, 0); err != nil {
			return 0, err
		}
	}
	q.settle(out, n)
	return n, nil
}

// scan checks the pending (unarmed) streams, moving ready ones to out
// while there is room. With arm set, the empty ones are armed and leave
// the pending list: from then on only their eventfd reports them.
func (q *EventQueue) scan(out []int, n int, arm bool) int {
	kept := q.pending[:0]
	for _, tok := range q.pending {
		s := q.slots[tok]
		if s == nil {
			q.inPend[tok] = false
			continue
		}
		if s.gone() {
			q.inPend[tok] = false
			q.detach(tok)
			continue
		}
		var ready bool
		if arm {
			ready = q.readyOrArm(s)
		} else {
			ready = s.dataReady()
		}
		switch {
		case ready && n < len(out):
			n = q.emit(out, n, tok)
			q.inPend[tok] = false
		case ready || !arm:
			kept = append(kept, tok) // no room, or not armed yet: look again
		default:
			q.inPend[tok] = false // armed
		}
	}
	q.pending = kept
	return n
}
