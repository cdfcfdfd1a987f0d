// Package afpacket is the bridge's fallback data path for interfaces where
// XDP cannot attach: AF_PACKET sockets with TPACKET_V3 rings mapped from the
// kernel. RX hands whole blocks of frames to user space (one wake-up per
// block, not per frame); TX takes frames written in place into a ring and
// sends them with one system call per batch, bypassing the qdisc.
//
// Unlike AF_XDP, AF_PACKET is a tap: the kernel's own stack still receives
// every frame the RX socket sees.
package afpacket

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/pages"
)

// Offsets in struct tpacket_block_desc and struct tpacket3_hdr.
const (
	blockStatus      = 8
	blockNumPkts     = 12
	blockFirstPkt    = 16
	hdrNextOffset    = 0
	hdrSec           = 4
	hdrNsec          = 8
	hdrSnapLen       = 12
	hdrLen           = 16
	hdrStatus        = 20
	hdrMac           = 24
	hdrVLANTCI       = 32
	hdrVLANTPID      = 36
	tpacket3HdrLen   = 48 // TPACKET_ALIGN(sizeof(struct tpacket3_hdr))
	txDataOffset     = tpacket3HdrLen
	statusVLANValid  = unix.TP_STATUS_VLAN_VALID
	statusVLANTPIDOK = unix.TP_STATUS_VLAN_TPID_VALID
)

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// RxConfig sizes an RX ring. Zero fields take defaults.
type RxConfig struct {
	Ifindex    int
	BlockSize  int // bytes per block, a multiple of the page size; default 1 MiB
	BlockCount int // default 8
	// RetireTimeoutMs hands a partly filled block to user space after this
	// long (default 1 ms): the latency floor of TPACKET_V3 on light traffic.
	RetireTimeoutMs int
}

// Rx is a TPACKET_V3 receive ring bound to one interface for all
// protocols. It skips frames the host sends (PACKET_IGNORE_OUTGOING).
type Rx struct {
	fd      int
	ring    []byte
	bsize   int
	nblocks int
	cur     int // the next block to look at
	held    int // the block the caller still reads (Poll to Release), or -1
	pfd     [2]unix.PollFd
	scratch []byte
	drops   atomic.Uint64
}

// NewRx opens the ring. Call it on a thread in the interface's namespace.
func NewRx(cfg RxConfig) (*Rx, error) {
	if cfg.BlockSize == 0 {
		cfg.BlockSize = 1 << 20
	}
	if cfg.BlockCount == 0 {
		cfg.BlockCount = 8
	}
	if cfg.RetireTimeoutMs == 0 {
		cfg.RetireTimeoutMs = 1
	}
	if cfg.BlockSize%unix.Getpagesize() != 0 {
		return nil, fmt.Errorf("afpacket: block size %d is not a multiple of the page size", cfg.BlockSize)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return nil, fmt.Errorf("afpacket: socket: %w", err)
	}
	r := &Rx{fd: fd, bsize: cfg.BlockSize, nblocks: cfg.BlockCount, held: -1, scratch: make([]byte, 0, 65536)}
	fail := func(what string, err error) (*Rx, error) {
		r.Close()
		return nil, fmt.Errorf("afpacket: %s: %w", what, err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VERSION, unix.TPACKET_V3); err != nil {
		return fail("TPACKET_V3", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_IGNORE_OUTGOING, 1); err != nil {
		return fail("PACKET_IGNORE_OUTGOING", err)
	}
	req := unix.TpacketReq3{
		Block_size: uint32(cfg.BlockSize), Block_nr: uint32(cfg.BlockCount),
		Frame_size: 2048, Frame_nr: uint32(cfg.BlockSize / 2048 * cfg.BlockCount),
		Retire_blk_tov: uint32(cfg.RetireTimeoutMs),
	}
	if err := unix.SetsockoptTpacketReq3(fd, unix.SOL_PACKET, unix.PACKET_RX_RING, &req); err != nil {
		return fail("PACKET_RX_RING", err)
	}
	if r.ring, err = unix.Mmap(fd, 0, cfg.BlockSize*cfg.BlockCount, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fail("mmap", err)
	}
	// Touch every page now (package pages): the first read of a new 8 MiB
	// ring's pages took 1.7-2.8 ms, 100-200 times a later pass, and it would
	// fall on the first packets.
	pages.AddZero(r.ring)
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: cfg.Ifindex}); err != nil {
		return fail("bind", err)
	}
	r.pfd[0] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
	return r, nil
}

func (r *Rx) status(b int) *uint32 {
	return (*uint32)(unsafe.Pointer(&r.ring[b*r.bsize+blockStatus]))
}

// Poll hands every frame of the next ready block to f and returns how many
// it handed over; 0 means no block was ready. The block stays the caller's,
// and its frames stay valid, until Release (or the next Poll, which releases
// it first): a caller may keep frames after f returns, for example to copy a
// batch of them at once, as long as it is done before Release. (Once
// released, the kernel may write new frames over them at once: when the ring
// was full it has been waiting for exactly this block.)
//
// A frame whose VLAN tag the kernel took off (it always does for the
// outermost tag) gets it back, so f sees the frame as it was on the wire;
// such a frame is rebuilt in a scratch buffer that the next rebuilt frame
// overwrites, which f learns from rebuilt.
//
// rxNs is when the kernel received the frame, in nanoseconds of
// CLOCK_REALTIME (the packet socket's software timestamp: packet sockets
// offer no other clock).
func (r *Rx) Poll(f func(frame []byte, rebuilt bool, rxNs int64)) int {
	r.Release()
	base := r.cur * r.bsize
	st := r.status(r.cur)
	if atomic.LoadUint32(st)&unix.TP_STATUS_USER == 0 {
		return 0
	}
	blk := r.ring[base : base+r.bsize]
	n := int(*(*uint32)(unsafe.Pointer(&blk[blockNumPkts])))
	off := int(*(*uint32)(unsafe.Pointer(&blk[blockFirstPkt])))
	for i := 0; i < n && off > 0 && off < len(blk)-tpacket3HdrLen; i++ {
		h := blk[off:]
		snap := int(*(*uint32)(unsafe.Pointer(&h[hdrSnapLen])))
		mac := int(*(*uint16)(unsafe.Pointer(&h[hdrMac])))
		status := *(*uint32)(unsafe.Pointer(&h[hdrStatus]))
		if mac+snap <= len(h) {
			frame := h[mac : mac+snap]
			rebuilt := false
			if status&statusVLANValid != 0 && len(frame) >= 12 {
				rebuilt = true
				tci := uint16(*(*uint32)(unsafe.Pointer(&h[hdrVLANTCI])))
				tpid := uint16(0x8100)
				if status&statusVLANTPIDOK != 0 {
					tpid = *(*uint16)(unsafe.Pointer(&h[hdrVLANTPID]))
				}
				s := append(r.scratch[:0], frame[:12]...)
				s = append(s, byte(tpid>>8), byte(tpid), byte(tci>>8), byte(tci))
				frame = append(s, frame[12:]...)
			}
			sec := *(*uint32)(unsafe.Pointer(&h[hdrSec]))
			nsec := *(*uint32)(unsafe.Pointer(&h[hdrNsec]))
			f(frame, rebuilt, int64(sec)*1e9+int64(nsec))
		}
		next := int(*(*uint32)(unsafe.Pointer(&h[hdrNextOffset])))
		if next == 0 {
			n = i + 1
			break
		}
		off += next
	}
	r.held = r.cur
	r.cur = (r.cur + 1) % r.nblocks
	return max(n, 1)
}

// Release returns the block of the last Poll to the kernel; its frames are
// no longer valid. Without a block held it does nothing.
func (r *Rx) Release() {
	if r.held >= 0 {
		atomic.StoreUint32(r.status(r.held), unix.TP_STATUS_KERNEL)
		r.held = -1
	}
}

// Wait sleeps until a block is ready or wakefd (-1 for none) is readable.
// It does not read wakefd: that may be an epoll set (the bridge sleeps on
// its commands and its streams at once); its owner drains it.
func (r *Rx) Wait(wakefd int) {
	if atomic.LoadUint32(r.status(r.cur))&unix.TP_STATUS_USER != 0 {
		return
	}
	r.pfd[1] = unix.PollFd{Fd: int32(wakefd), Events: unix.POLLIN}
	r.pfd[0].Revents = 0
	unix.Poll(r.pfd[:], -1) // EINTR: the caller looks again
}

// FanoutByQueue joins rxs, in this order, into a new fanout group that
// hands each frame only to rxs[q % len(rxs)], where q is the receive queue it
// came in on (PACKET_FANOUT_QM): several RX loops then share one interface
// by queue, as AF_XDP sockets do. With fewer rings than queues, queues fold
// onto rings modulo their number. The rings must be bound to the same
// interface.
func FanoutByQueue(rxs []*Rx) error {
	if len(rxs) < 2 {
		return nil
	}
	arg := unix.PACKET_FANOUT_QM | unix.PACKET_FANOUT_FLAG_UNIQUEID<<8
	if err := unix.SetsockoptInt(rxs[0].fd, unix.SOL_PACKET, unix.PACKET_FANOUT, arg<<16); err != nil {
		return fmt.Errorf("afpacket: new fanout group: %w", err)
	}
	got, err := unix.GetsockoptInt(rxs[0].fd, unix.SOL_PACKET, unix.PACKET_FANOUT)
	if err != nil {
		return fmt.Errorf("afpacket: fanout group id: %w", err)
	}
	id := got & 0xffff
	for i, r := range rxs[1:] {
		if err := unix.SetsockoptInt(r.fd, unix.SOL_PACKET, unix.PACKET_FANOUT, id|unix.PACKET_FANOUT_QM<<16); err != nil {
			return fmt.Errorf("afpacket: join fanout group %d (ring %d): %w", id, i+1, err)
		}
	}
	return nil
}

// Drops is how many frames the kernel dropped for want of a free block.
func (r *Rx) Drops() uint64 {
	var st unix.TpacketStatsV3
	l := uint32(unsafe.Sizeof(st))
	// Reading the statistics resets them in the kernel: keep a running sum.
	if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(r.fd), unix.SOL_PACKET, unix.PACKET_STATISTICS, uintptr(unsafe.Pointer(&st)), uintptr(unsafe.Pointer(&l)), 0); e != 0 {
		return 0
	}
	return r.drops.Add(uint64(st.Drops))
}

// Close releases the ring and the socket.
func (r *Rx) Close() error {
	var errs []error
	if r.ring != nil {
		errs = append(errs, unix.Munmap(r.ring))
		r.ring = nil
	}
	if r.fd >= 0 {
		errs = append(errs, unix.Close(r.fd))
		r.fd = -1
	}
	return errors.Join(errs...)
}

// TxConfig sizes a TX ring. Zero fields take defaults.
type TxConfig struct {
	Ifindex    int
	FrameSize  int // bytes per slot including a 48-byte header; default 2048
	FrameCount int // default 1024
}

// Tx is a TPACKET_V3 transmit ring. The kernel sends slots strictly in ring
// order and stops at the first slot not marked for sending, so slots are
// taken and marked in order.
type Tx struct {
	fd     int
	ring   []byte
	fsize  int
	count  int
	cur    int // next slot to take
	queued int // slots marked since the last Flush
}

// NewTx opens the ring, with PACKET_QDISC_BYPASS: frames go straight to the
// driver. Call it on a thread in the interface's namespace.
func NewTx(cfg TxConfig) (*Tx, error) {
	if cfg.FrameSize == 0 {
		cfg.FrameSize = 2048
	}
	if cfg.FrameCount == 0 {
		cfg.FrameCount = 1024
	}
	page := unix.Getpagesize()
	if cfg.FrameSize%16 != 0 || page%cfg.FrameSize != 0 && cfg.FrameSize%page != 0 {
		return nil, fmt.Errorf("afpacket: TX frame size %d", cfg.FrameSize)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("afpacket: socket: %w", err)
	}
	t := &Tx{fd: fd, fsize: cfg.FrameSize, count: cfg.FrameCount}
	fail := func(what string, err error) (*Tx, error) {
		t.Close()
		return nil, fmt.Errorf("afpacket: %s: %w", what, err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VERSION, unix.TPACKET_V3); err != nil {
		return fail("TPACKET_V3", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_QDISC_BYPASS, 1); err != nil {
		return fail("PACKET_QDISC_BYPASS", err)
	}
	bsize := max(page, cfg.FrameSize)
	req := unix.TpacketReq3{
		Block_size: uint32(bsize), Block_nr: uint32(cfg.FrameSize * cfg.FrameCount / bsize),
		Frame_size: uint32(cfg.FrameSize), Frame_nr: uint32(cfg.FrameCount),
	}
	if err := unix.SetsockoptTpacketReq3(fd, unix.SOL_PACKET, unix.PACKET_TX_RING, &req); err != nil {
		return fail("PACKET_TX_RING", err)
	}
	if t.ring, err = unix.Mmap(fd, 0, cfg.FrameSize*cfg.FrameCount, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fail("mmap", err)
	}
	pages.AddZero(t.ring)
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: cfg.Ifindex}); err != nil {
		return fail("bind", err)
	}
	return t, nil
}

func (t *Tx) slot(i int) []byte {
	i %= t.count
	return t.ring[i*t.fsize : (i+1)*t.fsize]
}

func slotStatus(s []byte) *uint32 { return (*uint32)(unsafe.Pointer(&s[hdrStatus])) }

// Free is how many slots from the cursor on are free, up to max.
func (t *Tx) Free(max int) int {
	n := 0
	for n < max && n < t.count && atomic.LoadUint32(slotStatus(t.slot(t.cur+n))) == unix.TP_STATUS_AVAILABLE {
		n++
	}
	return n
}

// Buf is the data area of the i-th free slot from the cursor, where a frame
// is written before Queue.
func (t *Tx) Buf(i int) []byte { return t.slot(t.cur + i)[txDataOffset:] }

// MaxFrame is the largest frame a slot holds.
func (t *Tx) MaxFrame() int { return t.fsize - txDataOffset }

// Queue marks the slot at the cursor, holding n bytes, for sending and
// moves the cursor on.
func (t *Tx) Queue(n int) {
	s := t.slot(t.cur)
	*(*uint32)(unsafe.Pointer(&s[hdrNextOffset])) = 0
	*(*uint32)(unsafe.Pointer(&s[hdrLen])) = uint32(n)
	*(*uint32)(unsafe.Pointer(&s[hdrSnapLen])) = uint32(n)
	atomic.StoreUint32(slotStatus(s), unix.TP_STATUS_SEND_REQUEST)
	t.cur = (t.cur + 1) % t.count
	t.queued++
}

// Flush sends every queued slot (one sendto).
func (t *Tx) Flush() error {
	if t.queued == 0 {
		return nil
	}
	t.queued = 0
	_, _, e := unix.Syscall6(unix.SYS_SENDTO, uintptr(t.fd), 0, 0, unix.MSG_DONTWAIT, 0, 0)
	switch e {
	case 0, unix.EAGAIN, unix.ENOBUFS:
		return nil
	}
	return fmt.Errorf("afpacket: send: %w", e)
}

// Close releases the ring and the socket.
func (t *Tx) Close() error {
	var errs []error
	if t.ring != nil {
		errs = append(errs, unix.Munmap(t.ring))
		t.ring = nil
	}
	if t.fd >= 0 {
		errs = append(errs, unix.Close(t.fd))
		t.fd = -1
	}
	return errors.Join(errs...)
}
