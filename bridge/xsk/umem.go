package xsk

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/pages"
)

// Defaults for UmemConfig.
const (
	DefaultFrameSize  = 2048
	DefaultFrameCount = 4096
)

// UmemConfig sizes a UMEM. Zero fields take defaults.
type UmemConfig struct {
	// FrameSize is 2048 or 4096 bytes. A received frame starts
	// XDP_PACKET_HEADROOM (256) bytes plus Headroom into its frame, so 2048
	// holds a 1500-byte MTU with VLAN tags.
	FrameSize int
	// FrameCount is the number of frames (default DefaultFrameCount).
	FrameCount int
	// Headroom is extra space the kernel leaves before each received frame.
	Headroom int
}

// Umem is a registered frame area and its free pool. Open binds sockets on
// it. Alloc, Free, Open and Account are safe for concurrent use; the rings
// follow the rules in the package documentation (Rings).
type Umem struct {
	area      []byte
	frameSize uint64
	count     int

	mu       sync.Mutex
	fd       int  // the first socket, which the area is registered on; -1 before
	failed   bool // the first bind failed: the area is unusable
	headroom int
	free     []uint64
	isFree   []bool // by frame index, catches double frees
	pools    map[poolKey]*pool
	sockets  []*Socket
	closed   bool
	poolMaps [][]byte // fill and completion mappings, unmapped on Close
}

type poolKey struct{ ifindex, queue int }

// pool is the fill and completion ring pair of one (interface, queue).
type pool struct {
	fill *FillRing
	comp *CompletionRing
}

// NewUmem maps an area of cfg.FrameCount frames. Every frame starts in the
// free pool. The area is registered with the kernel by the first Open, on
// that socket, so that it belongs to the network namespace of the thread that
// opens the first socket.
func NewUmem(cfg UmemConfig) (*Umem, error) {
	if cfg.FrameSize == 0 {
		cfg.FrameSize = DefaultFrameSize
	}
	if cfg.FrameCount == 0 {
		cfg.FrameCount = DefaultFrameCount
	}
	if cfg.FrameSize != 2048 && cfg.FrameSize != 4096 {
		return nil, fmt.Errorf("xsk: frame size %d, want 2048 or 4096", cfg.FrameSize)
	}
	if cfg.FrameCount < 2 || cfg.FrameCount > 1<<20 {
		return nil, fmt.Errorf("xsk: frame count %d outside 2..%d", cfg.FrameCount, 1<<20)
	}
	if cfg.Headroom < 0 || cfg.Headroom > cfg.FrameSize/2 {
		return nil, fmt.Errorf("xsk: headroom %d outside 0..%d", cfg.Headroom, cfg.FrameSize/2)
	}
	size := cfg.FrameSize * cfg.FrameCount
	area, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("xsk: map %d bytes: %w", size, err)
	}
	// Write every page once, now. MAP_POPULATE has the kernel allocate the
	// pages, but where a hypervisor shadows the guest's page tables (this
	// project's VM), the first access through our own mapping still costs
	// microseconds the guest never sees as a fault: the first pass over a
	// new UMEM cost 2.5-5 µs a frame against 10 ns later, and it would fall
	// on the first few thousand packets (TestUmemFirstTouchCostsNoMore).
	pages.WriteZero(area)
	u := &Umem{
		area:      area,
		frameSize: uint64(cfg.FrameSize),
		count:     cfg.FrameCount,
		headroom:  cfg.Headroom,
		fd:        -1,
		free:      make([]uint64, cfg.FrameCount),
		isFree:    make([]bool, cfg.FrameCount),
		pools:     map[poolKey]*pool{},
	}
	// Hand out low addresses first: tests read more easily.
	for i := range u.free {
		u.free[i] = uint64(cfg.FrameCount-1-i) * u.frameSize
		u.isFree[i] = true
	}
	return u, nil
}

// FrameSize is the size of one frame.
func (u *Umem) FrameSize() int { return int(u.frameSize) }

// FrameCount is the number of frames.
func (u *Umem) FrameCount() int { return u.count }

// Base rounds an address down to the start of its frame.
func (u *Umem) Base(addr uint64) uint64 { return addr &^ (u.frameSize - 1) }

// Frame is the whole frame that holds addr, from its base.
func (u *Umem) Frame(addr uint64) []byte {
	b := u.Base(addr)
	return u.area[b : b+u.frameSize : b+u.frameSize]
}

// Bytes is the n bytes at addr, which must lie inside one frame.
func (u *Umem) Bytes(addr uint64, n int) []byte {
	end := u.Base(addr) + u.frameSize
	return u.area[addr : addr+uint64(n) : end]
}

// Meta is the n bytes just before addr: where the XDP program's metadata of
// a received frame lies. It returns nil if they would leave the frame.
func (u *Umem) Meta(addr uint64, n int) []byte {
	if addr-u.Base(addr) < uint64(n) {
		return nil
	}
	return u.area[addr-uint64(n) : addr : addr]
}

// Alloc takes up to len(dst) frames from the free pool and returns how many.
func (u *Umem) Alloc(dst []uint64) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := min(len(dst), len(u.free))
	for i := 0; i < n; i++ {
		a := u.free[len(u.free)-1-i]
		dst[i] = a
		u.isFree[a/u.frameSize] = false
	}
	u.free = u.free[:len(u.free)-n]
	return n
}

// Free returns frames to the free pool. An address outside the area, or a
// frame already free, is refused (and nothing is freed), because either would
// let two users write one frame.
func (u *Umem) Free(addrs []uint64) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	seen := map[uint64]bool{}
	for _, a := range addrs {
		if a >= uint64(len(u.area)) {
			return fmt.Errorf("xsk: free of address %#x outside the UMEM (%d bytes)", a, len(u.area))
		}
		i := a / u.frameSize
		if u.isFree[i] || seen[i] {
			return fmt.Errorf("xsk: frame %#x freed twice", u.Base(a))
		}
		seen[i] = true
	}
	for _, a := range addrs {
		u.isFree[a/u.frameSize] = true
		u.free = append(u.free, u.Base(a))
	}
	return nil
}

// Close closes every socket on the UMEM and releases the area. Remove the
// sockets from any XSKMAP first.
func (u *Umem) Close() error {
	u.mu.Lock()
	if u.closed {
		u.mu.Unlock()
		return nil
	}
	u.closed = true
	socks := u.sockets
	u.sockets = nil
	u.mu.Unlock()
	var errs []error
	for _, s := range socks {
		errs = append(errs, s.close())
	}
	for _, m := range u.poolMaps {
		errs = append(errs, unix.Munmap(m))
	}
	if u.fd >= 0 {
		errs = append(errs, unix.Close(u.fd))
	}
	errs = append(errs, unix.Munmap(u.area))
	return errors.Join(errs...)
}

// Accounting says where every frame of a Umem is. After traffic stops and
// the users of the rings are paused, InKernel is 0 in copy mode (a zero-copy
// driver may keep fill frames in its hardware ring) and Problems is empty.
type Accounting struct {
	Frames     int
	Free       int // in the free pool
	Held       int // in the lists the caller said it holds
	Fill       int // in fill rings, not yet taken by the kernel
	RX         int // in RX rings, not yet received
	TX         int // in TX rings, not yet taken by the kernel
	Completion int // in completion rings, not yet reaped
	InKernel   int // in none of the above: between rings inside the kernel
	// Problems lists frames found in two places, and addresses that are
	// not in the area; either means a frame can be written by two users.
	Problems []string
}

// Err is nil when no frame is in two places and every frame is somewhere
// other than the kernel.
func (a Accounting) Err() error {
	if len(a.Problems) > 0 {
		return fmt.Errorf("xsk: UMEM accounting: %d problems, first: %s", len(a.Problems), a.Problems[0])
	}
	if a.InKernel != 0 {
		return fmt.Errorf("xsk: UMEM accounting: %d of %d frames in no ring or list (free %d, held %d, fill %d, rx %d, tx %d, completion %d)",
			a.InKernel, a.Frames, a.Free, a.Held, a.Fill, a.RX, a.TX, a.Completion)
	}
	return nil
}

// Account walks the free pool, every ring of every socket on the Umem and
// the caller's own lists of frames it holds (held), and reports where each
// frame is. Call it while nothing drives the rings (the kernel may; frames
// it moves in the meantime can show up as InKernel or twice).
func (u *Umem) Account(held ...[]uint64) Accounting {
	u.mu.Lock()
	defer u.mu.Unlock()
	a := Accounting{Frames: u.count}
	where := make([]string, u.count)
	mark := func(place string, addr uint64, counter *int) {
		if addr >= uint64(len(u.area)) {
			a.Problems = append(a.Problems, fmt.Sprintf("address %#x in %s is outside the UMEM", addr, place))
			return
		}
		i := addr / u.frameSize
		if where[i] != "" {
			a.Problems = append(a.Problems, fmt.Sprintf("frame %#x is in %s and in %s", u.Base(addr), where[i], place))
			return
		}
		where[i] = place
		*counter++
	}
	for _, f := range u.free {
		mark("the free pool", f, &a.Free)
	}
	for _, list := range held {
		for _, f := range list {
			mark("a held list", f, &a.Held)
		}
	}
	for k, p := range u.pools {
		name := fmt.Sprintf("fill ring %d/%d", k.ifindex, k.queue)
		p.fill.mu.Lock()
		c, n := p.fill.r.inFlight()
		for j := uint32(0); j < n; j++ {
			mark(name, p.fill.addrs[(c+j)&p.fill.r.mask], &a.Fill)
		}
		p.fill.mu.Unlock()
		name = fmt.Sprintf("completion ring %d/%d", k.ifindex, k.queue)
		p.comp.mu.Lock()
		c, n = p.comp.r.inFlight()
		for j := uint32(0); j < n; j++ {
			mark(name, p.comp.addrs[(c+j)&p.comp.r.mask], &a.Completion)
		}
		p.comp.mu.Unlock()
	}
	for _, s := range u.sockets {
		if s.RX != nil {
			c, n := s.RX.r.inFlight()
			for j := uint32(0); j < n; j++ {
				mark(fmt.Sprintf("RX ring of socket %d", s.fd), s.RX.descs[(c+j)&s.RX.r.mask].Addr, &a.RX)
			}
		}
		if s.TX != nil {
			c, n := s.TX.r.inFlight()
			for j := uint32(0); j < n; j++ {
				mark(fmt.Sprintf("TX ring of socket %d", s.fd), s.TX.descs[(c+j)&s.TX.r.mask].Addr, &a.TX)
			}
		}
	}
	for _, w := range where {
		if w == "" {
			a.InKernel++
		}
	}
	return a
}

// register creates the first socket and registers the area on it.
func (u *Umem) register() (int, error) {
	fd, err := unix.Socket(unix.AF_XDP, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("xsk: socket(AF_XDP): %w", err)
	}
	reg := unix.XDPUmemReg{
		Addr:     uint64(uintptr(unsafe.Pointer(&u.area[0]))),
		Len:      uint64(len(u.area)),
		Size:     uint32(u.frameSize),
		Headroom: uint32(u.headroom),
	}
	if err := setsockopt(fd, unix.XDP_UMEM_REG, unsafe.Pointer(&reg), unsafe.Sizeof(reg)); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("xsk: register UMEM: %w", err)
	}
	return fd, nil
}

func setsockopt(fd, opt int, p unsafe.Pointer, size uintptr) error {
	_, _, e := unix.Syscall6(unix.SYS_SETSOCKOPT, uintptr(fd), unix.SOL_XDP, uintptr(opt), uintptr(p), size, 0)
	if e != 0 {
		return e
	}
	return nil
}

func getsockopt(fd, level, opt int, p unsafe.Pointer, size uintptr) (uintptr, error) {
	l := uint32(size)
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt), uintptr(p), uintptr(unsafe.Pointer(&l)), 0)
	if e != 0 {
		return 0, e
	}
	return uintptr(l), nil
}
