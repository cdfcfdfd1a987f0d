package fabric

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"
)

// Fixed slots against variable-length records, the choice the package
// documentation makes, backed by a measurement:
//
//	go test -run '^$' -bench 'SlotsVsRecords' -benchtime 1000000x ./fabric/
//
// varRing below is a minimal variable-length record ring with the same
// discipline as the real ring (lazy index copies, one release store per
// batch, every length validated once against the published region), so
// that the two differ only in how packets sit in memory. Both use the
// same 2 MiB of ring memory (1024 slots of 2048 bytes) in private memory,
// one producer and one consumer goroutine spinning, the consumer taking
// up to 64 packets at a time. The test below checks the prototype is a
// correct ring, so the comparison is not against a broken one.

// varRing is a byte ring of records: u32 length, u32 metadata, the packet,
// padding to 8 bytes. A record never wraps: if it does not fit before the
// end, the producer writes the length varWrap there and starts at 0.
type varRing struct {
	buf        []byte
	mask       uint32
	maxPayload uint32
	prod       *uint32 // own cache lines, as in the real control block
	cons       *uint32
}

const varWrap = ^uint32(0)

func newVarRing(size, maxPayload int) *varRing {
	words := make([]uint64, (size+256)/8)
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), size+256)
	return &varRing{
		buf: mem[256:], mask: uint32(size - 1), maxPayload: uint32(maxPayload),
		prod: (*uint32)(unsafe.Pointer(&mem[0])), cons: (*uint32)(unsafe.Pointer(&mem[128])),
	}
}

type varProducer struct {
	r          *varRing
	prod, cons uint32
}

type varConsumer struct {
	r          *varRing
	cons, prod uint32
	err        error
}

func recLen(n int) uint32 { return uint32(8 + (n+7)&^7) }

func (p *varProducer) produce(pkts [][]byte) int {
	r := p.r
	size := r.mask + 1
	i := 0
	for ; i < len(pkts); i++ {
		pkt := pkts[i]
		rec := recLen(len(pkt))
		off := p.prod & r.mask
		need := rec
		if off+rec > size {
			need += size - off // skip to the start
		}
		if size-(p.prod-p.cons) < need {
			p.cons = atomic.LoadUint32(r.cons) // validated in the real thing
			if size-(p.prod-p.cons) < need {
				break
			}
		}
		if off+rec > size {
			*(*uint32)(unsafe.Pointer(&r.buf[off])) = varWrap
			p.prod += size - off
			off = 0
		}
		*(*uint32)(unsafe.Pointer(&r.buf[off])) = uint32(len(pkt))
		*(*uint32)(unsafe.Pointer(&r.buf[off+4])) = 0
		copy(r.buf[off+8:], pkt)
		p.prod += rec
	}
	if i > 0 {
		atomic.StoreUint32(r.prod, p.prod)
	}
	return i
}

var errVarCorrupt = errors.New("varring: corrupt record")

func (c *varConsumer) consume(bufs [][]byte) int {
	r := c.r
	size := r.mask + 1
	if c.prod == c.cons {
		w := atomic.LoadUint32(r.prod)
		if w-c.cons > size || w-c.cons < c.prod-c.cons {
			c.err = errVarCorrupt
			return 0
		}
		c.prod = w
	}
	i := 0
	start := c.cons
	for i < len(bufs) && c.cons != c.prod {
		avail := c.prod - c.cons
		off := c.cons & r.mask
		l := atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.buf[off])))
		if l == varWrap {
			if size-off > avail {
				c.err = errVarCorrupt
				break
			}
			c.cons += size - off
			continue
		}
		rec := recLen(int(l))
		// Three checks where a fixed slot needs one: the length, the
		// record within what was published, and within the buffer.
		if l > r.maxPayload || rec > avail || off+rec > size {
			c.err = errVarCorrupt
			break
		}
		b := bufs[i][:cap(bufs[i])]
		bufs[i] = b[:copy(b, r.buf[off+8:off+8+l])]
		c.cons += rec
		i++
	}
	if c.cons != start {
		atomic.StoreUint32(r.cons, c.cons)
	}
	return i
}

// The prototype is a correct ring: order, lengths and contents survive
// wrap-arounds with mixed sizes, and a full ring refuses rather than
// overwrites.
func TestVarRingPrototype(t *testing.T) {
	r := newVarRing(4096, 2040)
	p, c := &varProducer{r: r}, &varConsumer{r: r}
	in, out := mkBufs(64, 1500), mkBufs(64, 2048)
	// Full: 72-byte records, 56 of them fill 4032 of 4096 bytes.
	pk := make([][]byte, 64)
	for i := range pk {
		pk[i] = seqPkt(in[i], uint32(i), 64)
	}
	if n := p.produce(pk); n != 56 {
		t.Fatalf("%d 64-byte packets fit in 4096 bytes, want 56", n)
	}
	if n := c.consume(out); n != 56 || c.err != nil {
		t.Fatalf("consumed %d (%v), want 56", n, c.err)
	}
	for i := 0; i < 56; i++ {
		checkSeqPkt(t, out[i], uint32(i), 64)
	}
	// Mixed sizes, uneven batches, many wrap-arounds.
	sent, got := uint32(56), uint32(56)
	for round := 0; round < 3000; round++ {
		k := 1 + round%8
		for i := 0; i < k; i++ {
			pk[i] = seqPkt(in[i], sent+uint32(i), mixedSize(int(sent)+i))
		}
		sent += uint32(p.produce(pk[:k]))
		m := c.consume(out[:1+(round*5)%8])
		if c.err != nil {
			t.Fatal(c.err)
		}
		for i := 0; i < m; i++ {
			checkSeqPkt(t, out[i], got, mixedSize(int(got)))
			got++
		}
	}
	if got < 3000 || sent-got > 4096/72 {
		t.Fatalf("sent %d, received %d", sent, got)
	}
}

// mixedSize cycles a simple Internet mix: seven 64-byte packets, four of
// 576 and one of 1500.
func mixedSize(i int) int {
	switch i % 12 {
	case 7, 8, 9, 10:
		return 576
	case 11:
		return 1500
	}
	return 64
}

// ringRate moves n packets through one of the two rings.
func ringRate(b *testing.B, variable bool, n, batch int, size func(int) int) float64 {
	var produce func([][]byte) int
	var consume func([][]byte) int
	if variable {
		r := newVarRing(1024*2048, 2040)
		p, c := &varProducer{r: r}, &varConsumer{r: r}
		produce, consume = p.produce, func(bufs [][]byte) int {
			k := c.consume(bufs)
			if c.err != nil {
				b.Fatal(c.err)
			}
			return k
		}
	} else {
		p, c, err := NewRingPair(1024, 2048)
		if err != nil {
			b.Fatal(err)
		}
		produce = func(pkts [][]byte) int { k, _ := p.Produce(pkts); return k }
		consume = func(bufs [][]byte) int {
			k, err := c.Consume(bufs)
			if err != nil {
				b.Fatal(err)
			}
			return k
		}
	}
	in := mkBufs(batch, 1500)
	pk := make([][]byte, batch)
	start := time.Now()
	go func() {
		for sent := 0; sent < n; {
			k := min(batch, n-sent)
			for i := 0; i < k; i++ {
				pk[i] = in[i][:size(sent+i)]
			}
			for off := 0; off < k; {
				off += produce(pk[off:k])
			}
			sent += k
		}
	}()
	out := mkBufs(64, 2048)
	for got := 0; got < n; {
		got += consume(out)
	}
	return float64(n) / time.Since(start).Seconds()
}

func median(x []float64) float64 {
	slices.Sort(x)
	return x[len(x)/2]
}

// BenchmarkSlotsVsRecords alternates the two rings five times each and
// reports medians, so that load from other processes on a shared machine
// hits both alike.
func BenchmarkSlotsVsRecords(b *testing.B) {
	sizes := []struct {
		name string
		f    func(int) int
	}{
		{"64", func(int) int { return 64 }},
		{"1500", func(int) int { return 1500 }},
		{"mix", mixedSize},
	}
	for _, sz := range sizes {
		for _, batch := range []int{64, 1} {
			b.Run(fmt.Sprintf("size=%s/batch=%d", sz.name, batch), func(b *testing.B) {
				var fixed, variable []float64
				for round := 0; round < 5; round++ {
					fixed = append(fixed, ringRate(b, false, b.N, batch, sz.f))
					variable = append(variable, ringRate(b, true, b.N, batch, sz.f))
				}
				f, v := median(fixed), median(variable)
				b.ReportMetric(f, "slots-msgs/s")
				b.ReportMetric(v, "records-msgs/s")
				b.ReportMetric(v/f, "records/slots")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}
