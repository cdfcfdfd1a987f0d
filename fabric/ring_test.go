package fabric

import (
	"encoding/binary"
	"errors"
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

// The ring keeps order across many wrap-arounds, holds exactly depth
// packets, and refuses (never overwrites) when full.
func TestRingOrderWrapAndFull(t *testing.T) {
	p, c, err := NewRingPair(8, 128)
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
		if q := next - want; q > 8 {
			t.Fatalf("ring holds %d > depth", q)
		}
		if k > 8 && n == k {
			t.Fatalf("produced %d into a ring of 8", n)
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
	// Fill completely: the 9th packet must be refused and the first 8 intact.
	for p.Free() > 0 {
		if n, _ := p.Produce([][]byte{seqPkt(in[0], next, 4+int(next)%100)}); n != 1 {
			t.Fatal("produce into non-full ring failed")
		}
		next++
	}
	if n, err := p.Produce([][]byte{in[1][:10]}); n != 0 || err != nil {
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
	p, c, err := NewRingPair(4, 64)
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
// into the shared words; the consumer must refuse, stay broken, and never
// read outside the slot array.
func TestRingHostileProducer(t *testing.T) {
	cases := []struct {
		name  string
		spoil func(v *ringView)
	}{
		{"write index beyond depth", func(v *ringView) { *v.prod = 10 }}, // read_i is 1, depth 8
		{"write index far ahead", func(v *ringView) { *v.prod = 0x80000000 }},
		{"write index backwards", func(v *ringView) { *v.prod = 1 }},
		{"slot length huge", func(v *ringView) { *u32at(v.slots, 2*uint64(v.stride)) = 0xffffffff }},
		{"slot length one too big", func(v *ringView) { *u32at(v.slots, 2*uint64(v.stride)) = v.maxPayload + 1 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, c, _ := NewRingPair(8, 128)
			pk := [][]byte{make([]byte, 5), make([]byte, 6), make([]byte, 7)}
			p.Produce(pk)
			out := mkBufs(8, 128)
			if n, err := c.Consume(out[:1]); n != 1 || err != nil {
				t.Fatal(n, err)
			}
			c.refresh() // the consumer has now seen write_i = 3
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

// A hostile consumer (the application, for the RX ring) moves read_i
// where it cannot be; the producer must refuse rather than overwrite.
func TestRingHostileConsumer(t *testing.T) {
	for _, bad := range []uint32{4, 0xffffffff, 0x40000000} {
		p, c, _ := NewRingPair(4, 64)
		pk := [][]byte{{1}, {2}, {3}}
		p.Produce(pk)
		*c.v.cons = bad // read_i ahead of write_i (3) or behind the last seen
		p.Produce(pk)   // needs a refresh: only 1 slot free by the lazy copy
		if !errors.Is(p.Err(), ErrCorruption) {
			t.Fatalf("read_i=%#x: producer err %v, want corruption", bad, p.Err())
		}
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
		{"version", func(m []byte) []byte { *u32at(m, offVersion) = 2; return m }, ErrVersion},
		{"short", func(m []byte) []byte { return m[:64] }, ErrBadLayout},
		{"length", func(m []byte) []byte { return m[:len(m)-4096] }, ErrBadLayout},
		{"header len", func(m []byte) []byte { *u32at(m, offHeaderLen) = 64; return m }, ErrBadLayout},
		{"count not pow2", func(m []byte) []byte { *u32at(m, offRxDesc+descCount) = 12; return m }, ErrBadLayout},
		{"count huge", func(m []byte) []byte { *u32at(m, offRxDesc+descCount) = 1 << 31; return m }, ErrBadLayout},
		{"stride odd", func(m []byte) []byte { *u32at(m, offTxDesc+descStride) = 100; return m }, ErrBadLayout},
		{"slots past end", func(m []byte) []byte { *u64at(m, offTxDesc+descSlots) = l.size - 64; return m }, ErrBadLayout},
		{"slots wrap", func(m []byte) []byte { *u64at(m, offTxDesc+descSlots) = 1<<64 - 64; return m }, ErrBadLayout},
		{"ctl misaligned", func(m []byte) []byte { *u64at(m, offRxDesc+descCtl) = 192; return m }, ErrBadLayout},
		{"ctl overlaps header", func(m []byte) []byte { *u64at(m, offRxDesc+descCtl) = 0; return m }, ErrBadLayout},
		{"rings overlap", func(m []byte) []byte { *u64at(m, offTxDesc+descSlots) = l.rx.slots; return m }, ErrBadLayout},
		{"ctl in slots", func(m []byte) []byte { *u64at(m, offTxDesc+descCtl) = l.rx.slots; return m }, ErrBadLayout},
	}
	for _, tc := range cases {
		_, err := readHeader(tc.spoil(fresh()))
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: err %v, want %v", tc.name, err, tc.want)
		}
	}
}

// Whatever bytes a peer puts in the header, readHeader either refuses or
// yields rings whose every slot lies inside the mapping.
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
			last := uint64(v.mask) * uint64(v.stride)
			_ = v.slots[last+uint64(v.stride)-1]
		}
	})
}

// One producer and one consumer goroutine over a ring: order kept,
// nothing lost, under the race detector.
func TestRingConcurrent(t *testing.T) {
	const total = 200000
	p, c, _ := NewRingPair(64, 128)
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
	p, c, _ := NewRingPair(256, 2048)
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
