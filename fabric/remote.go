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
	if err := checkRing(uint64(c.Depth), uint64(c.SlotSize)); err != nil {
		return c, err
	}
	if c.High > c.Depth || c.Low >= c.High || c.Low < 0 {
		return c, fmt.Errorf("%w: need 0 <= Low < High <= Depth", ErrBadConfig)
	}
	return c, nil
}

// RemoteCounters count what a Remote endpoint received and refused.
type RemoteCounters struct {
	Received    uint64 // data packets accepted into a stream
	WrongVNI    uint64 // refused: no stream registered with that VNI
	WrongSource uint64 // refused: VNI known, but not from its registered address and port
	Malformed   uint64 // refused: not valid GENEVE or not IP inside
	Overflow    uint64 // dropped: peer ignored credits and overfilled the queue
	Credits     uint64 // credit updates accepted
	BadCredits  uint64 // credit updates refused as impossible
}

const remoteBatch = 64

// Remote is one UDP endpoint of the remote transport: on the bridge it
// serves the streams of applications on other nodes; on such a node it is
// the application's end. Both ends register each stream with the VNI and
// the peer's address and port, and accept that stream's packets only from
// there. It needs no privileges (an unprivileged port works as well as
// 6081).
type Remote struct {
	fd      int
	v6      bool
	local   netip.AddrPort
	cfg     RemoteConfig
	streams atomic.Pointer[map[uint32]*RemoteStream]
	regMu   sync.Mutex // registration only, never on the packet path
	closed  atomic.Bool
	done    chan struct{}

	received, wrongVNI, wrongSource, malformed, overflow, credits, badCredits atomic.Uint64

	// Receive state, owned by the loop goroutine.
	msgs  [remoteBatch]unix.Mmsghdr
	iovs  [remoteBatch]unix.Iovec
	bufs  [remoteBatch][]byte
	names [remoteBatch]unix.RawSockaddrInet6
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
	unix.SetsockoptInt(r.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	unix.SetsockoptInt(r.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4<<20)
	if err := unix.Bind(r.fd, sockaddrOf(addr)); err != nil {
		unix.Close(r.fd)
		return nil, fmt.Errorf("fabric: bind %v: %w", addr, err)
	}
	sa, err := unix.Getsockname(r.fd)
	if err != nil {
		unix.Close(r.fd)
		return nil, err
	}
	r.local = addrPortOf(sa)
	m := map[uint32]*RemoteStream{}
	r.streams.Store(&m)
	for i := range r.bufs {
		r.bufs[i] = make([]byte, cfg.SlotSize+geneveHdrLen+64)
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

// Counters returns a snapshot of the endpoint's counters.
func (r *Remote) Counters() RemoteCounters {
	return RemoteCounters{
		Received: r.received.Load(), WrongVNI: r.wrongVNI.Load(), WrongSource: r.wrongSource.Load(),
		Malformed: r.malformed.Load(), Overflow: r.overflow.Load(), Credits: r.credits.Load(), BadCredits: r.badCredits.Load(),
	}
}

// RemoteStream is one stream over a Remote endpoint: packets sent go to the
// registered peer under the stream's VNI, packets received from that peer
// under that VNI are queued for Recv.
type RemoteStream struct {
	r    *Remote
	vni  uint32
	peer rawName

	// Receive side: the loop produces, Recv consumes.
	rxP      *Producer
	rxC      *Consumer
	rxWait   *Waiter
	rxReady  remoteReady
	efd      int
	consumed atomic.Uint32 // packets taken by Recv
	pubMu    sync.Mutex    // Recv and the loop both publish credits
	pubbed   uint32        // consumed count last published (under pubMu)
	pubBuf   [creditMsgLen]byte

	// Send side (one goroutine).
	sendMu   sync.Mutex
	gate     creditGate
	creditCh chan struct{}
	smsgs    [remoteBatch]unix.Mmsghdr
	siovs    [remoteBatch][2]unix.Iovec
	shdrs    [remoteBatch][geneveHdrLen]byte
	sent     atomic.Uint64
	stalls   atomic.Uint64
}

type remoteReady struct{ s *RemoteStream }

func (r *remoteReady) ready() bool { return r.s.rxC.Ready() || r.s.r.closed.Load() }

// Register creates the stream with the given VNI whose packets must come
// from, and go to, peer.
func (r *Remote) Register(vni uint32, peer netip.AddrPort) (*RemoteStream, error) {
	if vni > maxVNI {
		return nil, fmt.Errorf("%w: VNI %d does not fit 24 bits", ErrBadConfig, vni)
	}
	if peer.Addr().Unmap().Is4() == r.v6 {
		return nil, fmt.Errorf("%w: peer %v is not of the socket's address family", ErrBadConfig, peer)
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
	s := &RemoteStream{r: r, vni: vni, peer: makeRawName(peer, r.v6), rxP: p, rxC: c, efd: efd, creditCh: make(chan struct{}, 1)}
	s.rxWait = newWaiter(efd, p.v.consArmed)
	s.rxReady.s = s
	s.gate.high, s.gate.low = uint32(r.cfg.High), uint32(r.cfg.Low)
	for i := range s.smsgs {
		h := &s.smsgs[i].Hdr
		h.Name = (*byte)(unsafe.Pointer(&s.peer.sa))
		h.Namelen = s.peer.len
		h.Iov = &s.siovs[i][0]
		h.SetIovlen(2)
		s.siovs[i][0].Base = &s.shdrs[i][0]
		s.siovs[i][0].SetLen(geneveHdrLen)
	}
	r.regMu.Lock()
	defer r.regMu.Unlock()
	old := *r.streams.Load()
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
// and counts what does not belong, and publishes credits periodically.
func (r *Remote) loop() {
	defer close(r.done)
	next := time.Now().Add(r.cfg.CreditInterval)
	ms := int((r.cfg.CreditInterval + time.Millisecond - 1) / time.Millisecond)
	for !r.closed.Load() {
		r.pfd[0] = unix.PollFd{Fd: int32(r.fd), Events: unix.POLLIN}
		unix.Poll(r.pfd[:], ms)
		for {
			for i := range r.msgs {
				r.msgs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
				r.msgs[i].Hdr.Flags = 0
			}
			n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(r.fd), uintptr(unsafe.Pointer(&r.msgs[0])), remoteBatch, unix.MSG_DONTWAIT, 0, 0)
			if errno != 0 || n == 0 {
				break
			}
			m := *r.streams.Load()
			for i := 0; i < int(n); i++ {
				r.deliver(m, i)
			}
			if int(n) < remoteBatch {
				break
			}
		}
		if now := time.Now(); !now.Before(next) {
			for _, s := range *r.streams.Load() {
				s.publish(false)
			}
			next = now.Add(r.cfg.CreditInterval)
		}
	}
}

func (r *Remote) deliver(m map[uint32]*RemoteStream, i int) {
	h := &r.msgs[i]
	if h.Hdr.Flags&unix.MSG_TRUNC != 0 {
		r.malformed.Add(1)
		return
	}
	g, err := parseGeneve(r.bufs[i][:h.Len])
	if err != nil {
		r.malformed.Add(1)
		return
	}
	s := m[g.vni]
	if s == nil {
		r.wrongVNI.Add(1)
		return
	}
	if !s.peer.same(&r.names[i], h.Hdr.Namelen) {
		r.wrongSource.Add(1)
		return
	}
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
	if g.control {
		return
	}
	r.one[0] = g.payload
	if n, _ := s.rxP.Produce(r.one[:]); n != 1 {
		r.overflow.Add(1)
		return
	}
	r.received.Add(1)
}

func (s *RemoteStream) sentCount() uint32 { return uint32(s.sent.Load()) }

// publish announces how much this side has consumed, if that changed (or
// if it grew by a quarter of the window, when called from Recv).
func (s *RemoteStream) publish(fromRecv bool) {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	c := s.consumed.Load() // under the lock, so published values never go back
	if c == s.pubbed {
		return
	}
	if fromRecv && c-s.pubbed < uint32(s.r.cfg.High-s.r.cfg.Low)/2 {
		return
	}
	putCredit(s.pubBuf[:], s.vni, c)
	_, _, errno := unix.Syscall6(unix.SYS_SENDTO, uintptr(s.r.fd), uintptr(unsafe.Pointer(&s.pubBuf[0])), creditMsgLen, 0,
		uintptr(unsafe.Pointer(&s.peer.sa)), uintptr(s.peer.len))
	if errno == 0 {
		s.pubbed = c
	}
}

// Recv waits for packets of this stream (buffer contract as Consumer.Consume).
func (s *RemoteStream) Recv(bufs [][]byte) (int, error) { return s.RecvTimeout(bufs, -1) }

// RecvTimeout is Recv giving up after d (d < 0: never).
func (s *RemoteStream) RecvTimeout(bufs [][]byte, d time.Duration) (int, error) {
	for {
		if s.r.closed.Load() {
			return 0, ErrClosed
		}
		n, err := s.rxC.Consume(bufs)
		if n > 0 {
			s.consumed.Add(uint32(n))
			s.publish(true)
		}
		if n > 0 || err != nil {
			return n, err
		}
		if err := s.rxWait.wait(&s.rxReady, d); err != nil {
			return 0, err
		}
	}
}

// Send transmits packets (IPv4 or IPv6, starting at the IP header) with one
// sendmmsg per batch, waiting for credit when the peer's queue is at its
// high-water mark (backpressure, as on the shm TX ring).
func (s *RemoteStream) Send(pkts [][]byte) (int, error) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	done := 0
	for done < len(pkts) {
		if s.r.closed.Load() {
			return done, ErrClosed
		}
		allow := s.gate.allowance()
		if allow == 0 {
			s.stalls.Add(1)
			select {
			case <-s.creditCh:
			case <-s.r.done:
			}
			continue
		}
		k := min(allow, len(pkts)-done, remoteBatch)
		for i := 0; i < k; i++ {
			pkt := pkts[done+i]
			proto, ok := protoFor(pkt)
			if !ok || len(pkt) > int(s.r.cfg.SlotSize-slotHdr) {
				return done, fmt.Errorf("%w: packet %d is not an IP packet of at most %d bytes", ErrTooBig, done+i, s.r.cfg.SlotSize-slotHdr)
			}
			putGeneve(s.shdrs[i][:], s.vni, proto, 0, false)
			s.siovs[i][1].Base = &pkt[0]
			s.siovs[i][1].SetLen(len(pkt))
		}
		// Count the batch as sent before it leaves: the peer may consume
		// and credit it before sendmmsg returns, and a credit beyond the
		// sent count would be refused as forged.
		s.sent.Add(uint64(k))
		n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(s.r.fd), uintptr(unsafe.Pointer(&s.smsgs[0])), uintptr(k), 0, 0, 0)
		runtime.KeepAlive(pkts)
		for i := 0; i < k; i++ {
			s.siovs[i][1].Base = nil // do not keep the caller's buffers reachable
		}
		if errno != 0 {
			n = 0
		}
		if int(n) < k {
			s.sent.Add(^uint64(k - int(n) - 1)) // subtract what did not leave
		}
		done += int(n)
		s.gate.sent += uint32(n)
		if errno != 0 && errno != unix.EINTR && errno != unix.EAGAIN && errno != unix.ENOBUFS {
			return done, fmt.Errorf("fabric: sendmmsg: %w", errno)
		}
	}
	return done, nil
}

// Stalls counts how often Send waited for credit.
func (s *RemoteStream) Stalls() uint64 { return s.stalls.Load() }

// Close stops the endpoint's loop and closes its socket and streams.
func (r *Remote) Close() error {
	if r.closed.Swap(true) {
		return errors.New("fabric: remote already closed")
	}
	<-r.done
	for _, s := range *r.streams.Load() {
		eventfdSignal(s.efd) // wake Recv; it sees closed
	}
	return unix.Close(r.fd)
}
