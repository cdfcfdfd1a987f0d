package fabric

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// creditGate is the sender's half of APEnet+-style flow control. The
// receiver periodically publishes how many packets it has consumed; the
// sender may have at most high packets outstanding, and once it hits high
// it stops until outstanding falls to low or below. The hysteresis keeps
// the sender from restarting for every single credit, and because credits
// are published ahead of need the sender rarely waits a round trip.
type creditGate struct {
	high, low uint32
	sent      uint32        // packets sent (sender goroutine only)
	acked     atomic.Uint32 // consumed count last published by the peer
	stopped   bool
}

// allowance is how many packets may be sent now.
func (g *creditGate) allowance() int {
	out := g.sent - g.acked.Load()
	if g.stopped {
		if out > g.low {
			return 0
		}
		g.stopped = false
	}
	if out >= g.high {
		g.stopped = true
		return 0
	}
	return int(g.high - out)
}

// update accepts a credit only if it lies between the last one and what
// was sent: a stale, replayed or forged value cannot open the window.
func (g *creditGate) update(consumed uint32, sent uint32) bool {
	old := g.acked.Load()
	if consumed-old > sent-old {
		return false
	}
	g.acked.Store(consumed)
	return true
}

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
	// maxInner is the largest inner packet a GENEVE datagram can carry.
	maxInner = maxDatagram - geneveHdrLen
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
	one   [1][]byte
	pfd   [1]unix.PollFd
}

// ListenRemote opens a UDP socket bound to addr and starts its receive
// loop. The socket belongs to the network namespace of the calling thread.
func ListenRemote(addr netip.AddrPort, cfg RemoteConfig) (*Remote, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Remote{cfg: cfg, done: make(chan struct{}), v6: !addr.Addr().Unmap().Is4()}
	fam := unix.AF_INET
	if r.v6 {
		fam = unix.AF_INET6
	}
	r.fd, err = unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return nil, fmt.Errorf("fabric: udp socket: %w", err)
	}
	fail := func(err error) (*Remote, error) {
		unix.Close(r.fd)
		return nil, err
	}
	unix.SetsockoptInt(r.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	unix.SetsockoptInt(r.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4<<20)
	// Without IP_RECVERR an unconnected UDP socket never hears of ICMP
	// errors; with it they queue on the error queue, with the original
	// destination, which names the peer that has gone.
	if r.v6 {
		err = unix.SetsockoptInt(r.fd, unix.SOL_IPV6, unix.IPV6_RECVERR, 1)
	} else {
		err = unix.SetsockoptInt(r.fd, unix.SOL_IP, unix.IP_RECVERR, 1)
	}
	if err != nil {
		return fail(fmt.Errorf("fabric: IP_RECVERR: %w", err))
	}
	if !cfg.NoGSO {
		_, err := unix.GetsockoptInt(r.fd, unix.SOL_UDP, unix.UDP_SEGMENT)
		r.gso = err == nil
	}
	if !cfg.NoGRO {
		r.gro = unix.SetsockoptInt(r.fd, unix.SOL_UDP, unix.UDP_GRO, 1) == nil
	}
	if err := unix.Bind(r.fd, sockaddrOf(addr)); err != nil {
		return fail(fmt.Errorf("fabric: bind %v: %w", addr, err))
	}
	sa, err := unix.Getsockname(r.fd)
	if err != nil {
		return fail(err)
	}
	r.local = addrPortOf(sa)
	m := map[uint32]*RemoteStream{}
	r.streams.Store(&m)
	bufLen := cfg.SlotSize + geneveHdrLen + 64
	if r.gro {
		bufLen = 1 << 16 // a coalesced run is one datagram of up to 64 KiB
	}
	for i := range r.bufs {
		r.bufs[i] = make([]byte, bufLen)
		r.iovs[i].Base = &r.bufs[i][0]
		r.iovs[i].SetLen(len(r.bufs[i]))
		r.msgs[i].Hdr.Iov = &r.iovs[i]
		r.msgs[i].Hdr.SetIovlen(1)
		r.msgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&r.names[i]))
	}
	go r.loop()
	return r, nil
}

func sockaddrOf(a netip.AddrPort) unix.Sockaddr {
	if a.Addr().Unmap().Is4() {
		return &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().Unmap().As4()}
	}
	return &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
}

func addrPortOf(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// rawName is a peer address in kernel form, built once at registration
// so that sending needs no conversion and no allocation.
type rawName struct {
	sa  unix.RawSockaddrInet6 // large enough for either family
	len uint32
}

func makeRawName(a netip.AddrPort, v6 bool) rawName {
	var n rawName
	p := a.Port()
	if !v6 {
		s4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(&n.sa))
		s4.Family = unix.AF_INET
		s4.Addr = a.Addr().Unmap().As4()
		pb := (*[2]byte)(unsafe.Pointer(&s4.Port))
		pb[0], pb[1] = byte(p>>8), byte(p)
		n.len = unix.SizeofSockaddrInet4
		return n
	}
	n.sa.Family = unix.AF_INET6
	n.sa.Addr = a.Addr().As16()
	pb := (*[2]byte)(unsafe.Pointer(&n.sa.Port))
	pb[0], pb[1] = byte(p>>8), byte(p)
	n.len = unix.SizeofSockaddrInet6
	return n
}

// same compares a received source address with the registered one.
func (n *rawName) same(got *unix.RawSockaddrInet6, gotLen uint32) bool {
	if n.sa.Family != got.Family {
		return false
	}
	if n.sa.Family == unix.AF_INET {
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(&n.sa))
		b := (*unix.RawSockaddrInet4)(unsafe.Pointer(got))
		return a.Port == b.Port && a.Addr == b.Addr
	}
	return gotLen >= unix.SizeofSockaddrInet6 && n.sa.Port == got.Port && n.sa.Addr == got.Addr
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

	closed    atomic.Bool
	broken    atomic.Bool
	errMu     sync.Mutex
	err       error
	dead      chan struct{} // closed when the stream breaks or closes
	deadOnce  sync.Once
	closeOnce sync.Once

	// Receive side: the loop produces, Recv consumes.
	recvMu   sync.Mutex
	rxP      *Producer
	rxC      *Consumer
	rxWait   *Waiter
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
	dropped  atomic.Uint64
	tickPrev atomic.Uint64
	tickLast atomic.Uint64

	// Send side (one goroutine at a time, under sendMu).
	sendMu   sync.Mutex
	gate     creditGate
	creditCh chan struct{}
	gsoLimit int // largest segment the path took as GSO; smaller after EMSGSIZE
	smsgs    [remoteBatch]unix.Mmsghdr
	siovs    [2 * remoteBatch]unix.Iovec
	shdrs    [remoteBatch][geneveHdrLen]byte
	scmsg    [remoteBatch][24]byte
	scount   [remoteBatch]int // packets in each message
	sent     atomic.Uint64    // packets sent, as the credit check sees them (wraps)
	stalls   atomic.Uint64
}

type remoteReady struct{ s *RemoteStream }

func (r *remoteReady) ready() bool {
	s := r.s
	return s.rxC.Ready() || s.closed.Load() || s.broken.Load()
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
	p, c, err := NewRingPair(r.cfg.Depth, r.cfg.SlotSize)
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
	s.rxWait = newWaiter(efd, p.v.consArmed)
	s.rxReady.s = s
	s.gate.high, s.gate.low = uint32(r.cfg.High), uint32(r.cfg.Low)
	for i := range s.smsgs {
		h := &s.smsgs[i].Hdr
		h.Name = (*byte)(unsafe.Pointer(&s.peer.sa))
		h.Namelen = s.peer.len
		s.siovs[2*i].Base = &s.shdrs[i][0]
		s.siovs[2*i].SetLen(geneveHdrLen)
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

// loop receives batches with recvmmsg, demultiplexes them by VNI, refuses
// and counts what does not belong, publishes credits periodically and
// watches the peers.
func (r *Remote) loop() {
	defer close(r.done)
	tick := r.cfg.CreditInterval
	next := time.Now().Add(tick)
	ms := int((tick + time.Millisecond - 1) / time.Millisecond)
	for !r.closed.Load() {
		r.pfd[0] = unix.PollFd{Fd: int32(r.fd), Events: unix.POLLIN}
		unix.Poll(r.pfd[:], ms)
		r.loopMu.Lock()
		r.now = time.Now()
		if r.pfd[0].Revents&unix.POLLERR != 0 {
			r.readErrors()
		}
		for {
			for i := range r.msgs {
				r.msgs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
				r.msgs[i].Hdr.Flags = 0
				if r.gro {
					r.msgs[i].Hdr.Control = &r.ctrl[i][0]
					r.msgs[i].Hdr.SetControllen(len(r.ctrl[i]))
				}
			}
			n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(r.fd), uintptr(unsafe.Pointer(&r.msgs[0])), remoteBatch, unix.MSG_DONTWAIT, 0, 0)
			if errno != 0 || n == 0 {
				break // EAGAIN, or a pending ICMP error reported once
			}
			m := *r.streams.Load()
			for i := 0; i < int(n); i++ {
				r.deliver(m, i)
			}
			if int(n) < remoteBatch {
				break
			}
		}
		if !r.now.Before(next) {
			r.tick()
			next = r.now.Add(tick)
		}
		r.loopMu.Unlock()
	}
}

// groSize returns the segment size of a coalesced datagram, or 0.
func (r *Remote) groSize(i int) int {
	h := &r.msgs[i].Hdr
	if !r.gro || h.Controllen < uint64(unix.CmsgLen(4)) {
		return 0
	}
	c := r.ctrl[i][:h.Controllen]
	for len(c) >= unix.SizeofCmsghdr {
		ch := (*unix.Cmsghdr)(unsafe.Pointer(&c[0]))
		l := int(ch.Len)
		if l < unix.SizeofCmsghdr || l > len(c) {
			return 0
		}
		if ch.Level == unix.SOL_UDP && ch.Type == unix.UDP_GRO && l >= unix.CmsgLen(4) {
			return int(*(*int32)(unsafe.Pointer(&c[unix.SizeofCmsghdr])))
		}
		c = c[min(len(c), unix.CmsgSpace(l-unix.SizeofCmsghdr)):]
	}
	return 0
}

func (r *Remote) deliver(m map[uint32]*RemoteStream, i int) {
	h := &r.msgs[i]
	if h.Hdr.Flags&unix.MSG_TRUNC != 0 {
		r.malformed.Add(1)
		return
	}
	b := r.bufs[i][:h.Len]
	seg := r.groSize(i)
	if seg <= 0 || seg >= len(b) {
		r.deliverOne(m, b, &r.names[i], h.Hdr.Namelen)
		return
	}
	r.coalesced.Add(1)
	for len(b) > 0 {
		k := min(seg, len(b))
		r.deliverOne(m, b[:k], &r.names[i], h.Hdr.Namelen)
		b = b[k:]
	}
}

func (r *Remote) deliverOne(m map[uint32]*RemoteStream, b []byte, name *unix.RawSockaddrInet6, nameLen uint32) {
	g, err := parseGeneve(b)
	if err != nil {
		r.malformed.Add(1)
		return
	}
	s := m[g.vni]
	if s == nil {
		r.wrongVNI.Add(1)
		return
	}
	if !s.peer.same(name, nameLen) {
		r.wrongSource.Add(1)
		return
	}
	s.heard, s.lastRx = true, r.now
	if g.hasCredit {
		if s.gate.update(g.credit, s.sentCount()) {
			r.credits.Add(1)
			select {
			case s.creditCh <- struct{}{}:
			default:
			}
		} else {
			r.badCredits.Add(1)
		}
	}
	if g.goodbye {
		s.markBroken(fmt.Errorf("%w: peer %v closed stream %d", ErrPeerGone, s.peerAP, s.vni))
	}
	if g.control {
		return
	}
	if s.closed.Load() || s.broken.Load() {
		r.dead.Add(1)
		return
	}
	if len(g.payload) > s.MaxPayload() {
		r.malformed.Add(1)
		return
	}
	r.one[0] = g.payload
	if n, _ := s.rxP.Produce(r.one[:]); n != 1 {
		r.overflow.Add(1)
		s.dropped.Add(1)
		return
	}
	r.received.Add(1)
}

// tick runs every CreditInterval: credits, keepalives, peer timeouts.
func (r *Remote) tick() {
	keep := r.cfg.PeerTimeout / 4
	for _, s := range *r.streams.Load() {
		if s.closed.Load() || s.broken.Load() {
			continue
		}
		force := r.now.Sub(s.lastKeep) >= keep
		if s.publish(false, force) {
			s.lastKeep = r.now
		}
		if silent := r.now.Sub(s.lastRx); silent > r.cfg.PeerTimeout {
			s.markBroken(fmt.Errorf("%w: nothing from %v on stream %d for %v", ErrPeerGone, s.peerAP, s.vni, silent.Round(time.Millisecond)))
		}
	}
}

// readErrors drains the socket's error queue. An ICMP port unreachable
// names, as the original destination, a peer whose socket is gone: every
// stream to it that has heard from it breaks. Streams that have never
// heard from their peer ignore it, because a peer that has not started
// yet looks the same; PeerTimeout covers them. Rare, so it may allocate.
func (r *Remote) readErrors() {
	var data [64]byte
	var oob [256]byte
	for {
		_, oobn, _, from, err := unix.Recvmsg(r.fd, data[:], oob[:], unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if err != nil {
			return
		}
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			continue
		}
		refused := false
		for _, cm := range cms {
			isErr := (cm.Header.Level == unix.SOL_IP && cm.Header.Type == unix.IP_RECVERR) ||
				(cm.Header.Level == unix.SOL_IPV6 && cm.Header.Type == unix.IPV6_RECVERR)
			if isErr && len(cm.Data) >= int(unsafe.Sizeof(unix.SockExtendedErr{})) {
				ee := (*unix.SockExtendedErr)(unsafe.Pointer(&cm.Data[0]))
				refused = refused || unix.Errno(ee.Errno) == unix.ECONNREFUSED
			}
		}
		if !refused || from == nil {
			continue
		}
		dst := addrPortOf(from)
		if !r.v6 {
			dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
		}
		hit := false
		for _, s := range *r.streams.Load() {
			if s.peerAP == dst && s.heard {
				hit = true
				s.markBroken(fmt.Errorf("%w: %v answers port unreachable (stream %d)", ErrPeerGone, dst, s.vni))
			}
		}
		if hit {
			r.unreachable.Add(1)
		}
	}
}

func (s *RemoteStream) sentCount() uint32 { return uint32(s.sent.Load()) }

// publish announces how much this side has consumed if that changed (from
// Recv: only once it grew by half the hysteresis band), or in any case
// when force is set (a keepalive). It reports whether it sent.
func (s *RemoteStream) publish(fromRecv, force bool) bool {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	c := s.consumed.Load() // under the lock, so published values never go back
	if !force {
		if c == s.pubbed {
			return false
		}
		if fromRecv && c-s.pubbed < uint32(s.r.cfg.High-s.r.cfg.Low)/2 {
			return false
		}
	}
	putCredit(s.pubBuf[:], s.vni, c)
	if s.sendCtl(s.pubBuf[:]) {
		s.pubbed = c
		return true
	}
	return false
}

// sendCtl sends one control datagram to the peer.
func (s *RemoteStream) sendCtl(b []byte) bool {
	_, _, errno := unix.Syscall6(unix.SYS_SENDTO, uintptr(s.r.fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), 0,
		uintptr(unsafe.Pointer(&s.peer.sa)), uintptr(s.peer.len))
	return errno == 0
}

// markBroken records the first reason and wakes Recv and Send. The loop
// calls it while holding loopMu, so the eventfd is still open.
func (s *RemoteStream) markBroken(err error) {
	s.errMu.Lock()
	if s.err == nil {
		s.err = errors.Join(ErrBroken, err)
	}
	s.errMu.Unlock()
	s.broken.Store(true)
	s.deadOnce.Do(func() { close(s.dead) })
	eventfdSignal(s.efd)
}

// Err returns why the stream is broken or closed, or nil.
func (s *RemoteStream) Err() error {
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

// Health reports Broken once the stream is closed or its peer gone, Sick
// if packets overflowed its queue since the Tick before last (the peer
// ignored credits), Normal otherwise.
func (s *RemoteStream) Health() Health {
	if s.closed.Load() || s.broken.Load() {
		return Broken
	}
	if s.dropped.Load() > s.tickPrev.Load() {
		return Sick
	}
	return Normal
}

// Tick ends a health interval (see Stream.Tick).
func (s *RemoteStream) Tick() {
	s.tickPrev.Store(s.tickLast.Load())
	s.tickLast.Store(s.dropped.Load())
}

// MaxPayload is the largest packet Send accepts and Recv returns.
func (s *RemoteStream) MaxPayload() int { return min(s.r.cfg.SlotSize-recHdr, maxInner) }

// VNI is the stream's id on the wire.
func (s *RemoteStream) VNI() uint32 { return s.vni }

// Recv waits for packets of this stream (buffer contract as Consumer.Consume).
func (s *RemoteStream) Recv(bufs [][]byte) (int, error) { return s.RecvTimeout(bufs, -1) }

// RecvTimeout is Recv giving up with ErrTimeout after d (d < 0: never).
// Packets that arrived before the peer went away are delivered first.
func (s *RemoteStream) RecvTimeout(bufs [][]byte, d time.Duration) (int, error) {
	s.recvMu.Lock()
	defer s.recvMu.Unlock()
	for {
		n, err := s.tryRecvLocked(bufs)
		if n > 0 || err != nil || len(bufs) == 0 {
			return n, err
		}
		if err := s.rxWait.wait(&s.rxReady, d); err != nil {
			return 0, err
		}
	}
}

// TryRecv takes up to len(bufs) packets without waiting.
func (s *RemoteStream) TryRecv(bufs [][]byte) (int, error) {
	s.recvMu.Lock()
	defer s.recvMu.Unlock()
	return s.tryRecvLocked(bufs)
}

func (s *RemoteStream) tryRecvLocked(bufs [][]byte) (int, error) {
	if s.closed.Load() {
		return 0, ErrClosed
	}
	// Look at broken before the ring: the loop queues a peer's last
	// packets before it marks the stream broken, so a ring found empty
	// after broken was seen is empty for good.
	broken := s.broken.Load()
	n, err := s.rxC.Consume(bufs)
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

// Send transmits packets (IPv4 or IPv6, starting at the IP header) with
// one sendmmsg per batch, waiting for credit when the peer's queue is at
// its high-water mark (backpressure, as on the shm TX ring). It returns
// len(pkts), or fewer and an error.
//
// With GSO, each run of packets of one length (and at most one shorter
// packet ending it) is a single sendmmsg entry that the kernel, or the
// NIC, cuts into one datagram per packet: the same datagrams on the wire,
// one pass through the stack instead of one per packet. A path that
// refuses a segment size (EMSGSIZE: it exceeds the MTU, where a single
// datagram would have been fragmented) makes the stream send that size
// and larger ones singly from then on.
func (s *RemoteStream) Send(pkts [][]byte) (int, error) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	done, retries := 0, 0
	maxLen := s.MaxPayload()
	for done < len(pkts) {
		if err := s.Err(); err != nil {
			return done, err
		}
		allow := s.gate.allowance()
		if allow == 0 {
			s.stalls.Add(1)
			select {
			case <-s.creditCh:
			case <-s.dead:
			case <-s.r.done:
				return done, ErrClosed
			}
			continue
		}
		k := min(allow, len(pkts)-done, remoteBatch)
		batch := pkts[done : done+k]
		for i, pkt := range batch {
			proto, ok := protoFor(pkt)
			if !ok || len(pkt) > maxLen {
				return done, fmt.Errorf("%w: packet %d is not an IP packet of at most %d bytes", ErrTooBig, done+i, maxLen)
			}
			putGeneve(s.shdrs[i][:], s.vni, proto, 0, false)
			s.siovs[2*i+1].Base = &pkt[0]
			s.siovs[2*i+1].SetLen(len(pkt))
		}
		nmsg := s.group(batch)
		// Count the batch as sent before it leaves: the peer may consume
		// and credit it before sendmmsg returns, and a credit beyond the
		// sent count would be refused as forged.
		s.sent.Add(uint64(k))
		n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(s.r.fd), uintptr(unsafe.Pointer(&s.smsgs[0])), uintptr(nmsg), 0, 0, 0)
		runtime.KeepAlive(pkts)
		for i := range batch {
			s.siovs[2*i+1].Base = nil // do not keep the caller's buffers reachable
		}
		if errno != 0 {
			n = 0
		}
		left := 0
		for i := int(n); i < nmsg; i++ {
			left += s.scount[i]
		}
		for i := 0; i < int(n); i++ {
			if s.scount[i] > 1 {
				s.r.segmented.Add(1)
			}
		}
		if left > 0 {
			s.sent.Add(^uint64(left - 1)) // subtract what did not leave
		}
		done += k - left
		s.gate.sent += uint32(k - left)
		switch {
		case errno == 0 || errno == unix.EINTR || errno == unix.EAGAIN || errno == unix.ENOBUFS:
		case s.scount[n] > 1 && (errno == unix.EMSGSIZE || errno == unix.EINVAL || errno == unix.EIO):
			// The path will not take this segment size as GSO.
			s.gsoLimit = geneveHdrLen + len(pkts[done]) - 1
		case retries < 8 && (errno == unix.ECONNREFUSED || errno == unix.EHOSTUNREACH ||
			errno == unix.ENETUNREACH || errno == unix.EHOSTDOWN || errno == unix.EMSGSIZE):
			// An ICMP error queued for the socket (IP_RECVERR) is
			// reported once, by whichever call comes next, whatever
			// peer it concerns; the loop reads the details. Retry.
			retries++
		default:
			return done, fmt.Errorf("fabric: sendmmsg to %v: %w", s.peerAP, errno)
		}
	}
	return done, nil
}

// group lays out one batch (GENEVE headers and iovecs already filled)
// as sendmmsg entries and returns how many. Without GSO every packet is
// an entry; with it, a run of packets of one length, ended by at most
// one shorter packet, shares an entry with a UDP_SEGMENT control message,
// as the kernel requires (every segment full-sized but the last).
func (s *RemoteStream) group(batch [][]byte) int {
	nmsg := 0
	for i := 0; i < len(batch); {
		seg := geneveHdrLen + len(batch[i])
		j := i + 1
		if s.r.gso && seg <= s.gsoLimit {
			total := seg
			for j < len(batch) && j-i < maxGSOSegs {
				l := geneveHdrLen + len(batch[j])
				if l > seg || total+l > maxDatagram {
					break
				}
				total += l
				j++
				if l < seg {
					break
				}
			}
		}
		h := &s.smsgs[nmsg].Hdr
		h.Iov = &s.siovs[2*i]
		h.SetIovlen(2 * (j - i))
		if j-i > 1 {
			c := &s.scmsg[nmsg]
			*(*uint16)(unsafe.Pointer(&c[unix.SizeofCmsghdr])) = uint16(seg)
			h.Control = &c[0]
			h.SetControllen(cmsgSegLen)
		} else {
			h.Control = nil
			h.SetControllen(0)
		}
		s.scount[nmsg] = j - i
		nmsg++
		i = j
	}
	return nmsg
}

// Stalls counts how often Send waited for credit.
func (s *RemoteStream) Stalls() uint64 { return s.stalls.Load() }

// Close says goodbye to the peer (which breaks its end once drained),
// unregisters the stream, wakes Recv and Send, and releases its eventfd
// once neither is inside. The VNI may be registered again afterwards.
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
		unix.Close(s.efd)
		s.recvMu.Unlock()
		s.sendMu.Unlock()
	})
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
