package xsk

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MaxBatch is the largest number of entries the rings move at once; callers
// size their scratch slices with it.
const MaxBatch = 64

// Desc is an RX or TX descriptor: where a frame's bytes start in the UMEM and
// how many there are. Its layout is the kernel's struct xdp_desc.
type Desc struct {
	Addr    uint64
	Len     uint32
	Options uint32
}

// ring is the index half of one mapped ring. Our own index lives in private
// memory (cachedProd for a producer, cachedCons for a consumer) and is
// published with a store; the kernel's is loaded only when the cached copy
// cannot satisfy a request.
type ring struct {
	producer   *uint32
	consumer   *uint32
	flags      *uint32
	size, mask uint32
	cachedProd uint32
	cachedCons uint32
	mem        []byte // the mapping, for munmap
}

func newRing(mem []byte, off unix.XDPRingOffset, size uint32) ring {
	return ring{
		producer: (*uint32)(unsafe.Pointer(&mem[off.Producer])),
		consumer: (*uint32)(unsafe.Pointer(&mem[off.Consumer])),
		flags:    (*uint32)(unsafe.Pointer(&mem[off.Flags])),
		size:     size,
		mask:     size - 1,
		mem:      mem,
	}
}

// init syncs the private indices with the shared ones (both zero on a new
// ring).
func (r *ring) init() {
	r.cachedProd = atomic.LoadUint32(r.producer)
	r.cachedCons = atomic.LoadUint32(r.consumer)
}

// room is how many entries a producer may write now, at most want.
func (r *ring) room(want uint32) uint32 {
	free := r.size - (r.cachedProd - r.cachedCons)
	if free < want {
		r.cachedCons = atomic.LoadUint32(r.consumer)
		free = r.size - (r.cachedProd - r.cachedCons)
	}
	return min(free, want)
}

// publish makes n written entries visible to the consumer.
func (r *ring) publish(n uint32) {
	r.cachedProd += n
	atomic.StoreUint32(r.producer, r.cachedProd)
}

// ready is how many entries a consumer may read now, at most want.
func (r *ring) ready(want uint32) uint32 {
	n := r.cachedProd - r.cachedCons
	if n < want {
		r.cachedProd = atomic.LoadUint32(r.producer)
		n = r.cachedProd - r.cachedCons
	}
	return min(n, want)
}

// release hands n read entries back to the producer.
func (r *ring) release(n uint32) {
	r.cachedCons += n
	atomic.StoreUint32(r.consumer, r.cachedCons)
}

func (r *ring) needWakeup() bool {
	return atomic.LoadUint32(r.flags)&unix.XDP_RING_NEED_WAKEUP != 0
}

// inFlight is how many entries sit between the shared indices: written by
// the producer and not yet consumed.
func (r *ring) inFlight() (cons, n uint32) {
	c := atomic.LoadUint32(r.consumer)
	p := atomic.LoadUint32(r.producer)
	return c, p - c
}

// FillRing gives the kernel frames to receive into. It belongs to one
// (interface, queue) and is shared by every socket bound there, so Fill locks
// (once per batch).
type FillRing struct {
	mu    sync.Mutex
	r     ring
	addrs []uint64
}

// Fill puts as many of addrs as fit into the ring and returns how many.
func (f *FillRing) Fill(addrs []uint64) int {
	f.mu.Lock()
	n := f.r.room(uint32(len(addrs)))
	for i := uint32(0); i < n; i++ {
		f.addrs[(f.r.cachedProd+i)&f.r.mask] = addrs[i]
	}
	f.r.publish(n)
	f.mu.Unlock()
	return int(n)
}

// NeedWakeup reports whether the kernel waits for a system call (WakeRX or
// Poll) before it takes frames from the ring.
func (f *FillRing) NeedWakeup() bool { return f.r.needWakeup() }

// Size is the number of entries the ring holds.
func (f *FillRing) Size() int { return int(f.r.size) }

// Pending is how many frames the kernel has not taken yet.
func (f *FillRing) Pending() int {
	_, n := f.r.inFlight()
	return int(n)
}

// CompletionRing returns frames the kernel has finished transmitting. Like
// FillRing it is shared by the sockets of one queue, so Reap locks.
type CompletionRing struct {
	mu    sync.Mutex
	r     ring
	addrs []uint64
}

// Reap moves up to len(dst) completed frame addresses into dst.
func (c *CompletionRing) Reap(dst []uint64) int {
	c.mu.Lock()
	n := c.r.ready(uint32(len(dst)))
	for i := uint32(0); i < n; i++ {
		dst[i] = c.addrs[(c.r.cachedCons+i)&c.r.mask]
	}
	c.r.release(n)
	c.mu.Unlock()
	return int(n)
}

// Size is the number of entries the ring holds.
func (c *CompletionRing) Size() int { return int(c.r.size) }

// RxRing holds descriptors of received frames. One goroutine drives it.
type RxRing struct {
	r     ring
	descs []Desc
}

// Receive copies up to len(dst) descriptors into dst and releases their
// slots at once: the frames now belong to the caller, who returns them to a
// fill ring (or the free pool) when done.
func (x *RxRing) Receive(dst []Desc) int {
	n := x.r.ready(uint32(len(dst)))
	for i := uint32(0); i < n; i++ {
		dst[i] = x.descs[(x.r.cachedCons+i)&x.r.mask]
	}
	x.r.release(n)
	return int(n)
}

// Size is the number of entries the ring holds.
func (x *RxRing) Size() int { return int(x.r.size) }

// TxRing takes descriptors of frames to transmit. One goroutine drives it.
type TxRing struct {
	r     ring
	descs []Desc
}

// Send queues as many of descs as fit and returns how many; the kernel owns
// those frames until they come back through the completion ring. In copy
// mode, or when NeedWakeup says so, the caller must then Kick the socket.
func (x *TxRing) Send(descs []Desc) int {
	n := x.r.room(uint32(len(descs)))
	for i := uint32(0); i < n; i++ {
		x.descs[(x.r.cachedProd+i)&x.r.mask] = descs[i]
	}
	x.r.publish(n)
	return int(n)
}

// NeedWakeup reports whether the kernel waits for a Kick to transmit.
func (x *TxRing) NeedWakeup() bool { return x.r.needWakeup() }

// Size is the number of entries the ring holds.
func (x *TxRing) Size() int { return int(x.r.size) }

// Pending is how many descriptors the kernel has not taken yet.
func (x *TxRing) Pending() int {
	_, n := x.r.inFlight()
	return int(n)
}

// Refiller gives received frames back to a fill ring and keeps the ones the
// ring refuses, offering them first on the next call, so that a frame is never
// lost. The ring can refuse even when sized for every frame the caller owns:
// the kernel publishes how far it consumed the ring only when it has used up
// what it saw. One Refiller per receiving loop; not safe for concurrent use.
type Refiller struct {
	Ring *FillRing
	// Pending are the frames waiting for room, oldest first.
	Pending []uint64
}

// Refill offers the pending frames, then addrs (nil: only the pending ones).
func (r *Refiller) Refill(addrs []uint64) {
	if len(r.Pending) > 0 {
		k := r.Ring.Fill(r.Pending)
		r.Pending = append(r.Pending[:0], r.Pending[k:]...)
	}
	if len(r.Pending) > 0 {
		r.Pending = append(r.Pending, addrs...)
		return
	}
	if k := r.Ring.Fill(addrs); k < len(addrs) {
		r.Pending = append(r.Pending, addrs[k:]...)
	}
}
