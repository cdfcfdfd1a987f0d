package fabric

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Side says which end of a stream a Stream value is.
type Side uint8

const (
	// BridgeSide produces into RX (dropping when full) and consumes TX.
	BridgeSide Side = iota
	// AppSide consumes RX and produces into TX (blocking when full).
	AppSide
)

func (s Side) String() string {
	if s == BridgeSide {
		return "bridge"
	}
	return "app"
}

// Health is the state of one stream as the bridge's metrics report it.
type Health uint8

const (
	// Normal: no drops in the last interval and the peer is there.
	Normal Health = iota
	// Sick: packets were dropped in the last interval (the application
	// does not keep up); the stream still works.
	Sick
	// Broken: the peer is gone or corrupted shared state; the stream is
	// dead and will not recover.
	Broken
)

func (h Health) String() string {
	switch h {
	case Normal:
		return "normal"
	case Sick:
		return "sick"
	default:
		return "broken"
	}
}

// Stats are a stream's counters, as seen by its own side.
type Stats struct {
	Sent     uint64 // packets put into the outgoing ring
	Received uint64 // packets taken from the incoming ring
	Dropped  uint64 // packets dropped because the outgoing ring was full or they were too big
	Signals  uint64 // wake-ups sent to the peer (system calls on the send path)
	Sleeps   uint64 // times this side slept in the kernel waiting
}

// Stream is one end of a duplex fabric stream: an RX ring (bridge to
// application) and a TX ring (application to bridge) in one shared region.
// Sends and receives run at the same time; several goroutines may send
// (or receive) at once, their calls on one direction taking turns; Close
// may be called from any goroutine and unblocks them all (see the package
// doc, "Calls").
type Stream struct {
	side Side
	mem  []byte

	// Each direction's hot fields sit on cache lines of their own: the
	// sending and the receiving goroutine (often on different cores) each
	// write only their own gate.
	_        [64]byte
	sg       gate // Send: serialises senders, lets Close wait, counts Sent
	send     *Producer
	sendWait *Waiter // nil: the bridge drops instead of waiting
	sr       sendReady

	_        [64]byte
	rg       gate // receive: serialises receivers, lets Close wait, counts Received
	recv     *Consumer
	recvWait *Waiter
	rr       recvReady
	_        [64]byte

	myState, peerState *uint32
	fds                []int // eventfds owned by this side: rxData, txData, txSpace
	memfd              int   // bridge side, until handed over
	conn               *net.UnixConn
	monDone            chan struct{}

	// queue is the EventQueue this stream is registered with, if any;
	// while it is set, Close leaves the unmapping to the queue, which may
	// still be looking at the region (see EventQueue).
	lifeMu      sync.Mutex
	queue       *EventQueue
	releaseLate bool // Close ran while queued: the queue releases

	closed   atomic.Bool
	broken   atomic.Bool
	peerGone atomic.Bool // control connection closed: drain, then break
	errMu    sync.Mutex
	err      error
	closeOne sync.Once

	dropped            atomic.Uint64
	tickPrev, tickLast atomic.Uint64 // drop counts at the last two Ticks
}

type recvReady struct{ s *Stream }

func (r *recvReady) ready() bool {
	s := r.s
	return s.recv.Ready() || s.closed.Load() || s.broken.Load() || s.peerLeft()
}

type sendReady struct{ s *Stream }

func (r *sendReady) ready() bool {
	s := r.s
	return s.send.Free() > 0 || s.send.err != nil || s.closed.Load() || s.broken.Load() || s.peerLeft()
}

// peerLeft reports an orderly close (state word) or a vanished process
// (control socket closed). Callers must hold a direction lock or know the
// region is still mapped.
func (s *Stream) peerLeft() bool {
	return s.peerGone.Load() || atomic.LoadUint32(s.peerState) == stateClosed
}

const (
	fdRxData  = 0 // bridge signals: RX has data for a sleeping app
	fdTxData  = 1 // app signals: TX has data for a sleeping bridge
	fdTxSpace = 2 // bridge signals: TX has space for a sleeping app
)

// newStream builds one side over an attached region. fds are the three
// eventfds in the order fdRxData, fdTxData, fdTxSpace.
func newStream(side Side, mem []byte, l layout, fds []int) *Stream {
	s := &Stream{side: side, mem: mem, fds: fds, memfd: -1}
	rx, tx := newRingView(mem, l.rx), newRingView(mem, l.tx)
	bridgeState, appState := u32at(mem, offBridgeState), u32at(mem, offAppState)
	if side == BridgeSide {
		s.send = &Producer{v: rx, wake: signaller{fd: fds[fdRxData]}}
		s.recv = &Consumer{v: tx, wake: signaller{fd: fds[fdTxSpace]}}
		s.recvWait = newWaiter(fds[fdTxData], tx.consArmed)
		s.myState, s.peerState = bridgeState, appState
	} else {
		s.send = &Producer{v: tx, wake: signaller{fd: fds[fdTxData]}}
		s.recv = &Consumer{v: rx, wake: signaller{fd: -1}} // the bridge never sleeps for RX space
		s.recvWait = newWaiter(fds[fdRxData], rx.consArmed)
		s.sendWait = newWaiter(fds[fdTxSpace], tx.prodArm)
		s.myState, s.peerState = appState, bridgeState
	}
	s.rr.s, s.sr.s = s, s
	s.sg.init()
	s.rg.init()
	atomic.StoreUint32(s.myState, stateOpen)
	return s
}

// Side returns which end this is.
func (s *Stream) Side() Side { return s.side }

// MaxPayload is the largest packet the outgoing ring accepts.
func (s *Stream) MaxPayload() int { return s.send.MaxPayload() }

// RecvDepth is how many packets the incoming ring holds: an application
// sizes its receive buffering by it.
func (s *Stream) RecvDepth() int { return s.recv.Depth() }

// SendDepth is how many packets the outgoing ring holds.
func (s *Stream) SendDepth() int { return s.send.Depth() }

// RecvWaiter exposes the receive-side Waiter so callers can tune Spin.
func (s *Stream) RecvWaiter() *Waiter { return s.recvWait }

// SendWaiter exposes the send-side Waiter (nil on the bridge side).
func (s *Stream) SendWaiter() *Waiter { return s.sendWait }

// Err returns why the stream is broken or closed, or nil.
func (s *Stream) Err() error {
	if s.closed.Load() {
		return ErrClosed
	}
	if !s.broken.Load() {
		return nil
	}
	s.errMu.Lock()
	defer s.errMu.Unlock()
	return s.err
}

// markBroken records the first reason the stream died and wakes every
// waiter of this side so none sleeps on a dead stream.
func (s *Stream) markBroken(err error) {
	s.errMu.Lock()
	if s.err == nil {
		s.err = errors.Join(ErrBroken, err)
	}
	s.errMu.Unlock()
	s.broken.Store(true)
	s.sg.mark(gateBroken)
	s.rg.mark(gateBroken)
	for _, fd := range s.fds {
		eventfdSignal(fd)
	}
}

// Health reports Broken if the peer is gone or misbehaved, Sick if the
// stream dropped packets since the Tick before last, Normal otherwise.
func (s *Stream) Health() Health {
	if s.broken.Load() || s.closed.Load() || s.peerGone.Load() || s.peerClosedMapped() {
		return Broken
	}
	if s.dropped.Load() > s.tickPrev.Load() {
		return Sick
	}
	return Normal
}

// Tick ends a health interval; the owner calls it periodically (the
// bridge's metrics loop), so "sick" means "dropped recently".
func (s *Stream) Tick() {
	s.tickPrev.Store(s.tickLast.Load())
	s.tickLast.Store(s.dropped.Load())
}

// Stats returns a snapshot of the counters.
func (s *Stream) Stats() Stats {
	st := Stats{
		Sent:     s.sg.count(),
		Received: s.rg.count(),
		Dropped:  s.dropped.Load(),
		Signals:  s.send.wake.signals.Load() + s.recv.wake.signals.Load(),
		Sleeps:   s.recvWait.Sleeps(),
	}
	if s.sendWait != nil {
		st.Sleeps += s.sendWait.Sleeps()
	}
	return st
}

// PeerDrops is what the bridge published as dropped for this stream's RX
// ring (application side) — informational, the bridge's own count is
// authoritative.
func (s *Stream) PeerDrops() uint64 {
	if s.side == AppSide {
		s.lifeMu.Lock()
		defer s.lifeMu.Unlock()
		if s.mem == nil {
			return 0 // closed and unmapped
		}
		return atomic.LoadUint64(s.recv.v.drops)
	}
	return s.dropped.Load()
}

// peerClosedMapped reads the peer's state word for callers outside the
// gates (Health, from a metrics loop): under lifeMu, which release holds
// while it unmaps, so a concurrent Close cannot unmap under the load. A
// stream already unmapped counts as closed.
func (s *Stream) peerClosedMapped() bool {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	return s.mem == nil || atomic.LoadUint32(s.peerState) == stateClosed
}

func (s *Stream) dead() error {
	if s.closed.Load() {
		return ErrClosed
	}
	if s.broken.Load() {
		return s.Err()
	}
	return nil
}

// Send puts packets into the outgoing ring. On the bridge side it never
// waits: packets that do not fit are dropped and counted (the newest are
// the ones dropped, data the application has not read is never
// overwritten), and the result is how many were queued. On the application
// side it blocks until every packet is queued (backpressure) and returns
// len(pkts), or fewer and an error.
func (s *Stream) Send(pkts [][]byte) (int, error) {
	return s.SendMeta(pkts, nil)
}

// SendMeta is Send with a metadata word per packet (meta may be nil).
func (s *Stream) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	if !s.sg.enter() {
		return 0, s.dead()
	}
	// pending: queued by this call and not yet added to the gate's count.
	// The deferred closure costs about a nanosecond and keeps the gate
	// usable (and Close possible) if a caller's short meta slice panics.
	pending := 0
	defer func() { s.sg.leave(pending) }()
	if s.peerLeft() {
		s.markBroken(ErrPeerGone)
		return 0, s.Err()
	}
	done := 0
	for done < len(pkts) {
		var m []uint32
		if meta != nil {
			m = meta[done:]
		}
		n, err := s.send.ProduceMeta(pkts[done:], m)
		done += n
		pending += n
		if err == ErrTooBig {
			if s.side == BridgeSide {
				s.dropped.Add(1)
				s.send.countDrops(1)
				done++
				continue
			}
			return done, err
		}
		if err != nil {
			s.markBroken(err)
			return done, s.Err()
		}
		if done == len(pkts) {
			break
		}
		if s.side == BridgeSide {
			lost := uint64(len(pkts) - done)
			s.dropped.Add(lost)
			s.send.countDrops(lost)
			return done, nil
		}
		// About to wait for space: count what is queued so far, so that
		// Stats stays exact while this call blocks.
		s.sg.add(pending)
		pending = 0
		if err := s.sendWait.wait(&s.sr, -1); err != nil {
			return done, err
		}
		if err := s.dead(); err != nil {
			return done, err
		}
		if s.peerLeft() {
			s.markBroken(ErrPeerGone)
			return done, s.Err()
		}
	}
	return done, nil
}

// TryRecv takes up to len(bufs) packets without waiting (see
// Consumer.Consume for the buffer contract).
func (s *Stream) TryRecv(bufs [][]byte) (int, error) {
	return s.TryRecvMeta(bufs, nil)
}

// TryRecvMeta is TryRecv returning the metadata words too.
func (s *Stream) TryRecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	if !s.rg.enter() {
		return 0, s.dead()
	}
	n := 0
	defer func() { s.rg.leave(n) }()
	var err error
	n, err = s.tryRecvIn(bufs, meta)
	return n, err
}

// tryRecvIn is TryRecvMeta inside the gate, the stream known not dead at
// the last look.
func (s *Stream) tryRecvIn(bufs [][]byte, meta []uint32) (int, error) {
	// Look at the peer's state before the ring: it publishes its last
	// packets before it leaves, so a ring found empty after the departure
	// was seen is empty for good.
	left := s.peerLeft()
	n, err := s.recv.ConsumeMeta(bufs, meta)
	if err != nil {
		s.markBroken(err)
		return n, s.Err()
	}
	if n == 0 && left {
		// Drain first, then report the peer's departure.
		s.markBroken(ErrPeerGone)
		return 0, s.Err()
	}
	return n, nil
}

// Recv waits until at least one packet is there and takes up to len(bufs).
func (s *Stream) Recv(bufs [][]byte) (int, error) {
	return s.RecvTimeout(bufs, -1)
}

// RecvTimeout is Recv giving up with ErrTimeout after d (d < 0: never).
func (s *Stream) RecvTimeout(bufs [][]byte, d time.Duration) (int, error) {
	if !s.rg.enter() {
		return 0, s.dead()
	}
	n := 0
	defer func() { s.rg.leave(n) }()
	for {
		var err error
		n, err = s.tryRecvIn(bufs, nil)
		if n > 0 || err != nil || len(bufs) == 0 {
			return n, err
		}
		if err := s.recvWait.wait(&s.rr, d); err != nil {
			return 0, err
		}
		if err := s.dead(); err != nil {
			return 0, err
		}
	}
}

// Close marks this side closed, wakes every waiter on both sides, and
// releases the mapping and descriptors once no Send or Recv is inside it.
// The peer sees the stream become Broken. A stream registered with an
// EventQueue may be closed at any time from any goroutine: the queue drops
// it at its next Wait and releases it then.
func (s *Stream) Close() error {
	s.closeOne.Do(func() {
		s.closed.Store(true)
		s.sg.mark(gateClosed)
		s.rg.mark(gateClosed)
		atomic.StoreUint32(s.myState, stateClosed)
		for _, fd := range s.fds {
			eventfdSignal(fd)
		}
		if s.conn != nil {
			s.conn.Close()
			<-s.monDone
		}
		s.lifeMu.Lock()
		late := s.queue != nil
		s.releaseLate = late
		s.lifeMu.Unlock()
		if !late {
			s.release()
		}
	})
	return nil
}

// release unmaps the region and closes the descriptors, waiting for any
// Send or Recv still inside.
func (s *Stream) release() {
	s.sg.seal()
	s.rg.seal()
	for _, fd := range s.fds {
		unix.Close(fd)
	}
	if s.memfd >= 0 {
		unix.Close(s.memfd)
	}
	s.lifeMu.Lock() // Health and PeerDrops look at the region under it
	unix.Munmap(s.mem)
	s.mem = nil
	s.lifeMu.Unlock()
}
