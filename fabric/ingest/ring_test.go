package ingest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"
	"time"
)

func testConfig(t testing.TB, c Config) Config {
	if c.Name == "" {
		c.Name = filepath.Join(t.TempDir(), "ring.sock")
	}
	if c.BufferSize == 0 {
		c.BufferSize = 4096
	}
	if c.Buffers == 0 {
		c.Buffers = 4
	}
	return c
}

func newPair(t testing.TB, c Config) (*Ring, *Consumer) {
	t.Helper()
	r, err := Create(testConfig(t, c))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	cons, err := Open(r.Name(), ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cons.Close() })
	waitAttached(t, r)
	return r, cons
}

func waitAttached(t testing.TB, r *Ring) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !r.Stats().Attached {
		if time.Now().After(deadline) {
			t.Fatal("the consumer never showed as attached")
		}
		time.Sleep(time.Millisecond)
	}
}

var (
	srcA = SourceOf(netip.MustParseAddr("198.18.0.2"), 5001, 9000)
	srcB = SourceOf(netip.MustParseAddr("198.18.0.3"), 5002, 9001)
	srcC = SourceOf(netip.MustParseAddr("2001:db8::7"), 5003, 9000)
)

func payloadOf(src, i int, n int) []byte {
	p := make([]byte, n)
	for j := range p {
		p[j] = byte(src*31 + i*7 + j)
	}
	return p
}

// TestRoundTrip: records from three sources come out complete, byte-exact,
// in order per source, with the source table and descriptor right.
func TestRoundTrip(t *testing.T) {
	r, c := newPair(t, Config{Window: time.Hour})
	srcs := []Source{srcA, srcB, srcC}
	type rec struct {
		src     int
		payload []byte
		rx      uint64
	}
	var sent []rec
	base := Now()
	for i := range 30 {
		s := i % 3
		p := payloadOf(s, i, 1+i*5)
		rx := base + uint64(i)
		if !r.Append(srcs[s], rx, p) {
			t.Fatalf("record %d dropped", i)
		}
		sent = append(sent, rec{s, p, rx})
	}
	r.Flush()
	b, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if b.Records != 30 || b.Seq != 0 || b.Index != 0 || b.Flags != BufFlushed || b.FirstNs != base || b.LastNs != base+29 {
		t.Fatalf("buffer %+v", b)
	}
	it := b.Iter()
	perSource := map[uint16]uint32{}
	i := 0
	for it.Next() {
		got := it.Record()
		want := sent[i]
		s, ok := c.Source(got.Source)
		if !ok || s != srcs[want.src] {
			t.Fatalf("record %d: source %d is %v, want %v", i, got.Source, s, srcs[want.src])
		}
		if got.Seq != perSource[got.Source] {
			t.Fatalf("record %d: source sequence %d, want %d", i, got.Seq, perSource[got.Source])
		}
		perSource[got.Source]++
		if got.RxNs != want.rx || !bytes.Equal(got.Payload, want.payload) {
			t.Fatalf("record %d: rx %d payload % x, want rx %d payload % x", i, got.RxNs, got.Payload, want.rx, want.payload)
		}
		i++
	}
	if it.Err() != nil || i != 30 {
		t.Fatalf("walked %d records: %v", i, it.Err())
	}
	if c.Sources() != 3 {
		t.Errorf("%d sources", c.Sources())
	}
	if err := c.Release(&b); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(&b); !errors.Is(err, ErrReleased) {
		t.Errorf("second release: %v", err)
	}
	st := r.Stats()
	if st.Records != 30 || st.Published != 1 || st.Dropped() != 0 || st.Sources != 3 || !st.Attached {
		t.Errorf("stats %+v", st)
	}
}

// TestWindowAndFull: a buffer is published when its window closes (Tick)
// or when the next record does not fit.
func TestWindowAndFull(t *testing.T) {
	const window = 200 * time.Microsecond
	r, c := newPair(t, Config{Window: window})
	now := Now()
	r.Append(srcA, now, []byte("x"))
	r.Tick(now + uint64(window) - 1)
	if _, ok, _ := c.Poll(); ok {
		t.Fatal("published before its window closed")
	}
	if d, ok := r.Deadline(); !ok || d != now+uint64(window) {
		t.Fatalf("deadline %d %v", d, ok)
	}
	r.Tick(now + uint64(window))
	b, ok, err := c.Poll()
	if !ok || err != nil || b.Flags != BufWindow || b.Records != 1 {
		t.Fatalf("after the window: %+v %v %v", b, ok, err)
	}
	c.Release(&b)

	// A record whose RX time is past the window closes it too.
	r.Append(srcA, now+1000, []byte("a"))
	r.Append(srcA, now+1000+uint64(window), []byte("b"))
	b, ok, _ = c.Poll()
	if !ok || b.Flags != BufWindow || b.Records != 1 {
		t.Fatalf("closed by a late record: %+v %v", b, ok)
	}
	c.Release(&b)
	r.Flush()
	b, _, _ = c.Poll()
	c.Release(&b)

	// 4096-byte buffers hold 4 records of 1000-byte payloads (1024 each).
	big := make([]byte, 1000)
	for i := range 5 {
		r.Append(srcB, now+uint64(2*window)+uint64(i), big)
	}
	b, ok, _ = c.Poll()
	if !ok || b.Flags != BufFull || b.Records != 4 || b.Bytes != 4096 {
		t.Fatalf("full buffer: %+v %v", b, ok)
	}
	c.Release(&b)
}

// TestNoReuseOfHeldBuffers: with every buffer held, records are dropped
// and counted, the held buffers stay byte-for-byte as published, and once
// released the producer resumes; the per-source sequence shows the drops.
func TestNoReuseOfHeldBuffers(t *testing.T) {
	r, c := newPair(t, Config{Buffers: 2, Window: time.Hour})
	payload := make([]byte, 1000)
	now := Now()
	n := 0
	appendOne := func() bool {
		binary.BigEndian.PutUint32(payload, uint32(n))
		n++
		return r.Append(srcA, now+uint64(n), payload)
	}
	// 8 records fill both buffers; the 9th finds the first one held.
	for range 8 {
		if !appendOne() {
			t.Fatal("dropped while buffers were free")
		}
	}
	b0, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	snapshot := bytes.Clone(b0.Data())
	for range 20 {
		if appendOne() {
			t.Fatal("stored a record with no free buffer")
		}
	}
	r.Tick(Now())
	if st := r.Stats(); st.NoBuffer != 20 || st.Records != 8 {
		t.Fatalf("stats %+v", st)
	}
	b1, ok, err := c.Poll()
	if !ok || err != nil {
		t.Fatalf("second buffer: %v %v", ok, err)
	}
	if !bytes.Equal(b0.Data(), snapshot) {
		t.Fatal("a held buffer changed")
	}
	var ref Reference
	for _, b := range []*Buffer{&b0, &b1} {
		if err := ref.Process(b); err != nil {
			t.Fatal(err)
		}
		if err := c.Release(b); err != nil {
			t.Fatal(err)
		}
	}
	if !appendOne() {
		t.Fatal("still dropping after release")
	}
	r.Flush()
	b2, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := ref.Process(&b2); err != nil {
		t.Fatal(err)
	}
	s := ref.Sources[0]
	if s.Records != 9 || s.DroppedHere != 20 || s.SenderGaps != 20 {
		t.Errorf("reference: %+v; gaps %v", s, ref.Gaps)
	}
	if len(ref.Gaps) != 2 || ref.Gaps[0] != (Gap{Source: 0, Sender: false, Want: 8, Got: 28}) {
		t.Errorf("gaps %v", ref.Gaps)
	}
}

// TestAlignedWindows: windows fall on multiples of the window on the RX
// clock; a window too big for one buffer continues in the next, and the
// reference sums each whole window.
func TestAlignedWindows(t *testing.T) {
	const w = uint64(100_000)
	r, c := newPair(t, Config{Buffers: 8, Window: time.Duration(w), AlignWindows: true})
	base := (Now()/w + 10) * w
	var p [4 + 2*400]byte
	energies := make([]uint16, 400)
	want := map[uint64]uint64{} // window start -> energy
	seq := uint32(0)
	put := func(rx uint64, e uint16) {
		for i := range energies {
			energies[i] = e
		}
		n := PutTriggerPayload(p[:], seq, energies)
		seq++
		if !r.Append(srcA, rx, p[:n]) {
			t.Fatal("dropped")
		}
		want[rx-rx%w] += uint64(e) * 400
	}
	put(base+10, 1)
	put(base+20, 2)
	// 6 records of 832 bytes do not fit 4096: the window continues.
	for i := range 6 {
		put(base+w+uint64(i), 3)
	}
	put(base+3*w+5, 4)
	r.Tick(base + 4*w)
	ref := Reference{KeepEnergies: true, Threshold: 7000}
	var starts []uint64
	var flags []uint32
	for {
		b, ok, err := c.Poll()
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		if b.WindowNs%w != 0 {
			t.Errorf("window start %d not aligned", b.WindowNs)
		}
		starts = append(starts, b.WindowNs)
		flags = append(flags, b.Flags)
		if err := ref.Process(&b); err != nil {
			t.Fatal(err)
		}
		c.Release(&b)
	}
	wantStarts := []uint64{base, base + w, base + w, base + 3*w}
	wantFlags := []uint32{BufWindow, BufFull | BufContinued, BufWindow, BufWindow}
	if fmt.Sprint(starts) != fmt.Sprint(wantStarts) || fmt.Sprint(flags) != fmt.Sprint(wantFlags) {
		t.Fatalf("windows %v flags %v, want %v %v", starts, flags, wantStarts, wantFlags)
	}
	wantE := []uint64{want[base], want[base+w], want[base+3*w]}
	if fmt.Sprint(ref.Energies) != fmt.Sprint(wantE) || ref.Windows != 3 || ref.Triggers != 1 {
		t.Errorf("energies %v (windows %d, triggers %d), want %v, 3 windows, 1 trigger", ref.Energies, ref.Windows, ref.Triggers, wantE)
	}
}

// TestSenderGaps: a sender that skips sequence numbers is reported, apart
// from drops at this box.
func TestSenderGaps(t *testing.T) {
	r, c := newPair(t, Config{Window: time.Hour})
	var p [4]byte
	now := Now()
	for _, s := range []uint32{100, 101, 102, 105, 106, 110, 109} {
		PutTriggerPayload(p[:], s, nil)
		r.Append(srcB, now, p[:])
	}
	r.Flush()
	b, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var ref Reference
	if err := ref.Process(&b); err != nil {
		t.Fatal(err)
	}
	s := ref.Sources[0]
	if s.SenderGaps != 2+3 || s.SenderBackwards != 1 || s.DroppedHere != 0 || s.FirstSeq != 100 || s.LastSeq != 109 {
		t.Errorf("%+v", s)
	}
	if len(ref.Gaps) != 2 || ref.Gaps[0] != (Gap{Source: 0, Sender: true, Want: 103, Got: 105}) || ref.Gaps[1] != (Gap{Source: 0, Sender: true, Want: 107, Got: 110}) {
		t.Errorf("gaps %v", ref.Gaps)
	}
}

// TestDropsCounted: too-big datagrams and a full source table are dropped
// and counted, and the source sequence still advances for too-big ones.
func TestDropsCounted(t *testing.T) {
	r, c := newPair(t, Config{MaxSources: 2, Window: time.Hour})
	now := Now()
	r.Append(srcA, now, []byte("1"))
	r.Append(srcA, now, make([]byte, 4096)) // 4096+24 > 4096
	r.Append(srcA, now, []byte("3"))
	r.Append(srcB, now, []byte("4"))
	r.Append(srcC, now, []byte("5")) // third source
	r.Flush()
	st := r.Stats()
	if st.TooBig != 1 || st.SourceFull != 1 || st.Records != 3 || st.Sources != 2 {
		t.Fatalf("stats %+v", st)
	}
	b, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var ref Reference
	if err := ref.Process(&b); err != nil {
		t.Fatal(err)
	}
	if ref.Sources[0].DroppedHere != 1 || ref.Sources[0].Records != 2 || ref.Sources[0].Short != 2 {
		t.Errorf("%+v", ref.Sources[0])
	}
}

// TestLatencyAccounting: latency runs from the first RX timestamp to the
// wake-up, lands in the histogram, and over-budget buffers are counted.
func TestLatencyAccounting(t *testing.T) {
	r, err := Create(testConfig(t, Config{Window: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	// The budget sits far from both ages, so that a loaded machine's
	// scheduling delay cannot move a buffer across it.
	c, err := Open(r.Name(), ConsumerOptions{Budget: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, age := range []time.Duration{2 * time.Second, 50 * time.Microsecond} {
		r.Append(srcA, Now()-uint64(age), []byte("x"))
		r.Flush()
		b, err := c.Next(time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if l := b.Latency(); l < age || l > age+100*time.Millisecond {
			t.Errorf("latency %v for a record %v old", l, age)
		}
		c.Release(&b)
	}
	st := c.Stats()
	if st.Violations != 1 || st.Buffers != 2 || st.Latency.Count != 2 || st.Released != 2 {
		t.Errorf("stats %+v", st)
	}
	if q := st.Latency.Quantile(1); q < uint64(2*time.Second) {
		t.Errorf("max latency bucket %d under 2s", q)
	}
}

// TestSleepAndWake: a consumer that sleeps is woken by a publish from
// another goroutine, and a closed producer ends it after the last buffer.
func TestSleepAndWake(t *testing.T) {
	r, err := Create(testConfig(t, Config{Window: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(r.Name(), ConsumerOptions{Spin: time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 3 {
			time.Sleep(20 * time.Millisecond)
			r.Append(srcA, Now(), []byte{byte(i)})
			r.Flush()
		}
		r.Append(srcA, Now(), []byte{3})
		r.Close() // flushes the last one
	}()
	got := 0
	for {
		b, err := c.Next(5 * time.Second)
		if errors.Is(err, ErrClosed) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		it := b.Iter()
		for it.Next() {
			if it.Record().Payload[0] != byte(got) {
				t.Errorf("record %d carries %d", got, it.Record().Payload[0])
			}
			got++
		}
		c.Release(&b)
	}
	<-done
	if got != 4 {
		t.Errorf("got %d records, want 4", got)
	}
	if c.Stats().Sleeps == 0 {
		t.Error("the consumer never slept")
	}
}

// TestOneConsumerAndReattach: a second consumer is refused while one is
// attached; after it leaves holding buffers, a new consumer releases those
// as stale and carries on from the producer's next buffer.
func TestOneConsumerAndReattach(t *testing.T) {
	r, c := newPair(t, Config{Buffers: 4, Window: time.Hour})
	if _, err := Open(r.Name(), ConsumerOptions{}); !errors.Is(err, ErrBusy) {
		t.Fatalf("second consumer: %v", err)
	}
	for i := range 3 {
		r.Append(srcA, Now(), []byte{byte(i)})
		r.Flush()
	}
	if _, err := c.Next(time.Second); err != nil { // held, never released
		t.Fatal(err)
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for r.Stats().Attached {
		if time.Now().After(deadline) {
			t.Fatal("the producer never saw the consumer go")
		}
		time.Sleep(time.Millisecond)
	}
	c2, err := Open(r.Name(), ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if st := c2.Stats(); st.Stale != 3 {
		t.Errorf("%d stale buffers, want 3", st.Stale)
	}
	for i := range 6 { // wraps the ring: every buffer must be free again
		if !r.Append(srcA, Now(), []byte{byte(10 + i)}) {
			t.Fatalf("record %d dropped after reattach", i)
		}
		r.Flush()
		b, err := c2.Next(time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if b.Seq != uint64(3+i) {
			t.Errorf("sequence %d, want %d", b.Seq, 3+i)
		}
		c2.Release(&b)
	}
}

// TestAppendNoAllocations: the producer's hot path allocates nothing, and
// neither does taking, walking and releasing a buffer.
func TestAppendNoAllocations(t *testing.T) {
	r, c := newPair(t, Config{Buffers: 4, BufferSize: 1 << 16, Window: time.Hour})
	payload := make([]byte, 200)
	srcs := []Source{srcA, srcB, srcC}
	i := 0
	allocs := testing.AllocsPerRun(1000, func() {
		r.Append(srcs[i%3], Now(), payload)
		i++
		r.Tick(Now())
	})
	if allocs != 0 {
		t.Errorf("Append+Tick: %v allocations", allocs)
	}
	r.Flush()
	for {
		b, ok, _ := c.Poll()
		if !ok {
			break
		}
		c.Release(&b)
	}
	allocs = testing.AllocsPerRun(100, func() {
		for range 10 {
			r.Append(srcs[i%3], Now(), payload)
		}
		r.Flush()
		b, err := c.Next(time.Second)
		if err != nil {
			panic(err)
		}
		it := b.Iter()
		for it.Next() {
			_ = it.Record()
		}
		c.Release(&b)
	})
	if allocs != 0 {
		t.Errorf("publish, take, walk, release: %v allocations", allocs)
	}
}

func TestBadConfigAndNames(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []Config{
		{Name: "bad name"},
		{Name: ".."},
		{Name: filepath.Join(dir, "a.sock"), Buffers: 1},
		{Name: filepath.Join(dir, "a.sock"), BufferSize: 5000},
		{Name: filepath.Join(dir, "a.sock"), Window: time.Nanosecond},
		{Name: filepath.Join(dir, "a.sock"), MaxSources: 70000},
	} {
		if _, err := Create(c); !errors.Is(err, ErrBadConfig) {
			t.Errorf("%+v: %v", c, err)
		}
	}
	if _, err := Open("no such ring", ConsumerOptions{}); !errors.Is(err, ErrBadConfig) {
		t.Errorf("bad name: %v", err)
	}
	if _, err := Open(filepath.Join(dir, "missing.sock"), ConsumerOptions{}); err == nil {
		t.Error("opened a ring nobody serves")
	}
	r, _ := newPair(t, Config{})
	if _, err := Create(Config{Name: r.Name(), BufferSize: 4096}); err == nil {
		t.Error("two producers on one name")
	}
	// A plain name lives in Dir().
	t.Setenv("FB_INGEST_DIR", dir)
	r2, err := Create(Config{Name: "trigger-10", BufferSize: 4096, Buffers: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	c2, err := Open("trigger-10", ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c2.Close()
}

func TestHistogram(t *testing.T) {
	var h Histogram
	for i := range 1000 {
		h.Observe(uint64(i+1) * 1000) // 1 µs .. 1 ms
	}
	h.Observe(1 << 40)
	s := h.Snapshot()
	if s.Count != 1001 {
		t.Fatalf("count %d", s.Count)
	}
	for _, q := range []struct {
		q    float64
		want uint64
	}{{0.5, 500_000}, {0.99, 990_000}} {
		got := s.Quantile(q.q)
		if got < q.want || float64(got) > float64(q.want)*1.26 {
			t.Errorf("quantile %v = %d, want within 25%% above %d", q.q, got, q.want)
		}
	}
	for i := 1; i < histBuckets-1; i++ {
		if histUpper(i) <= histUpper(i-1) {
			t.Fatalf("bounds not increasing at %d", i)
		}
		lo := histUpper(i - 1)
		if histIndex(lo) != i || histIndex(histUpper(i)-1) != i {
			t.Fatalf("bucket %d [%d,%d) misplaces its ends", i, lo, histUpper(i))
		}
	}
}

// TestInterleavedQueues: two receive queues' batches interleave, so a
// buffer's records are not in RX time order; the descriptor spans the
// earliest to the latest and the consumer accepts it (it once rejected
// last_ns < first_ns as corruption).
func TestInterleavedQueues(t *testing.T) {
	r, c := newPair(t, Config{Window: time.Hour})
	base := Now()
	// Queue 1 stamped its batch first, but queue 0's was appended first.
	stamps := []uint64{base + 500, base + 600, base + 100, base + 200, base + 700}
	for i, ns := range stamps {
		src := srcA
		if ns < base+500 {
			src = srcB
		}
		if !r.Append(src, ns, payloadOf(0, i, 8)) {
			t.Fatal("append refused")
		}
	}
	r.Flush()
	b, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if b.FirstNs != base+100 || b.LastNs != base+700 || b.Records != len(stamps) {
		t.Fatalf("buffer spans %d..%d with %d records, want %d..%d with %d",
			b.FirstNs-base, b.LastNs-base, b.Records, 100, 700, len(stamps))
	}
	it := b.Iter()
	for i := 0; it.Next(); i++ {
		if rec := it.Record(); rec.RxNs != stamps[i] || !bytes.Equal(rec.Payload, payloadOf(0, i, 8)) {
			t.Fatalf("record %d: %+v", i, rec)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(&b); err != nil {
		t.Fatal(err)
	}
}
