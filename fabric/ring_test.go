package fabric

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
)

func mkBufs(n, size int) [][]byte {
	b := make([][]byte, n)
	for i := range b {
		b[i] = make([]byte, size)
	}
	return b
}

func seqPkt(buf []byte, seq uint32, size int) []byte {
	buf = buf[:size]
	binary.LittleEndian.PutUint32(buf, seq)
	for i := 4; i < size; i++ {
		buf[i] = byte(seq + uint32(i))
	}
	return buf
}

func checkSeqPkt(t testing.TB, pkt []byte, seq uint32, size int) {
	t.Helper()
	if len(pkt) != size {
		t.Fatalf("packet %d: length %d, want %d", seq, len(pkt), size)
	}
	if got := binary.LittleEndian.Uint32(pkt); got != seq {
		t.Fatalf("packet order: got seq %d, want %d", got, seq)
	}
	for i := 4; i < size; i++ {
		if pkt[i] != byte(seq+uint32(i)) {
			t.Fatalf("packet %d: byte %d corrupted", seq, i)
		}
	}
}

// The ring keeps order across many wrap-arounds, never holds more bytes
// than its data area, and refuses (never overwrites) when full.
func TestRingOrderWrapAndFull(t *testing.T) {
	p, c, err := newRingPair(8, 128)
	if err != nil {
		t.Fatal(err)
	}
	in := mkBufs(16, 120)
	out := mkBufs(16, 120)
	var next, want uint32
	for round := 0; round < 100; round++ {
		k := 1 + round%11
		pk := make([][]byte, k)
		for i := range pk {
			pk[i] = seqPkt(in[i], next+uint32(i), 4+(int(next)+i)%100)
		}
		n, err := p.Produce(pk)
		if err != nil {
			t.Fatal(err)
		}
		next += uint32(n)
		var held uint32
		for s := want; s != next; s++ {
			held += recLen(uint32(4 + int(s)%100))
		}
		if held > 9*128 {
			t.Fatalf("ring holds %d bytes of records, more than its data area", held)
		}
		m, err := c.Consume(out[:1+round%5])
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < m; i++ {
			checkSeqPkt(t, out[i], want, 4+int(want)%100)
			want++
		}
	}
	// Fill completely: a full-size packet beyond what Free promised must be
	// refused, and what was queued stays intact.
	for p.Free() > 0 {
		if n, _ := p.Produce([][]byte{seqPkt(in[0], next, 4+int(next)%100)}); n != 1 {
			t.Fatal("produce into non-full ring failed")
		}
		next++
	}
	if n, err := p.Produce([][]byte{in[1][:p.MaxPayload()]}); n != 0 || err != nil {
		t.Fatalf("produce into full ring: n=%d err=%v", n, err)
	}
	for want != next {
		m, _ := c.Consume(out[:3])
		if m == 0 {
			t.Fatal("consumer found nothing before reaching producer")
		}
		for i := 0; i < m; i++ {
			checkSeqPkt(t, out[i], want, 4+int(want)%100)
			want++
		}
	}
	if c.Ready() {
		t.Fatal("empty ring reports ready")
	}
}

func TestRingTooBigAndTruncation(t *testing.T) {
	p, c, err := newRingPair(4, 64)
	if err != nil {
		t.Fatal(err)
	}
	if p.MaxPayload() != 56 {
		t.Fatalf("MaxPayload %d, want 56", p.MaxPayload())
	}
	n, err := p.Produce([][]byte{make([]byte, 56), make([]byte, 57)})
	if n != 1 || !errors.Is(err, ErrTooBig) {
		t.Fatalf("n=%d err=%v, want 1, ErrTooBig", n, err)
	}
	small := [][]byte{make([]byte, 10)}
	if n, _ := c.Consume(small); n != 1 || len(small[0]) != 10 {
		t.Fatalf("truncating consume: n=%d len=%d", n, len(small[0]))
	}
}

// A hostile producer (the application, for the TX ring) writes garbage
// into the shared words and records; the consumer must refuse, stay
// broken, and never read outside the data area (its slice is clipped to
// the area, so a stray access would panic the test).
func TestRingHostileProducer(t *testing.T) {
	cases := []struct {
		name  string
		spoil func(v *ringView)
	}{
		// Three 16-byte records published (write position 48), the
		// consumer has taken the first (read position 16).
		// The consumer first takes the two records it knows of (read
		// position 48), then reloads the write position.
		{"write position beyond the data area", func(v *ringView) { *v.prod = 48 + v.size + 8 }},
		{"write position far ahead", func(v *ringView) { *v.prod = 0x80000000 }},
		{"write position backwards", func(v *ringView) { *v.prod = 32 }},
		{"write position misaligned", func(v *ringView) { *v.prod = 52 }},
		{"length huge", func(v *ringView) { *u32at(v.data, 16) = 0xfffffffe }},
		{"length one too big", func(v *ringView) { *u32at(v.data, 16) = v.maxPayload + 1 }},
		{"length beyond the data area", func(v *ringView) { *u32at(v.data, 16) = v.size }},
		{"length beyond what was published", func(v *ringView) { *u32at(v.data, 32) = 100 }},
		{"skip record short of the end", func(v *ringView) { *u32at(v.data, 16) = skipMark }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, c, _ := newRingPair(8, 128)
			pk := [][]byte{make([]byte, 5), make([]byte, 6), make([]byte, 7)}
			p.Produce(pk)
			out := mkBufs(8, 128)
			if n, err := c.Consume(out[:1]); n != 1 || err != nil {
				t.Fatal(n, err)
			}
			c.refresh() // the consumer has now seen write position 48
			tc.spoil(&p.v)
			n, err := c.Consume(out)
			if !errors.Is(err, ErrCorruption) {
				t.Fatalf("consume after corruption: n=%d err=%v", n, err)
			}
			if n2, err2 := c.Consume(out); n2 != 0 || err2 == nil {
				t.Fatal("broken ring must stay broken")
			}
		})
	}
}

// advance moves both ends of an empty ring forward by k records of n
// bytes, so that a test can put the next record where it wants.
func advance(t *testing.T, p *producer, c *consumer, k, n int) {
	t.Helper()
	out := mkBufs(1, 2048)
	for range k {
		if m, err := p.Produce([][]byte{make([]byte, n)}); m != 1 || err != nil {
			t.Fatal("produce", m, err)
		}
		if m, err := c.Consume(out); m != 1 || err != nil {
			t.Fatal("consume", m, err)
		}
	}
}

// Record-specific lies about the end of the data area: a record whose
// length runs past the end (records never wrap), and a skip record placed
// where its span to the end was not published.
func TestRingHostileRecordsAtTheEnd(t *testing.T) {
	t.Run("record crosses the end", func(t *testing.T) {
		p, c, _ := newRingPair(8, 128) // data area 1152 bytes
		advance(t, p, c, 71, 8)        // 71 records of 16 bytes: offset 1136, 16 bytes left
		if c.off != 1136 {
			t.Fatalf("consumer offset %d, want 1136", c.off)
		}
		p.Produce([][]byte{make([]byte, 8)})
		*u32at(p.v.data, 1136) = 100 // a 112-byte record in 16 bytes
		*p.v.prod = c.cons + 128     // "published" well within the ring
		_, err := c.Consume(mkBufs(4, 128))
		if !errors.Is(err, ErrCorruption) || !strings.Contains(err.Error(), "crosses the end") {
			t.Fatalf("err %v, want a record crossing the end refused", err)
		}
	})
	t.Run("skip record not published to the end", func(t *testing.T) {
		p, c, _ := newRingPair(8, 128)
		advance(t, p, c, 60, 8) // offset 960, 192 bytes left
		p.Produce([][]byte{make([]byte, 8), make([]byte, 8)})
		*u32at(p.v.data, 960) = skipMark // claims the last 192 bytes, 32 published
		_, err := c.Consume(mkBufs(4, 128))
		if !errors.Is(err, ErrCorruption) || !strings.Contains(err.Error(), "skip record") {
			t.Fatalf("err %v, want a misplaced skip record refused", err)
		}
	})
	t.Run("honest skip", func(t *testing.T) {
		p, c, _ := newRingPair(8, 128)
		advance(t, p, c, 71, 8) // 16 bytes left: a 120-byte packet must skip them
		in := [][]byte{seqPkt(make([]byte, 120), 7, 120)}
		if m, err := p.Produce(in); m != 1 || err != nil {
			t.Fatal(m, err)
		}
		if got := *u32at(p.v.data, 1136); got != skipMark {
			t.Fatalf("word at 1136 is %#x, want a skip record", got)
		}
		out := mkBufs(1, 128)
		if m, err := c.Consume(out); m != 1 || err != nil {
			t.Fatal(m, err)
		}
		checkSeqPkt(t, out[0], 7, 120)
		if c.off != 128 || c.cons != 71*16+16+128 {
			t.Fatalf("consumer at offset %d position %d", c.off, c.cons)
		}
	})
}

// A hostile consumer (the application, for the RX ring) moves its read
// position or record count where they cannot be; the producer must
// refuse rather than overwrite.
func TestRingHostileConsumer(t *testing.T) {
	spoils := map[string]func(c *consumer){
		// When the producer reloads, it has written 5 records (position 320).
		"read position ahead":      func(c *consumer) { *c.v.cons = 328 },
		"read position misaligned": func(c *consumer) { *c.v.cons = 4 },
		"read position backwards":  func(c *consumer) { *c.v.cons = 0xfffffff8 },
		"read position far off":    func(c *consumer) { *c.v.cons = 0x40000000 },
		"record count ahead":       func(c *consumer) { *c.v.consN = 6 },
		"record count backwards":   func(c *consumer) { *c.v.consN = 0xffffffff },
	}
	full := mkBufs(5, 56) // 64-byte records: five fill the (4+1) x 64-byte data area
	for name, spoil := range spoils {
		p, c, _ := newRingPair(4, 64)
		if n, _ := p.Produce(full); n != 5 {
			t.Fatal("fill", n)
		}
		spoil(c)
		p.Produce([][]byte{{1}}) // needs a refresh: no byte free by the lazy copy
		if !errors.Is(p.Err(), ErrCorruption) {
			t.Errorf("%s: producer err %v, want corruption", name, p.Err())
		}
	}
	// A consumer that owns up to taking every record but leaves its read
	// position behind: the producer goes by bytes and refuses instead of
	// overwriting what it believes unread.
	p, c, _ := newRingPair(4, 64)
	if n, _ := p.Produce(full); n != 5 {
		t.Fatal("fill", n)
	}
	*c.v.consN = 5
	if n, err := p.Produce([][]byte{{1}}); n != 0 || err != nil {
		t.Fatalf("lagging read position: n=%d err=%v, want a full ring", n, err)
	}
	if c.v.data[recHdr] != 0 || *u32at(c.v.data, 0) != 56 {
		t.Fatal("the first record was overwritten")
	}
}

// Whatever sizes came before, a ring holding fewer than depth packets has
// room for one of the largest size (the (depth+1) x max-record data area
// is what makes depth a contract), and the producer takes a packet exactly
// when a model of the data area says its record, and the skip record it
// may need, fit in the free bytes.
func TestRingDepthGuarantee(t *testing.T) {
	const depth, slot = 8, 128
	const size = (depth + 1) * slot
	p, c, _ := newRingPair(depth, slot)
	rnd := rand.New(rand.NewPCG(1, 2))
	big := make([]byte, p.MaxPayload())
	out := mkBufs(depth, slot)
	// The model: the bytes each queued packet took (a skip record before
	// it included), the bytes in use, the offset of the next record.
	var taken []uint32
	var used, off uint32
	fits := func(n int) (rec, need uint32, ok bool) {
		rec = uint32(recHdr + (n+7)/8*8)
		need = rec
		if rec > size-off {
			need += size - off
		}
		return rec, need, need <= size-used
	}
	produce := func(pk [][]byte) int {
		n, err := p.Produce(pk)
		if err != nil {
			t.Fatal(err)
		}
		for i, pkt := range pk {
			rec, need, ok := fits(len(pkt))
			if ok != (i < n) {
				t.Fatalf("packet %d of %d (%d bytes): model says fits=%v, producer took %d (%d bytes in use at offset %d)", i, len(pk), len(pkt), ok, n, used, off)
			}
			if !ok {
				break
			}
			taken = append(taken, need)
			used += need
			if need > rec { // a skip record to the end, the record at 0
				off = 0
			}
			if off += rec; off == size {
				off = 0
			}
		}
		return n
	}
	for step := 0; step < 20000; step++ {
		if len(taken) < depth {
			if produce([][]byte{big}) != 1 {
				t.Fatalf("step %d: %d queued, a largest packet refused", step, len(taken))
			}
		}
		pk := make([][]byte, rnd.IntN(2*depth))
		for i := range pk {
			pk[i] = big[:rnd.IntN(len(big)+1)]
		}
		produce(pk)
		m, err := c.Consume(out[:rnd.IntN(depth+1)])
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range taken[:m] {
			used -= b
		}
		taken = taken[m:]
	}
}

// Mixed sizes, uneven batches and metadata words survive many laps of the
// data area, with skip records at its end.
func TestRingRecordsMixedLaps(t *testing.T) {
	sizeOf := func(seq uint32) int { return 4 + int((seq*2654435761)>>16)%1497 }
	p, c, _ := newRingPair(64, 2048)
	in, out := mkBufs(16, 1500), mkBufs(16, 2048)
	pk := make([][]byte, 16)
	meta, gotMeta := make([]uint32, 16), make([]uint32, 16)
	var sent, got uint32
	for round := 0; round < 20000; round++ {
		k := 1 + round%13
		for i := 0; i < k; i++ {
			seq := sent + uint32(i)
			pk[i], meta[i] = seqPkt(in[i], seq, sizeOf(seq)), ^seq
		}
		n, err := p.ProduceMeta(pk[:k], meta[:k])
		if err != nil {
			t.Fatal(err)
		}
		sent += uint32(n)
		m, err := c.ConsumeMeta(out[:1+round%16], gotMeta)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < m; i++ {
			checkSeqPkt(t, out[i], got, sizeOf(got))
			if gotMeta[i] != ^got {
				t.Fatalf("packet %d: meta %#x", got, gotMeta[i])
			}
			got++
		}
	}
	if laps := p.prod / p.v.size; laps < 10 {
		t.Fatalf("only %d laps of the data area", laps)
	}
	if got < 50000 {
		t.Fatalf("only %d packets", got)
	}
}

// Header validation refuses every malformed region with the right error.
func TestReadHeaderValidation(t *testing.T) {
	l, err := computeLayout(Config{RxSlots: 16, TxSlots: 8, SlotSize: 256})
	if err != nil {
		t.Fatal(err)
	}
	fresh := func() []byte {
		m := make([]byte, l.size)
		writeHeader(m, l)
		return m
	}
	if _, err := readHeader(fresh()); err != nil {
		t.Fatalf("valid header refused: %v", err)
	}
	cases := []struct {
		name  string
		spoil func(m []byte) []byte
		want  error
	}{
		{"magic", func(m []byte) []byte { *u32at(m, offMagic) = 0x12345678; return m }, ErrBadMagic},
		{"version 1", func(m []byte) []byte { *u32at(m, offVersion) = 1; return m }, ErrVersion},
		{"version 3", func(m []byte) []byte { *u32at(m, offVersion) = 3; return m }, ErrVersion},
		{"short", func(m []byte) []byte { return m[:64] }, ErrBadLayout},
		{"length", func(m []byte) []byte { return m[:len(m)-4096] }, ErrBadLayout},
		{"header len", func(m []byte) []byte { *u32at(m, offHeaderLen) = 64; return m }, ErrBadLayout},
		{"depth not pow2", func(m []byte) []byte { *u32at(m, offRxDesc+descDepth) = 12; return m }, ErrBadLayout},
		{"depth huge", func(m []byte) []byte { *u32at(m, offRxDesc+descDepth) = 1 << 31; return m }, ErrBadLayout},
		{"max record odd", func(m []byte) []byte { *u32at(m, offTxDesc+descMaxRec) = 100; return m }, ErrBadLayout},
		{"data length short", func(m []byte) []byte { *u32at(m, offTxDesc+descDataLen) -= 64; return m }, ErrBadLayout},
		{"data length long", func(m []byte) []byte { *u32at(m, offRxDesc+descDataLen) += 64; return m }, ErrBadLayout},
		{"data length of depth x max record", func(m []byte) []byte { *u32at(m, offRxDesc+descDataLen) = 16 * 256; return m }, ErrBadLayout},
		{"data past end", func(m []byte) []byte { *u64at(m, offTxDesc+descData) = l.size - 64; return m }, ErrBadLayout},
		{"data wrap", func(m []byte) []byte { *u64at(m, offTxDesc+descData) = 1<<64 - 64; return m }, ErrBadLayout},
		{"data misaligned", func(m []byte) []byte { *u64at(m, offTxDesc+descData) += 8; return m }, ErrBadLayout},
		{"ctl misaligned", func(m []byte) []byte { *u64at(m, offRxDesc+descCtl) = 192; return m }, ErrBadLayout},
		{"ctl overlaps header", func(m []byte) []byte { *u64at(m, offRxDesc+descCtl) = 0; return m }, ErrBadLayout},
		{"rings overlap", func(m []byte) []byte { *u64at(m, offTxDesc+descData) = l.rx.data; return m }, ErrBadLayout},
		{"ctl in data", func(m []byte) []byte { *u64at(m, offTxDesc+descCtl) = l.rx.data; return m }, ErrBadLayout},
	}
	for _, tc := range cases {
		_, err := readHeader(tc.spoil(fresh()))
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: err %v, want %v", tc.name, err, tc.want)
		}
	}
}

// Whatever bytes a peer puts in the header, readHeader either refuses or
// yields rings whose whole data area lies inside the mapping.
func FuzzReadHeader(f *testing.F) {
	l, _ := computeLayout(Config{RxSlots: 4, TxSlots: 4, SlotSize: 128})
	m := make([]byte, l.size)
	writeHeader(m, l)
	f.Add(m[:headerLen])
	f.Fuzz(func(t *testing.T, hdr []byte) {
		mem := make([]byte, l.size)
		copy(mem, hdr)
		got, err := readHeader(mem)
		if err != nil {
			return
		}
		for _, d := range []ringDesc{got.rx, got.tx} {
			v := newRingView(mem, d) // panics if out of bounds
			if uint32(len(v.data)) != v.size || v.size != (v.depth+1)*(v.maxPayload+recHdr) {
				t.Fatalf("data area %d bytes, size %d, depth %d, max payload %d", len(v.data), v.size, v.depth, v.maxPayload)
			}
		}
	})
}

// One producer and one consumer goroutine over a ring: order kept,
// nothing lost, under the race detector.
func TestRingConcurrent(t *testing.T) {
	const total = 200000
	p, c, _ := newRingPair(64, 128)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		in := mkBufs(16, 64)
		pk := make([][]byte, 16)
		for seq := uint32(0); seq < total; {
			k := min(16, total-int(seq))
			for i := 0; i < k; i++ {
				pk[i] = seqPkt(in[i], seq+uint32(i), 8+int(seq+uint32(i))%56)
			}
			n, err := p.Produce(pk[:k])
			if err != nil {
				t.Error(err)
				return
			}
			seq += uint32(n)
		}
	}()
	out := mkBufs(32, 128)
	for want := uint32(0); want < total; {
		n, err := c.Consume(out)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < n; i++ {
			checkSeqPkt(t, out[i], want, 8+int(want)%56)
			want++
		}
	}
	wg.Wait()
}

// The per-packet paths allocate nothing.
func TestRingZeroAlloc(t *testing.T) {
	p, c, _ := newRingPair(256, 2048)
	pk := mkBufs(64, 64)
	out := mkBufs(64, 2048)
	allocs := testing.AllocsPerRun(200, func() {
		if n, _ := p.Produce(pk); n != 64 {
			t.Fatal("produce", n)
		}
		if n, _ := c.Consume(out); n != 64 {
			t.Fatal("consume", n)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per batch, want 0", allocs)
	}
}
