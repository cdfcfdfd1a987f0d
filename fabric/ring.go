package fabric

import (
	"fmt"
	"sync/atomic"
)

// ringView holds pointers into one ring of a region. Both ends build the
// same view; which words each end writes is fixed by its role.
type ringView struct {
	prod, prodLazy    *uint32
	drops             *uint64
	consArmed         *uint32
	read              *uint64 // cons and consN, stored and loaded as one word
	cons, consN       *uint32
	consLazy, prodArm *uint32
	data              []byte // the data area, capacity clipped to it
	size              uint32 // len(data): (depth+1) * maxRec
	depth, maxPayload uint32
}

func newRingView(mem []byte, d ringDesc) ringView {
	c := d.ctl
	end := d.data + uint64(d.dataLen)
	return ringView{
		prod:       u32at(mem, c+ctlProd),
		prodLazy:   u32at(mem, c+ctlProdLazy),
		drops:      u64at(mem, c+ctlDrops),
		consArmed:  u32at(mem, c+ctlConsArmed),
		read:       u64at(mem, c+ctlRead),
		cons:       u32at(mem, c+ctlCons),
		consLazy:   u32at(mem, c+ctlConsLazy),
		consN:      u32at(mem, c+ctlConsN),
		prodArm:    u32at(mem, c+ctlProdArmed),
		data:       mem[d.data:end:end],
		size:       d.dataLen,
		depth:      d.depth,
		maxPayload: d.maxRec - recHdr,
	}
}

// recLen is the bytes a record of an n-byte packet takes: header, packet,
// padding to recAlign. n must be at most maxPayload (< 2^16).
func recLen(n uint32) uint32 { return recHdr + (n+recAlign-1)&^(recAlign-1) }

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

// producer is the writing end of one single-producer/single-consumer ring.
// Its authoritative positions are private; the shared words are written
// for the consumer and only the consumer's read position and record count
// are ever read back, and those are validated before use. Not safe for
// concurrent use.
type producer struct {
	v     ringView
	prod  uint32 // byte position of the next record (private, authoritative)
	off   uint32 // prod's offset in the data area
	n     uint32 // records written
	cons  uint32 // lazy copy of the consumer's read position (validated)
	consN uint32 // lazy copy of the consumer's record count (validated)
	err   error
	wake  signaller // wakes a consumer sleeping for data
}

// consumer is the reading end of one ring. Everything it reads from shared
// memory — the write position and every record's length — is bounds
// checked; on any inconsistency the ring is marked broken and stays
// broken. Not safe for concurrent use.
type consumer struct {
	v    ringView
	cons uint32 // byte position of the next record (private, authoritative)
	off  uint32 // cons's offset in the data area
	n    uint32 // records consumed
	prod uint32 // lazy copy of the producer's write position (validated)
	err  error
	wake signaller // wakes a producer sleeping for space
}

// Err returns why the ring is broken, or nil.
func (p *producer) Err() error { return p.err }

// Err returns why the ring is broken, or nil.
func (c *consumer) Err() error { return c.err }

// MaxPayload is the largest packet the ring carries.
func (p *producer) MaxPayload() int { return int(p.v.maxPayload) }

// MaxPayload is the largest packet the ring carries.
func (c *consumer) MaxPayload() int { return int(c.v.maxPayload) }

// Depth is how many packets of the largest size the ring always has room
// for when empty; it holds more smaller ones.
func (p *producer) Depth() int { return int(p.v.depth) }

// Depth is how many packets of the largest size the ring always has room
// for when empty.
func (c *consumer) Depth() int { return int(c.v.depth) }

// refresh reloads the consumer's read position and record count, one
// 64-bit word. Each must lie between the last value we accepted and what
// we have written; anything else is a peer writing garbage, and trusting
// it would let us overwrite unread records.
func (p *producer) refresh() {
	r := atomic.LoadUint64(p.v.read)
	c, cn := uint32(r), uint32(r>>32)
	if cn-p.consN > p.n-p.consN {
		p.err = fmt.Errorf("%w: consumed record count %d outside [%d,%d]", ErrCorruption, cn, p.consN, p.n)
		return
	}
	if c-p.cons > p.prod-p.cons || c%recAlign != 0 {
		p.err = fmt.Errorf("%w: read position %d outside [%d,%d] or not a multiple of %d", ErrCorruption, c, p.cons, p.prod, recAlign)
		return
	}
	p.consN = cn
	if c != p.cons {
		p.cons = c
		*p.v.prodLazy = c // informational mirror, never read back: no ordering needed
	}
}

// Free returns how many packets of the largest size can be written
// without waiting: at least depth minus the packets queued, more when
// small ones are queued. It reloads the consumer's position only when the
// cached one shows no room, so a producer that runs ahead touches the
// consumer's line rarely.
func (p *producer) Free() int {
	if p.err != nil {
		return 0
	}
	n := p.largestFit()
	if n == 0 {
		p.refresh()
		if p.err != nil {
			return 0
		}
		n = p.largestFit()
	}
	return n
}

// largestFit counts the largest records the free bytes hold: those before
// the end of the data area, then those from offset 0 (records never cross
// the end; a skip record takes the bytes left there).
func (p *producer) largestFit() int {
	v := &p.v
	maxRec := v.maxPayload + recHdr
	free := v.size - (p.prod - p.cons)
	tail := min(free, v.size-p.off)
	return int(tail/maxRec + (free-tail)/maxRec)
}

// room reports whether a record of rec bytes, and the skip record it needs
// if it does not fit before the end, fit in the free bytes.
func (p *producer) room(rec uint32) bool {
	v := &p.v
	need := rec
	if rec > v.size-p.off {
		need += v.size - p.off
	}
	return need <= v.size-(p.prod-p.cons)
}

// Produce copies up to len(pkts) packets into the ring and publishes them
// with one release store, then wakes the consumer if it sleeps. It returns
// how many were written: fewer than asked means the ring was full (or a
// packet was too big: then err is ErrTooBig and n is its index).
func (p *producer) Produce(pkts [][]byte) (int, error) {
	return p.ProduceMeta(pkts, nil)
}

// ProduceMeta is Produce with a 32-bit metadata word per packet (for the
// bridge: the rule that classified it). meta may be nil.
//
// Bytes, not packets, limit a batch: the ring takes records until the
// next one does not fit, so it always has room for depth packets of the
// largest size and holds many more small ones (a request or an ACK of
// one of a thousand connections takes 56-200 bytes, not a slot). That is
// what keeps a receive ring from overflowing when many connections each
// have a packet or two in flight.
func (p *producer) ProduceMeta(pkts [][]byte, meta []uint32) (int, error) {
	if p.err != nil {
		return 0, p.err
	}
	if meta != nil && len(meta) < len(pkts) {
		// A caller's bug: fail before anything is written, not halfway
		// through a batch with records written and not yet published.
		panic("fabric: ProduceMeta: fewer metadata words than packets")
	}
	v := &p.v
	var err error
	refreshed := false
	i := 0
	for ; i < len(pkts); i++ {
		pkt := pkts[i]
		if len(pkt) > int(v.maxPayload) {
			err = ErrTooBig
			break
		}
		rec := recLen(uint32(len(pkt)))
		if !p.room(rec) {
			if refreshed {
				break
			}
			refreshed = true
			if p.refresh(); p.err != nil || !p.room(rec) {
				break
			}
		}
		off := p.off
		if rec > v.size-off {
			*u32at(v.data, uint64(off)) = skipMark
			p.prod += v.size - off
			off = 0
		}
		*u32at(v.data, uint64(off)) = uint32(len(pkt))
		var m uint32
		if meta != nil {
			m = meta[i]
		}
		*u32at(v.data, uint64(off)+4) = m
		copy(v.data[off+recHdr:], pkt)
		if off += rec; off == v.size {
			off = 0
		}
		p.off = off
		p.prod += rec
		p.n++
	}
	if i > 0 {
		atomic.StoreUint32(v.prod, p.prod)
		p.wake.wakeIfArmed(v.consArmed)
	}
	if p.err != nil {
		return i, p.err
	}
	return i, err
}

// countDrops adds to the producer's drop counter mirrored in shared memory
// so that the application can see what the bridge dropped for it.
func (p *producer) countDrops(n uint64) {
	if p.err == nil {
		atomic.StoreUint64(p.v.drops, atomic.LoadUint64(p.v.drops)+n)
	}
}

// refresh reloads the producer's write position, which must not move
// backwards, must not claim more than the data area, and must sit on a
// record boundary's alignment.
func (c *consumer) refresh() {
	w := atomic.LoadUint32(c.v.prod)
	if w-c.cons > c.v.size || w-c.cons < c.prod-c.cons || w%recAlign != 0 {
		c.err = fmt.Errorf("%w: write position %d, read position %d, previous write position %d, data area %d bytes", ErrCorruption, w, c.cons, c.prod, c.v.size)
		return
	}
	if w != c.prod {
		c.prod = w
		*c.v.consLazy = w // informational mirror, never read back: no ordering needed
	}
}

// Ready reports whether a packet is waiting. It is cheap enough to spin on.
func (c *consumer) Ready() bool {
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
// MaxPayload bytes). It releases the records with one store of the read
// position and record count, and wakes a producer that sleeps for space.
// It never blocks.
func (c *consumer) Consume(bufs [][]byte) (int, error) {
	return c.ConsumeMeta(bufs, nil)
}

// ConsumeMeta is Consume that also returns each packet's metadata word
// into meta (which may be nil, or must be as long as bufs).
//
// The producer's write position is reloaded at most once per call, when
// the records already known run out.
func (c *consumer) ConsumeMeta(bufs [][]byte, meta []uint32) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	v := &c.v
	start := c.cons
	refreshed := false
	i := 0
	for i < len(bufs) {
		if c.prod == c.cons {
			if refreshed {
				break
			}
			refreshed = true
			if c.refresh(); c.err != nil || c.prod == c.cons {
				break
			}
		}
		avail, off := c.prod-c.cons, c.off
		// Read the length once: the peer may change it under us, so the
		// value we check is the value we use. off is ours, a multiple of
		// 8 below size, so the 8-byte header is inside the data area, and
		// avail, a nonzero multiple of 8, covers it.
		l := atomic.LoadUint32(u32at(v.data, uint64(off)))
		if l == skipMark {
			skip := v.size - off
			if skip > avail {
				c.err = fmt.Errorf("%w: skip record at offset %d spans %d bytes, only %d published", ErrCorruption, off, skip, avail)
				break
			}
			c.cons += skip
			c.off = 0
			continue
		}
		if l > v.maxPayload {
			c.err = fmt.Errorf("%w: record at offset %d claims length %d, max %d", ErrCorruption, off, l, v.maxPayload)
			break
		}
		rec := recLen(l)
		if rec > v.size-off {
			c.err = fmt.Errorf("%w: record at offset %d of %d bytes crosses the end of the %d-byte data area", ErrCorruption, off, rec, v.size)
			break
		}
		if rec > avail {
			c.err = fmt.Errorf("%w: record at offset %d of %d bytes, only %d published", ErrCorruption, off, rec, avail)
			break
		}
		if meta != nil {
			meta[i] = atomic.LoadUint32(u32at(v.data, uint64(off)+4))
		}
		b := bufs[i][:cap(bufs[i])]
		k := copy(b, v.data[off+recHdr:off+recHdr+l])
		bufs[i] = b[:k]
		if off += rec; off == v.size {
			off = 0
		}
		c.off = off
		c.cons += rec
		c.n++
		i++
	}
	if c.cons != start {
		// One store for both, so the producer never sees a count
		// ahead of its position.
		atomic.StoreUint64(v.read, uint64(c.n)<<32|uint64(c.cons))
		c.wake.wakeIfArmed(v.prodArm)
	}
	return i, c.err
}
