package fabric

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// RemoteConfig tunes the remote transport. Zero fields take defaults.
type RemoteConfig struct {
	// Depth is each stream's receive queue (power of two); default 1024.
	Depth int
	// High and Low are the credit water marks in packets; defaults
	// 3/4 and 1/4 of Depth. High must not exceed Depth.
	High, Low int
	// CreditInterval is how often unpublished consumption is announced
	// even if it is small; default 500 µs.
	CreditInterval time.Duration
	// SlotSize bounds the inner packet (SlotSize-8 bytes); default 2048.
	SlotSize int
	// PeerTimeout: a stream that hears nothing from its peer (no data,
	// credit or keepalive) for this long breaks with ErrPeerGone. Every
	// stream sends a keepalive each PeerTimeout/4, so a live peer never
	// trips it, idle or not. Default 3 s.
	PeerTimeout time.Duration
	// NoGSO keeps UDP segmentation offload off: without it, a run of
	// equal-sized packets leaves in one sendmmsg entry as a UDP_SEGMENT
	// super-datagram where the kernel offers that (Linux 4.18+).
	NoGSO bool
	// NoGRO keeps UDP receive offload off: without it the socket sets
	// UDP_GRO (Linux 5.0+) and accepts coalesced runs of datagrams.
	NoGRO bool
}

func (c RemoteConfig) withDefaults() (RemoteConfig, error) {
	if c.Depth == 0 {
		c.Depth = 1024
	}
	if c.High == 0 {
		c.High = c.Depth * 3 / 4
	}
	if c.Low == 0 {
		c.Low = c.Depth / 4
	}
	if c.CreditInterval == 0 {
		c.CreditInterval = 500 * time.Microsecond
	}
	if c.SlotSize == 0 {
		c.SlotSize = 2048
	}
	if c.PeerTimeout == 0 {
		c.PeerTimeout = 3 * time.Second
	}
	if _, err := checkRing(uint64(c.Depth), uint64(c.SlotSize)); err != nil {
		return c, err
	}
	if c.High > c.Depth || c.Low >= c.High || c.Low < 0 {
		return c, fmt.Errorf("%w: need 0 <= Low < High <= Depth", ErrBadConfig)
	}
	if c.CreditInterval < 0 || c.PeerTimeout < 4*c.CreditInterval {
		return c, fmt.Errorf("%w: need PeerTimeout >= 4 * CreditInterval > 0", ErrBadConfig)
	}
	return c, nil
}

// RemoteCounters count what a Remote endpoint received and refused.
type RemoteCounters struct {
	Received          uint64 // data packets accepted into a stream
	WrongVNI          uint64 // refused: no stream registered with that VNI
	WrongSource       uint64 // refused: VNI known, but not from its registered address and port
	Malformed         uint64 // refused: not valid GENEVE or not IP inside
	Overflow          uint64 // dropped: peer ignored credits and overfilled the queue
	Dead              uint64 // dropped: data for a stream already broken or closing
	Credits           uint64 // credit updates accepted (keepalives included)
	BadCredits        uint64 // credit updates refused as impossible
	Unreachable       uint64 // ICMP port unreachable for a peer (its streams broke)
	SentSegmented     uint64 // UDP GSO super-datagrams sent (each several packets)
	ReceivedCoalesced uint64 // UDP GRO super-datagrams received (each several packets)
}

const (
	remoteBatch = 64
	// maxGSOSegs is UDP_MAX_SEGMENTS of the oldest kernel with UDP GSO.
	maxGSOSegs = 64
	// maxDatagram is the largest UDP payload that fits an IPv6 (or, with
	// room to spare, an IPv4) packet without jumbograms.
	maxDatagram = 0xFFFF - 40 - 8
	// maxInner is the largest inner packet a GENEVE datagram can carry,
	// with room for the marks option.
	maxInner = maxDatagram - geneveHdrLen - marksOptLen
)

var cmsgSegLen = unix.CmsgSpace(2) // UDP_SEGMENT: u16 segment size

// Remote is one UDP endpoint of the remote transport: on the bridge it
// serves the streams of applications on other nodes; on such a node it is
// the application's end. Both ends register each stream with the VNI and
// the peer's address and port, and accept that stream's packets only from
// there. It needs no privileges (an unprivileged port works as well as
// 6081).
//
// One goroutine (the loop) receives with recvmmsg, demultiplexes by VNI,
// publishes credits and keepalives, and watches each stream's peer: a
// stream breaks with ErrPeerGone when its peer says goodbye, stays silent
// for PeerTimeout, or, once it has been heard from, its host answers with
// ICMP port unreachable (read from the socket's error queue, IP_RECVERR).
type Remote struct {
	fd       int
	v6       bool
	gso, gro bool
	local    netip.AddrPort
	cfg      RemoteConfig
	streams  atomic.Pointer[map[uint32]*RemoteStream]
	regMu    sync.Mutex // registration only, never on the packet path
	loopMu   sync.Mutex // held by the loop while it uses streams
	closed   atomic.Bool
	done     chan struct{}

	received, wrongVNI, wrongSource, malformed, overflow, dead atomic.Uint64
	credits, badCredits, unreachable, segmented, coalesced     atomic.Uint64

	// Receive state, owned by the loop goroutine.
	now   time.Time
	msgs  [remoteBatch]unix.Mmsghdr
	iovs  [remoteBatch]unix.Iovec
	bufs  [remoteBatch][]byte
	names [remoteBatch]unix.RawSockaddrInet6
	ctrl  [remoteBatch][32]byte // UDP_GRO control message
	// Data packets of one stream (cur), waiting to be queued together.
	cur      *RemoteStream
	held     [remoteBatch][]byte
	heldMeta [remoteBatch]uint32 // their marks
	nh       int
	pfd      [1]unix.PollFd
}

// LocalAddr is the bound address.
func (r *Remote) LocalAddr() netip.AddrPort { return r.local }

// Offload reports whether this endpoint sends with UDP GSO and receives
// with UDP GRO (the kernel offers them and the configuration allows them).
func (r *Remote) Offload() (gso, gro bool) { return r.gso, r.gro }

// Counters returns a snapshot of the endpoint's counters.
func (r *Remote) Counters() RemoteCounters {
	return RemoteCounters{
		Received: r.received.Load(), WrongVNI: r.wrongVNI.Load(), WrongSource: r.wrongSource.Load(),
		Malformed: r.malformed.Load(), Overflow: r.overflow.Load(), Dead: r.dead.Load(),
		Credits: r.credits.Load(), BadCredits: r.badCredits.Load(), Unreachable: r.unreachable.Load(),
		SentSegmented: r.segmented.Load(), ReceivedCoalesced: r.coalesced.Load(),
	}
}

// Register creates the stream with the given VNI whose packets must come
// from, and go to, peer. The peer has PeerTimeout to be heard from.
func (r *Remote) Register(vni uint32, peer netip.AddrPort) (*RemoteStream, error) {
	if vni > maxVNI {
		return nil, fmt.Errorf("%w: VNI %d does not fit 24 bits", ErrBadConfig, vni)
	}
	if peer.Addr().Unmap().Is4() == r.v6 {
		return nil, fmt.Errorf("%w: peer %v is not of the socket's address family", ErrBadConfig, peer)
	}
	if !r.v6 {
		peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
	}
	if r.closed.Load() {
		return nil, ErrClosed
	}
	p, c, err := newRingPair(r.cfg.Depth, r.cfg.SlotSize)
	if err != nil {
		return nil, err
	}
	efd, err := newEventfd()
	if err != nil {
		return nil, err
	}
	p.wake.fd = efd
	now := time.Now()
	s := &RemoteStream{
		r: r, vni: vni, peer: makeRawName(peer, r.v6), peerAP: peer,
		rxP: p, rxC: c, efd: efd, creditCh: make(chan struct{}, 1), dead: make(chan struct{}),
		lastRx: now, lastKeep: now, gsoLimit: maxDatagram,
	}
	s.bridged.s = s
	s.rxWait = newWaiter(efd, p.v.consArmed)
	s.rxReady.s = s
	s.gate.high, s.gate.low = uint32(r.cfg.High), uint32(r.cfg.Low)
	for i := range s.smsgs {
		h := &s.smsgs[i].Hdr
		h.Name = (*byte)(unsafe.Pointer(&s.peer.sa))
		h.Namelen = s.peer.len
		s.siovs[2*i].Base = &s.shdrs[i][0]
		ch := (*unix.Cmsghdr)(unsafe.Pointer(&s.scmsg[i][0]))
		ch.Level, ch.Type = unix.SOL_UDP, unix.UDP_SEGMENT
		ch.SetLen(unix.CmsgLen(2))
	}
	r.regMu.Lock()
	defer r.regMu.Unlock()
	old := *r.streams.Load()
	if r.closed.Load() {
		unix.Close(efd)
		return nil, ErrClosed
	}
	if _, dup := old[vni]; dup {
		unix.Close(efd)
		return nil, fmt.Errorf("%w: VNI %d already registered", ErrBadConfig, vni)
	}
	m := make(map[uint32]*RemoteStream, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[vni] = s
	r.streams.Store(&m)
	return s, nil
}

// Close stops the endpoint's loop, closes its streams (each says goodbye
// to its peer) and then its socket.
func (r *Remote) Close() error {
	if r.closed.Swap(true) {
		return errors.New("fabric: remote already closed")
	}
	<-r.done
	r.regMu.Lock() // a Register from now on sees closed
	m := *r.streams.Load()
	r.regMu.Unlock()
	for _, s := range m {
		s.shutdown()
	}
	return unix.Close(r.fd)
}
