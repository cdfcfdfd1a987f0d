package fabric

import (
	"fmt"
	"sync/atomic"
)

// ringView holds pointers into one ring of a region. Both ends build the
// same view; which words each end writes is fixed by its role.
type ringView struct {
	prod, prodLazy     *uint32
	drops              *uint64
	cons, consLazy     *uint32
	consArmed, prodArm *uint32
	slots              []byte
	count, mask        uint32
	stride, maxPayload uint32
}

func newRingView(mem []byte, d ringDesc) ringView {
	c := d.ctl
	return ringView{
		prod:       u32at(mem, c+ctlProd),
		prodLazy:   u32at(mem, c+ctlProdLazy),
		drops:      u64at(mem, c+ctlDrops),
		cons:       u32at(mem, c+ctlCons),
		consLazy:   u32at(mem, c+ctlConsLazy),
		consArmed:  u32at(mem, c+ctlConsArmed),
		prodArm:    u32at(mem, c+ctlProdArmed),
		slots:      mem[d.slots : d.slots+uint64(d.count)*uint64(d.stride) : d.slots+uint64(d.count)*uint64(d.stride)],
		count:      d.count,
		mask:       d.count - 1,
		stride:     d.stride,
		maxPayload: d.stride - slotHdr,
	}
}

// signaller wakes the other end of a ring. It is an eventfd in the shm
// transport and a no-op (fd < 0) where nobody ever sleeps.
type signaller struct {
	fd      int
	signals atomic.Uint64
}

// wakeIfArmed implements the producer half of the tripwire: the sleeper
// armed *flag before its final re-check, we published before looking at
// the flag, and both accesses are sequentially consistent, so at least one
// side sees the other. Clearing with CAS makes exactly one signal per
// sleep, and a loaded ring whose peer never sleeps costs one load.
//
// Under the race detector a swap replaces the load, see raceEnabled.
func (s *signaller) wakeIfArmed(flag *uint32) {
	var armed bool
	if raceEnabled {
		armed = atomic.SwapUint32(flag, 0) != 0
	} else {
		armed = atomic.LoadUint32(flag) != 0 && atomic.CompareAndSwapUint32(flag, 1, 0)
	}
	if armed && s.fd >= 0 {
		s.signals.Add(1)
		eventfdSignal(s.fd)
	}
}

// Producer is the writing end of one single-producer/single-consumer ring.
// Its authoritative indices are private; the shared words are written for
// the consumer and only the consumer's read index is ever read back, and
// that one is validated before use. Not safe for concurrent use.
type Producer struct {
	v    ringView
	prod uint32 // next index to write (private, authoritative)
	cons uint32 // lazy copy of the consumer's read index (validated)
	err  error
	wake signaller // wakes a consumer sleeping for data
}

// Consumer is the reading end of one ring. Everything it reads from shared
// memory — the write index and every slot length — is bounds checked; on
// any inconsistency the ring is marked broken and stays broken. Not safe
// for concurrent use.
type Consumer struct {
	v    ringView
	cons uint32 // next index to read (private, authoritative)
	prod uint32 // lazy copy of the producer's write index (validated)
	err  error
	wake signaller // wakes a producer sleeping for space
}

// Err returns why the ring is broken, or nil.
func (p *Producer) Err() error { return p.err }

// Err returns why the ring is broken, or nil.
func (c *Consumer) Err() error { return c.err }

// MaxPayload is the largest packet a slot carries.
func (p *Producer) MaxPayload() int { return int(p.v.maxPayload) }

// MaxPayload is the largest packet a slot carries.
func (c *Consumer) MaxPayload() int { return int(c.v.maxPayload) }

// Depth is the number of slots in the ring.
func (p *Producer) Depth() int { return int(p.v.count) }

// Depth is the number of slots in the ring.
func (c *Consumer) Depth() int { return int(c.v.count) }

// refresh reloads the consumer's read index. It must lie between the last
// value we accepted and our own write index; anything else is a peer
// writing garbage, and trusting it would let us overwrite unread slots.
func (p *Producer) refresh() {
	c := atomic.LoadUint32(p.v.cons)
	if c-p.cons > p.prod-p.cons {
		p.err = fmt.Errorf("%w: read index %d outside [%d,%d]", ErrCorruption, c, p.cons, p.prod)
		return
	}
	if c != p.cons {
		p.cons = c
		atomic.StoreUint32(p.v.prodLazy, c) // informational mirror, never read back
	}
}

// Free returns how many slots can be written without waiting. It refreshes
// the lazy copy of the read index only when the cached copy shows a full
// ring, so a producer that runs ahead touches the consumer's line rarely.
func (p *Producer) Free() int {
	if p.err != nil {
		return 0
	}
	if p.prod-p.cons == p.v.count {
		p.refresh()
	}
	return int(p.v.count - (p.prod - p.cons))
}

// Produce copies up to len(pkts) packets into the ring and publishes them
// with one release store, then wakes the consumer if it sleeps. It returns
// how many were written: fewer than asked means the ring was full (or a
// packet was too big: then err is ErrTooBig and n is its index).
func (p *Producer) Produce(pkts [][]byte) (int, error) {
	return p.ProduceMeta(pkts, nil)
}

// ProduceMeta is Produce with a 32-bit metadata word per packet (for the
// bridge: the rule that classified it). meta may be nil.
func (p *Producer) ProduceMeta(pkts [][]byte, meta []uint32) (int, error) {
	if p.err != nil {
		return 0, p.err
	}
	free := p.v.count - (p.prod - p.cons)
	if free < uint32(len(pkts)) {
		p.refresh()
		if p.err != nil {
			return 0, p.err
		}
		free = p.v.count - (p.prod - p.cons)
	}
	n := uint32(len(pkts))
	if n > free {
		n = free
	}
	var err error
	i := uint32(0)
	for ; i < n; i++ {
		pkt := pkts[i]
		if uint32(len(pkt)) > p.v.maxPayload || len(pkt) > int(p.v.maxPayload) {
			err = ErrTooBig
			break
		}
		off := ((p.prod + i) & p.v.mask) * p.v.stride
		slot := p.v.slots[off : off+p.v.stride]
		*u32at(slot, 0) = uint32(len(pkt))
		var m uint32
		if meta != nil {
			m = meta[i]
		}
		*u32at(slot, 4) = m
		copy(slot[slotHdr:], pkt)
	}
	if i > 0 {
		p.prod += i
		atomic.StoreUint32(p.v.prod, p.prod)
		p.wake.wakeIfArmed(p.v.consArmed)
	}
	return int(i), err
}

// countDrops adds to the producer's drop counter mirrored in shared memory
// so that the application can see what the bridge dropped for it.
func (p *Producer) countDrops(n uint64) {
	if p.err == nil {
		atomic.StoreUint64(p.v.drops, atomic.LoadUint64(p.v.drops)+n)
	}
}

// refresh reloads the producer's write index, which must not move
// backwards and must not claim more than a full ring.
func (c *Consumer) refresh() {
	w := atomic.LoadUint32(c.v.prod)
	if w-c.cons > c.v.count || w-c.cons < c.prod-c.cons {
		c.err = fmt.Errorf("%w: write index %d, read index %d, previous write index %d, depth %d", ErrCorruption, w, c.cons, c.prod, c.v.count)
		return
	}
	if w != c.prod {
		c.prod = w
		atomic.StoreUint32(c.v.consLazy, w) // informational mirror, never read back
	}
}

// Ready reports whether a packet is waiting. It is cheap enough to spin on.
func (c *Consumer) Ready() bool {
	if c.err != nil {
		return true // a broken ring is "ready": the caller must look
	}
	if c.prod != c.cons {
		return true
	}
	c.refresh()
	return c.prod != c.cons || c.err != nil
}

// Consume copies up to len(bufs) packets into the caller's buffers, using
// each buffer's full capacity and reslicing bufs[i] to the packet length
// (a packet longer than the buffer is truncated, so give buffers of
// MaxPayload bytes). It releases the slots with one store and wakes a
// producer that sleeps for space. It never blocks.
func (c *Consumer) Consume(bufs [][]byte) (int, error) {
	return c.ConsumeMeta(bufs, nil)
}

// ConsumeMeta is Consume that also returns each packet's metadata word
// into meta (which may be nil, or must be as long as bufs).
func (c *Consumer) ConsumeMeta(bufs [][]byte, meta []uint32) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	avail := c.prod - c.cons
	if avail < uint32(len(bufs)) {
		c.refresh()
		if c.err != nil {
			return 0, c.err
		}
		avail = c.prod - c.cons
	}
	n := uint32(len(bufs))
	if n > avail {
		n = avail
	}
	i := uint32(0)
	for ; i < n; i++ {
		off := ((c.cons + i) & c.v.mask) * c.v.stride
		slot := c.v.slots[off : off+c.v.stride]
		// Read the length once: the peer may change it under us, so the
		// value we check is the value we use.
		l := atomic.LoadUint32(u32at(slot, 0))
		if l > c.v.maxPayload {
			c.err = fmt.Errorf("%w: slot %d claims length %d, max %d", ErrCorruption, (c.cons+i)&c.v.mask, l, c.v.maxPayload)
			break
		}
		if meta != nil {
			meta[i] = atomic.LoadUint32(u32at(slot, 4))
		}
		b := bufs[i][:cap(bufs[i])]
		k := copy(b, slot[slotHdr:slotHdr+l])
		bufs[i] = b[:k]
	}
	if i > 0 {
		c.cons += i
		atomic.StoreUint32(c.v.cons, c.cons)
		c.wake.wakeIfArmed(c.v.prodArm)
	}
	return int(i), c.err
}
