package fabric

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// RemoteStream is one stream over a Remote endpoint: packets sent go to the
// registered peer under the stream's VNI, packets received from that peer
// under that VNI are queued for Recv. It offers what the application side
// of a shm Stream offers (see Link): one goroutine may send while another
// receives, and Close, from any goroutine, unblocks both.
type RemoteStream struct {
	r      *Remote
	vni    uint32
	peer   rawName
	peerAP netip.AddrPort

	condition
	tenancy   // a bridge's EventQueue gathering it (see Bridge)
	bridged   RemoteBridge
	dead      chan struct{} // closed when the stream breaks or closes
	deadOnce  sync.Once
	closeOnce sync.Once

	// Receive side: the loop produces, Recv consumes.
	recvMu   sync.Mutex
	rxP      *producer
	rxC      *consumer
	rxWait   *waiter
	rxReady  remoteReady
	efd      int
	consumed atomic.Uint32 // packets taken by Recv
	pubMu    sync.Mutex    // Recv and the loop both publish credits
	pubbed   uint32        // consumed count last published (under pubMu)
	pubBuf   [creditMsgLen]byte

	// Peer watch, owned by the loop.
	heard    bool      // the peer has spoken at least once
	lastRx   time.Time // when it last did (registration before that)
	lastKeep time.Time // when we last sent it a keepalive

	// Send side (one goroutine at a time, under sendMu).
	sendMu   sync.Mutex
	gate     creditGate
	creditCh chan struct{}
	gsoLimit int // largest segment the path took as GSO; smaller after EMSGSIZE
	smsgs    [remoteBatch]unix.Mmsghdr
	siovs    [2 * remoteBatch]unix.Iovec
	shdrs    [remoteBatch][geneveHdrLen + marksOptLen]byte
	shlen    [remoteBatch]int // bytes of shdrs in use: a marked packet's are longer
	scmsg    [remoteBatch][24]byte
	scount   [remoteBatch]int // packets in each message
	sent     atomic.Uint64    // packets sent, as the credit check sees them (wraps)
	stalls   atomic.Uint64
}

type remoteReady struct{ s *RemoteStream }

func (r *remoteReady) ready() bool {
	s := r.s
	return s.rxC.Ready() || s.ended()
}

// markBroken records the first reason and wakes Recv and Send. The loop
// calls it while holding loopMu, so the eventfd is still open.
func (s *RemoteStream) markBroken(err error) {
	s.breakWith(err)
	s.deadOnce.Do(func() { close(s.dead) })
	eventfdSignal(s.efd)
}

// Err returns why the stream is broken or closed, or nil.
func (s *RemoteStream) Err() error { return s.failure() }

// Health reports Broken once the stream is closed or its peer gone, Sick
// if packets were dropped since the Tick before last (the peer ignored
// credits and overfilled the queue, or, through Bridge, the peer had no
// credit left for the bridge's packets), Normal otherwise.
func (s *RemoteStream) Health() Health { return s.health() }

// Tick ends a health interval (see Stream.Tick).
func (s *RemoteStream) Tick() { s.tick() }

// MaxPayload is the largest packet Send accepts and Recv returns.
func (s *RemoteStream) MaxPayload() int { return min(s.r.cfg.SlotSize-recHdr, maxInner) }

// VNI is the stream's id on the wire.
func (s *RemoteStream) VNI() uint32 { return s.vni }

// Recv waits for packets of this stream (buffer contract as in Link).
func (s *RemoteStream) Recv(bufs [][]byte) (int, error) { return s.RecvTimeout(bufs, -1) }

// RecvMeta is Recv returning each packet's metadata word too: the marks
// the peer sent with it (see the marks option in geneve.go), 0 if none.
func (s *RemoteStream) RecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	return s.recvTimeoutMeta(bufs, meta, -1)
}

// RecvTimeout is Recv giving up with ErrTimeout after d (d < 0: never).
// Packets that arrived before the peer went away are delivered first.
func (s *RemoteStream) RecvTimeout(bufs [][]byte, d time.Duration) (int, error) {
	return s.recvTimeoutMeta(bufs, nil, d)
}

func (s *RemoteStream) recvTimeoutMeta(bufs [][]byte, meta []uint32, d time.Duration) (int, error) {
	s.recvMu.Lock()
	defer s.recvMu.Unlock()
	for {
		n, err := s.tryRecvLocked(bufs, meta)
		if n > 0 || err != nil || len(bufs) == 0 {
			return n, err
		}
		if err := s.rxWait.wait(&s.rxReady, d); err != nil {
			return 0, err
		}
	}
}

// TryRecv takes up to len(bufs) packets without waiting.
func (s *RemoteStream) TryRecv(bufs [][]byte) (int, error) { return s.TryRecvMeta(bufs, nil) }

// TryRecvMeta is TryRecv returning the metadata words too (see RecvMeta).
func (s *RemoteStream) TryRecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	s.recvMu.Lock()
	defer s.recvMu.Unlock()
	return s.tryRecvLocked(bufs, meta)
}

func (s *RemoteStream) tryRecvLocked(bufs [][]byte, meta []uint32) (int, error) {
	if s.closed.Load() {
		return 0, ErrClosed
	}
	// Look at broken before the ring: the loop queues a peer's last
	// packets before it marks the stream broken, so a ring found empty
	// after broken was seen is empty for good.
	broken := s.broken.Load()
	n, err := s.rxC.ConsumeMeta(bufs, meta)
	if n > 0 {
		s.consumed.Add(uint32(n))
		s.publish(true, false)
		return n, nil
	}
	if err != nil {
		return 0, err
	}
	if broken {
		return 0, s.Err()
	}
	return 0, nil
}

// Stalls counts how often Send waited for credit.
func (s *RemoteStream) Stalls() uint64 { return s.stalls.Load() }

// Close says goodbye to the peer (which breaks its end once drained),
// unregisters the stream, wakes Recv and Send, and releases its eventfd
// once neither is inside (or, when a bridge's EventQueue holds it, once the
// queue lets go). The VNI may be registered again afterwards.
func (s *RemoteStream) Close() error {
	s.shutdown()
	return nil
}

func (s *RemoteStream) shutdown() {
	s.closeOnce.Do(func() {
		r := s.r
		s.closed.Store(true)
		s.deadOnce.Do(func() { close(s.dead) })
		eventfdSignal(s.efd)
		r.regMu.Lock()
		old := *r.streams.Load()
		if old[s.vni] == s {
			m := make(map[uint32]*RemoteStream, len(old))
			for k, v := range old {
				if v != s {
					m[k] = v
				}
			}
			r.streams.Store(&m)
		}
		r.regMu.Unlock()
		r.loopMu.Lock() // the loop has let go of the old map
		r.loopMu.Unlock()
		s.sendMu.Lock()
		s.recvMu.Lock()
		var bye [closeMsgLen]byte
		putGoodbye(bye[:], s.vni)
		s.pubMu.Lock()
		s.sendCtl(bye[:]) // Remote.Close closes the socket only after this
		s.pubMu.Unlock()
		if !s.leaveToQueue() {
			unix.Close(s.efd)
		}
		s.recvMu.Unlock()
		s.sendMu.Unlock()
	})
}
