package xsk

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// BindMode chooses between zero-copy and copy mode.
type BindMode int

// Bind modes.
const (
	// BindAny lets the kernel use zero copy where the driver can, else copy.
	BindAny BindMode = iota
	// BindZeroCopy insists on zero copy (XDP_ZEROCOPY): Open fails where the
	// driver cannot do it.
	BindZeroCopy
	// BindCopy forces copy mode (XDP_COPY), which works on every driver.
	BindCopy
)

func (m BindMode) String() string {
	switch m {
	case BindAny:
		return "any"
	case BindZeroCopy:
		return "zero-copy"
	case BindCopy:
		return "copy"
	}
	return fmt.Sprintf("bind(%d)", int(m))
}

// Default ring sizes.
const (
	DefaultRingSize = 2048
)

// SocketConfig says where a socket binds and how big its rings are. Ring
// sizes are powers of two; zero takes DefaultRingSize. A socket with
// RxSize < 0 has no RX ring, TxSize < 0 no TX ring (at least one is needed).
type SocketConfig struct {
	Ifindex int
	Queue   int
	RxSize  int
	TxSize  int
	// FillSize and CompletionSize size the queue's fill and completion rings;
	// they apply only to the first socket on a queue, the others share them.
	FillSize       int
	CompletionSize int
	Bind           BindMode
	// DisableNeedWakeup binds without XDP_USE_NEED_WAKEUP: the kernel then
	// polls the rings itself, and the caller never needs to wake it.
	DisableNeedWakeup bool
	// BusyPoll, if positive, sets SO_PREFER_BUSY_POLL and SO_BUSY_POLL to
	// this long, with a budget of BusyPollBudget (default MaxBatch), so WakeRX
	// and Kick run the driver's receive processing in the caller's context.
	BusyPoll       time.Duration
	BusyPollBudget int
}

// Socket is one AF_XDP socket bound to an (interface, queue). Fill and
// Completion are the queue's rings, shared with the other sockets on it.
type Socket struct {
	umem       *Umem
	fd         int
	ownsFD     bool // false for the Umem's registration descriptor
	zeroCopy   bool
	needWakeup bool
	key        poolKey
	rxMap      []byte
	txMap      []byte
	closed     bool

	RX         *RxRing         // nil if the socket has no RX ring
	TX         *TxRing         // nil if the socket has no TX ring
	Fill       *FillRing       // the queue's fill ring
	Completion *CompletionRing // the queue's completion ring
}

// Open creates a socket on the UMEM and binds it. The first socket on a
// Umem binds on the UMEM's own descriptor; later ones bind with
// XDP_SHARED_UMEM, sharing the fill and completion rings of their queue if
// another socket on the Umem is bound there already.
func (u *Umem) Open(cfg SocketConfig) (*Socket, error) {
	for _, p := range []*int{&cfg.RxSize, &cfg.TxSize, &cfg.FillSize, &cfg.CompletionSize} {
		if *p == 0 {
			*p = DefaultRingSize
		}
	}
	if cfg.RxSize < 0 && cfg.TxSize < 0 {
		return nil, errors.New("xsk: a socket needs an RX or a TX ring")
	}
	for _, n := range []int{cfg.RxSize, cfg.TxSize, cfg.FillSize, cfg.CompletionSize} {
		if n > 0 && (n&(n-1) != 0 || n > 1<<20) {
			return nil, fmt.Errorf("xsk: ring size %d is not a power of two up to %d", n, 1<<20)
		}
	}
	if cfg.Ifindex <= 0 || cfg.Queue < 0 {
		return nil, fmt.Errorf("xsk: bad interface index %d or queue %d", cfg.Ifindex, cfg.Queue)
	}

	u.mu.Lock()
	defer u.mu.Unlock()
	if u.closed {
		return nil, errors.New("xsk: UMEM closed")
	}
	if u.failed {
		return nil, errors.New("xsk: the first bind on this UMEM failed; open on a fresh UMEM")
	}
	key := poolKey{cfg.Ifindex, cfg.Queue}
	s := &Socket{umem: u, key: key, needWakeup: !cfg.DisableNeedWakeup}
	shared := u.fd >= 0
	var err error
	if shared {
		s.fd, err = unix.Socket(unix.AF_XDP, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("xsk: socket(AF_XDP): %w", err)
		}
		s.ownsFD = true
	} else if s.fd, err = u.register(); err != nil {
		return nil, err
	}
	fail := func(what string, err error) (*Socket, error) {
		s.unmap()
		if s.ownsFD {
			unix.Close(s.fd)
		} else {
			// The area stays registered on this descriptor in a state
			// the kernel will not bind again: retry on a fresh Umem.
			u.failed = true
			u.fd = s.fd
		}
		return nil, fmt.Errorf("xsk: %s (ifindex %d queue %d): %w", what, cfg.Ifindex, cfg.Queue, err)
	}

	p := u.pools[key]
	newPool := p == nil
	if newPool {
		if err := setRingSize(s.fd, unix.XDP_UMEM_FILL_RING, cfg.FillSize); err != nil {
			return fail("fill ring", err)
		}
		if err := setRingSize(s.fd, unix.XDP_UMEM_COMPLETION_RING, cfg.CompletionSize); err != nil {
			return fail("completion ring", err)
		}
	}
	if cfg.RxSize > 0 {
		if err := setRingSize(s.fd, unix.XDP_RX_RING, cfg.RxSize); err != nil {
			return fail("RX ring", err)
		}
	}
	if cfg.TxSize > 0 {
		if err := setRingSize(s.fd, unix.XDP_TX_RING, cfg.TxSize); err != nil {
			return fail("TX ring", err)
		}
	}
	var off unix.XDPMmapOffsets
	if _, err := getsockopt(s.fd, unix.SOL_XDP, unix.XDP_MMAP_OFFSETS, unsafe.Pointer(&off), unsafe.Sizeof(off)); err != nil {
		return fail("mmap offsets", err)
	}
	var newMaps [][]byte
	if newPool {
		fm, err := mapRing(s.fd, unix.XDP_UMEM_PGOFF_FILL_RING, off.Fr, cfg.FillSize, 8)
		if err != nil {
			return fail("map fill ring", err)
		}
		cm, err := mapRing(s.fd, unix.XDP_UMEM_PGOFF_COMPLETION_RING, off.Cr, cfg.CompletionSize, 8)
		if err != nil {
			unix.Munmap(fm)
			return fail("map completion ring", err)
		}
		newMaps = [][]byte{fm, cm}
		p = &pool{
			fill: &FillRing{r: newRing(fm, off.Fr, uint32(cfg.FillSize))},
			comp: &CompletionRing{r: newRing(cm, off.Cr, uint32(cfg.CompletionSize))},
		}
		p.fill.addrs = unsafe.Slice((*uint64)(unsafe.Pointer(&fm[off.Fr.Desc])), cfg.FillSize)
		p.comp.addrs = unsafe.Slice((*uint64)(unsafe.Pointer(&cm[off.Cr.Desc])), cfg.CompletionSize)
		p.fill.r.init()
		p.comp.r.init()
	}
	unmapPool := func() {
		for _, m := range newMaps {
			unix.Munmap(m)
		}
	}
	if cfg.RxSize > 0 {
		m, err := mapRing(s.fd, unix.XDP_PGOFF_RX_RING, off.Rx, cfg.RxSize, int(unsafe.Sizeof(Desc{})))
		if err != nil {
			unmapPool()
			return fail("map RX ring", err)
		}
		s.rxMap = m
		s.RX = &RxRing{r: newRing(m, off.Rx, uint32(cfg.RxSize))}
		s.RX.descs = unsafe.Slice((*Desc)(unsafe.Pointer(&m[off.Rx.Desc])), cfg.RxSize)
		s.RX.r.init()
	}
	if cfg.TxSize > 0 {
		m, err := mapRing(s.fd, unix.XDP_PGOFF_TX_RING, off.Tx, cfg.TxSize, int(unsafe.Sizeof(Desc{})))
		if err != nil {
			unmapPool()
			return fail("map TX ring", err)
		}
		s.txMap = m
		s.TX = &TxRing{r: newRing(m, off.Tx, uint32(cfg.TxSize))}
		s.TX.descs = unsafe.Slice((*Desc)(unsafe.Pointer(&m[off.Tx.Desc])), cfg.TxSize)
		s.TX.r.init()
	}

	sa := &unix.SockaddrXDP{Ifindex: uint32(cfg.Ifindex), QueueID: uint32(cfg.Queue)}
	if s.needWakeup {
		sa.Flags |= unix.XDP_USE_NEED_WAKEUP
	}
	switch cfg.Bind {
	case BindZeroCopy:
		sa.Flags |= unix.XDP_ZEROCOPY
	case BindCopy:
		sa.Flags |= unix.XDP_COPY
	}
	if shared {
		// A shared bind takes no mode or wake-up flags: the socket gets
		// those of the first socket's pool.
		sa.Flags = unix.XDP_SHARED_UMEM
		sa.SharedUmemFD = uint32(u.fd)
	}
	if err := unix.Bind(s.fd, sa); err != nil {
		unmapPool()
		return fail(fmt.Sprintf("bind (%v)", cfg.Bind), err)
	}
	var opts uint32
	if _, err := getsockopt(s.fd, unix.SOL_XDP, unix.XDP_OPTIONS, unsafe.Pointer(&opts), unsafe.Sizeof(opts)); err == nil {
		s.zeroCopy = opts&unix.XDP_OPTIONS_ZEROCOPY != 0
	}
	if cfg.BusyPoll > 0 {
		budget := cfg.BusyPollBudget
		if budget <= 0 {
			budget = MaxBatch
		}
		for _, o := range [][2]int{
			{unix.SO_PREFER_BUSY_POLL, 1},
			{unix.SO_BUSY_POLL, int(cfg.BusyPoll / time.Microsecond)},
			{unix.SO_BUSY_POLL_BUDGET, budget},
		} {
			if err := unix.SetsockoptInt(s.fd, unix.SOL_SOCKET, o[0], o[1]); err != nil {
				unmapPool()
				return fail("busy poll option", err)
			}
		}
	}
	if newPool {
		u.pools[key] = p
		u.poolMaps = append(u.poolMaps, newMaps...)
	}
	s.Fill, s.Completion = p.fill, p.comp
	if !shared {
		u.fd = s.fd
	}
	u.sockets = append(u.sockets, s)
	return s, nil
}

func setRingSize(fd, opt, n int) error {
	v := uint32(n)
	return setsockopt(fd, opt, unsafe.Pointer(&v), unsafe.Sizeof(v))
}

func mapRing(fd int, pgoff int64, off unix.XDPRingOffset, n, entry int) ([]byte, error) {
	return unix.Mmap(fd, pgoff, int(off.Desc)+n*entry, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
}

// FD is the socket's descriptor, for an XSKMAP.
func (s *Socket) FD() int { return s.fd }

// Umem is the UMEM the socket is bound on.
func (s *Socket) Umem() *Umem { return s.umem }

// Ifindex and Queue say where the socket is bound.
func (s *Socket) Ifindex() int { return s.key.ifindex }

// Queue is the queue the socket is bound to.
func (s *Socket) Queue() int { return s.key.queue }

// ZeroCopy reports whether the kernel granted zero-copy mode.
func (s *Socket) ZeroCopy() bool { return s.zeroCopy }

// Kick asks the kernel to transmit what the TX ring holds (sendto with
// MSG_DONTWAIT). Transient refusals (the kernel's budget ran out, the device
// queue is full) are not errors: the caller kicks again later.
func (s *Socket) Kick() error {
	_, _, e := unix.Syscall6(unix.SYS_SENDTO, uintptr(s.fd), 0, 0, unix.MSG_DONTWAIT, 0, 0)
	switch e {
	case 0, unix.EAGAIN, unix.EBUSY, unix.ENOBUFS, unix.ENETDOWN:
		return nil
	}
	return fmt.Errorf("xsk: kick: %w", e)
}

// WakeRX lets the kernel take frames from the fill ring (when it said it
// needs a wake-up) and, with busy polling, runs the driver's receive
// processing now (recvfrom with MSG_DONTWAIT).
func (s *Socket) WakeRX() error {
	_, _, e := unix.Syscall6(unix.SYS_RECVFROM, uintptr(s.fd), 0, 0, unix.MSG_DONTWAIT, 0, 0)
	switch e {
	case 0, unix.EAGAIN, unix.EBUSY, unix.ENOBUFS, unix.ENETDOWN:
		return nil
	}
	return fmt.Errorf("xsk: wake: %w", e)
}

// Statistics are the kernel's counters for one socket.
type Statistics struct {
	RxDropped       uint64 // dropped for reasons other than the two below
	RxInvalidDescs  uint64
	TxInvalidDescs  uint64
	RxRingFull      uint64 // dropped: the RX ring was full
	RxFillRingEmpty uint64 // times the kernel found the fill ring empty
	TxRingEmpty     uint64 // times the kernel found the TX ring empty on a wake-up
}

// Statistics reads the kernel's counters (XDP_STATISTICS).
func (s *Socket) Statistics() (Statistics, error) {
	var st unix.XDPStatistics
	if _, err := getsockopt(s.fd, unix.SOL_XDP, unix.XDP_STATISTICS, unsafe.Pointer(&st), unsafe.Sizeof(st)); err != nil {
		return Statistics{}, fmt.Errorf("xsk: statistics: %w", err)
	}
	return Statistics{
		RxDropped: st.Rx_dropped, RxInvalidDescs: st.Rx_invalid_descs, TxInvalidDescs: st.Tx_invalid_descs,
		RxRingFull: st.Rx_ring_full, RxFillRingEmpty: st.Rx_fill_ring_empty_descs, TxRingEmpty: st.Tx_ring_empty_descs,
	}, nil
}

// Close unbinds and closes the socket. The first socket of a Umem is bound
// on the UMEM's own descriptor, which stays open (and bound) until the Umem
// closes. Remove the socket from its XSKMAP first.
func (s *Socket) Close() error {
	u := s.umem
	u.mu.Lock()
	for i, x := range u.sockets {
		if x == s {
			u.sockets = append(u.sockets[:i], u.sockets[i+1:]...)
			break
		}
	}
	u.mu.Unlock()
	return s.close()
}

func (s *Socket) close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	s.unmap()
	if s.ownsFD {
		return unix.Close(s.fd)
	}
	return nil
}

func (s *Socket) unmap() {
	if s.rxMap != nil {
		unix.Munmap(s.rxMap)
		s.rxMap = nil
	}
	if s.txMap != nil {
		unix.Munmap(s.txMap)
		s.txMap = nil
	}
}
