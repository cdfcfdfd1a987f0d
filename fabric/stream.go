package fabric

import (
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Stats are a stream's counters, as seen by its own side.
type Stats struct {
	Sent     uint64 // packets put into the outgoing ring
	Received uint64 // packets taken from the incoming ring
	Dropped  uint64 // packets dropped because the outgoing ring was full or they were too big
	Signals  uint64 // wake-ups sent to the peer (system calls on the send path)
	Sleeps   uint64 // times this side slept in the kernel waiting
}

// Stream is the application's end of a duplex fabric stream in shared
// memory: it receives from the RX ring (bridge to application) and sends
// into the TX ring (application to bridge), waiting for room when the ring
// is full. Sends and receives run at the same time; several goroutines may
// send (or receive) at once, their calls on one direction taking turns;
// Close may be called from any goroutine and unblocks them all (see the
// package doc, "Calls").
type Stream struct{ end }

// BridgeStream is the bridge's end of a duplex fabric stream in shared
// memory: it sends into the RX ring, dropping what does not fit (the bridge
// never waits for an application), and receives from the TX ring. It is
// made by NewShm and handed to the application with Handover.
type BridgeStream struct{ end }

// end is one side of a stream region, what Stream and BridgeStream share.
type end struct {
	bridge bool // the bridge's end: sends drop instead of waiting
	mem    []byte

	// Each direction's hot fields sit on cache lines of their own: the
	// sending and the receiving goroutine (often on different cores) each
	// write only their own gate.
	_        [64]byte
	sg       gate // Send: serialises senders, lets Close wait, counts Sent
	send     *producer
	sendWait *waiter // nil: the bridge drops instead of waiting
	sr       sendReady

	_        [64]byte
	rg       gate // receive: serialises receivers, lets Close wait, counts Received
	recv     *consumer
	recvWait *waiter
	rr       recvReady
	_        [64]byte

	myState, peerState *uint32
	fds                []int // eventfds owned by this side: rxData, txData, txSpace
	memfd              int   // bridge side, until handed over
	conn               *net.UnixConn
	monDone            chan struct{}

	condition
	tenancy              // Health and peerDrops look at the region under its lifeMu
	peerGone atomic.Bool // control connection closed: drain, then break
	closeOne sync.Once
}

type recvReady struct{ s *end }

func (r *recvReady) ready() bool {
	s := r.s
	return s.recv.Ready() || s.closed.Load() || s.broken.Load() || s.peerLeft()
}

type sendReady struct{ s *end }

func (r *sendReady) ready() bool {
	s := r.s
	return s.send.Free() > 0 || s.send.err != nil || s.closed.Load() || s.broken.Load() || s.peerLeft()
}

// peerLeft reports an orderly close (state word) or a vanished process
// (control socket closed). Callers must hold a direction lock or know the
// region is still mapped.
func (s *end) peerLeft() bool {
	return s.peerGone.Load() || atomic.LoadUint32(s.peerState) == stateClosed
}

const (
	fdRxData  = 0 // bridge signals: RX has data for a sleeping app
	fdTxData  = 1 // app signals: TX has data for a sleeping bridge
	fdTxSpace = 2 // bridge signals: TX has space for a sleeping app
)

// newEnd builds one side over an attached region. fds are the three
// eventfds in the order fdRxData, fdTxData, fdTxSpace.
func newEnd(e *end, bridge bool, mem []byte, l layout, fds []int) {
	e.bridge, e.mem, e.fds, e.memfd = bridge, mem, fds, -1
	rx, tx := newRingView(mem, l.rx), newRingView(mem, l.tx)
	bridgeState, appState := u32at(mem, offBridgeState), u32at(mem, offAppState)
	if bridge {
		e.send = &producer{v: rx, wake: signaller{fd: fds[fdRxData]}}
		e.recv = &consumer{v: tx, wake: signaller{fd: fds[fdTxSpace]}}
		e.recvWait = newWaiter(fds[fdTxData], tx.consArmed)
		e.myState, e.peerState = bridgeState, appState
	} else {
		e.send = &producer{v: tx, wake: signaller{fd: fds[fdTxData]}}
		e.recv = &consumer{v: rx, wake: signaller{fd: -1}} // the bridge never sleeps for RX space
		e.recvWait = newWaiter(fds[fdRxData], rx.consArmed)
		e.sendWait = newWaiter(fds[fdTxSpace], tx.prodArm)
		e.myState, e.peerState = appState, bridgeState
	}
	e.rr.s, e.sr.s = e, e
	e.sg.init()
	e.rg.init()
	atomic.StoreUint32(e.myState, stateOpen)
}

// MaxPayload is the largest packet the outgoing ring accepts.
func (s *end) MaxPayload() int { return s.send.MaxPayload() }

// RecvDepth is how many full-size packets the incoming ring always has
// room for (it holds more small ones): an application sizes its receive
// windows by it.
func (s *end) RecvDepth() int { return s.recv.Depth() }

// SetRecvSpin sets how long a receive polls an empty ring before it arms
// the wake-up and sleeps (default 20 µs; zero sleeps at once).
func (s *end) SetRecvSpin(d time.Duration) { s.recvWait.Spin = d }

// Err returns why the stream is broken or closed, or nil.
func (s *end) Err() error { return s.failure() }

// markBroken records the first reason the stream died and wakes every
// waiter of this side so none sleeps on a dead stream.
func (s *end) markBroken(err error) {
	s.breakWith(err)
	s.sg.mark(gateBroken)
	s.rg.mark(gateBroken)
	for _, fd := range s.fds {
		eventfdSignal(fd)
	}
}

// Health reports Broken if the peer is gone or misbehaved, Sick if the
// stream dropped packets since the Tick before last, Normal otherwise.
func (s *end) Health() Health {
	if s.peerGone.Load() || s.peerClosedMapped() {
		return Broken
	}
	return s.health()
}

// Tick ends a health interval; the owner calls it periodically (the
// bridge's metrics loop), so "sick" means "dropped recently".
func (s *end) Tick() { s.tick() }

// Stats returns a snapshot of the counters.
func (s *end) Stats() Stats {
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

// peerDrops is what the bridge published as dropped for this stream's RX
// ring (application side) — informational, the bridge's own count is
// authoritative.
func (s *end) peerDrops() uint64 {
	if !s.bridge {
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
func (s *end) peerClosedMapped() bool {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	return s.mem == nil || atomic.LoadUint32(s.peerState) == stateClosed
}

// Send puts packets into the TX ring. It blocks until every packet is
// queued (backpressure) and returns len(pkts), or fewer and an error.
func (s *Stream) Send(pkts [][]byte) (int, error) { return s.sendMeta(pkts, nil) }

// SendMeta is Send with a metadata word per packet (meta may be nil).
func (s *Stream) SendMeta(pkts [][]byte, meta []uint32) (int, error) { return s.sendMeta(pkts, meta) }

// SetSendSpin sets how long a send polls a full ring before it arms the
// wake-up and sleeps (default 20 µs; zero sleeps at once).
func (s *Stream) SetSendSpin(d time.Duration) { s.sendWait.Spin = d }

// Send puts packets into the RX ring without ever waiting: packets that do
// not fit, or are larger than MaxPayload, are dropped and counted (the
// newest are the ones dropped; data the application has not read is never
// overwritten). It returns how many it queued or dropped as too big, and
// an error only once the stream is dead.
func (s *BridgeStream) Send(pkts [][]byte) (int, error) { return s.sendMeta(pkts, nil) }

// SendMeta is Send with a metadata word per packet (meta may be nil).
func (s *BridgeStream) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	return s.sendMeta(pkts, meta)
}

// sendMeta queues packets with their metadata words (meta may be nil):
// the bridge's end drops what does not fit, the application's waits.
func (s *end) sendMeta(pkts [][]byte, meta []uint32) (int, error) {
	if !s.sg.enter() {
		return 0, s.failure()
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
			if s.bridge {
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
		if s.bridge {
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
		if err := s.failure(); err != nil {
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
// Link for the buffer contract).
func (s *end) TryRecv(bufs [][]byte) (int, error) {
	return s.TryRecvMeta(bufs, nil)
}

// TryRecvMeta is TryRecv returning the metadata words too.
func (s *end) TryRecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	if !s.rg.enter() {
		return 0, s.failure()
	}
	n := 0
	defer func() { s.rg.leave(n) }()
	var err error
	n, err = s.tryRecvIn(bufs, meta)
	return n, err
}

// tryRecvIn is TryRecvMeta inside the gate, the stream known not dead at
// the last look.
func (s *end) tryRecvIn(bufs [][]byte, meta []uint32) (int, error) {
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
func (s *end) Recv(bufs [][]byte) (int, error) {
	return s.recvTimeoutMeta(bufs, nil, -1)
}

// RecvMeta is Recv returning the metadata words too (meta as long as bufs).
func (s *end) RecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	return s.recvTimeoutMeta(bufs, meta, -1)
}

// RecvTimeout is Recv giving up with ErrTimeout after d (d < 0: never).
func (s *end) RecvTimeout(bufs [][]byte, d time.Duration) (int, error) {
	return s.recvTimeoutMeta(bufs, nil, d)
}

func (s *end) recvTimeoutMeta(bufs [][]byte, meta []uint32, d time.Duration) (int, error) {
	if !s.rg.enter() {
		return 0, s.failure()
	}
	n := 0
	defer func() { s.rg.leave(n) }()
	for {
		var err error
		n, err = s.tryRecvIn(bufs, meta)
		if n > 0 || err != nil || len(bufs) == 0 {
			return n, err
		}
		if err := s.recvWait.wait(&s.rr, d); err != nil {
			return 0, err
		}
		if err := s.failure(); err != nil {
			return 0, err
		}
	}
}

// Close marks this side closed, wakes every waiter on both sides, and
// releases the mapping and descriptors once no Send or Recv is inside it.
// The peer sees the stream become Broken. A stream registered with an
// EventQueue may be closed at any time from any goroutine: the queue drops
// it at its next Wait and releases it then.
func (s *end) Close() error {
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
		if !s.leaveToQueue() {
			s.release()
		}
	})
	return nil
}

// release unmaps the region and closes the descriptors, waiting for any
// Send or Recv still inside.
func (s *end) release() {
	s.sg.seal()
	s.rg.seal()
	for _, fd := range s.fds {
		unix.Close(fd)
	}
	if s.memfd >= 0 {
		unix.Close(s.memfd)
	}
	s.lifeMu.Lock() // Health and peerDrops look at the region under it
	unix.Munmap(s.mem)
	s.mem = nil
	s.lifeMu.Unlock()
}
