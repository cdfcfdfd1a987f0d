package ingest

import (
	"net/netip"
	"testing"
	"time"
)

// flooder is the i-th source of a spoofed burst: one address, many ports.
func flooder(i int) Source {
	return SourceOf(netip.MustParseAddr("198.18.0.66"), uint16(10000+i), 9000)
}

// drain reads every published buffer into ref and releases it.
func drain(t *testing.T, c *Consumer, ref *Reference) {
	t.Helper()
	for {
		b, ok, err := c.Poll()
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return
		}
		if err := ref.Process(&b); err != nil {
			t.Fatal(err)
		}
		if err := c.Release(&b); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSourceFloodDoesNotLockOut: a burst of more new sources than the
// table holds (one datagram each, as `echo x >/dev/udp/BOX/PORT` from a
// shell loop sends) fills the table; once it has been idle for SourceIdle
// and its buffers are released, a legitimate sender gets an entry and every
// datagram through, and the burst's refusals and evictions are counted.
func TestSourceFloodDoesNotLockOut(t *testing.T) {
	const table, flood, idle = 8, 300, 10 * time.Millisecond
	r, c := newPair(t, Config{MaxSources: table, SourceIdle: idle, Window: time.Hour})
	t0 := Now()
	for i := range flood {
		r.Append(flooder(i), t0, []byte("x"))
	}
	r.Flush()
	if st := r.Stats(); st.Sources != table || st.SourceFull != flood-table || st.SourceEvicted != 0 {
		t.Fatalf("after the burst: %+v", st)
	}
	var ref Reference
	drain(t, c, &ref)

	after := t0 + uint64(2*idle)
	for i := range 100 {
		payload := make([]byte, 8)
		PutTriggerPayload(payload, uint32(i), []uint16{1, 2})
		if !r.Append(srcA, after+uint64(i), payload) {
			t.Fatalf("datagram %d of the legitimate sender after the burst was dropped: %+v", i, r.Stats())
		}
	}
	r.Flush()
	drain(t, c, &ref)
	st := r.Stats()
	if st.SourceEvicted != 1 || st.Sources != table || st.SourceFull != flood-table {
		t.Errorf("stats %+v, want one eviction", st)
	}
	var got *SourceCounts
	for i := range ref.Sources {
		if s := &ref.Sources[i]; s.Reassigned == 1 {
			got = s
		}
	}
	if got == nil {
		t.Fatalf("no source entry was reassigned: %+v", ref.Sources)
	}
	if got.Records != 101 || got.DroppedHere != 0 || got.SenderGaps != 0 || got.FirstSeq != 0 || got.LastSeq != 99 {
		t.Errorf("the legitimate sender's entry: %+v", *got)
	}
}

// TestSourceEvictionRules: an entry is taken over only from a source idle
// for SourceIdle whose records the consumer has released; a source that
// keeps sending through a burst keeps its entry; an evicted source that
// comes back starts a new sequence under a new generation.
func TestSourceEvictionRules(t *testing.T) {
	const idle = uint64(10 * time.Millisecond)
	r, c := newPair(t, Config{MaxSources: 2, SourceIdle: time.Duration(idle), Window: time.Hour})
	t0 := Now()
	r.Append(srcA, t0, []byte("a0"))
	r.Append(srcB, t0, []byte("b0"))
	r.Append(srcA, t0+idle, []byte("a1"))
	r.Flush()

	// srcB is idle long enough, but its record is in a buffer the consumer
	// has not read: its entry stays.
	if r.Append(srcC, t0+idle+1, []byte("c")) {
		t.Fatal("srcB's entry was taken while a buffer naming it was unreleased")
	}
	var ref Reference
	drain(t, c, &ref)
	// srcA sent recently: srcB, the least recently seen, is evicted.
	if !r.Append(srcC, t0+idle+2, []byte("c0")) {
		t.Fatalf("srcC refused: %+v", r.Stats())
	}
	// Neither is idle now: a further source is refused.
	if r.Append(srcB, t0+idle+3, []byte("b1")) {
		t.Fatal("srcB evicted an entry in use")
	}
	r.Append(srcA, t0+2*idle+2, []byte("a2"))
	r.Flush()
	drain(t, c, &ref)
	// srcC is idle now; srcB comes back in its entry as a new source.
	if !r.Append(srcB, t0+3*idle+3, []byte("b2")) {
		t.Fatalf("srcB refused on its return: %+v", r.Stats())
	}
	r.Flush()
	b, err := c.Next(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	it := b.Iter()
	if !it.Next() {
		t.Fatal(it.Err())
	}
	rec := it.Record()
	if src, _ := c.Source(rec.Source); src != srcB || rec.Seq != 0 || rec.SourceGen != 2 {
		t.Errorf("returning srcB: entry %d holds %v, seq %d, generation %d; want srcB, 0, 2", rec.Source, src, rec.Seq, rec.SourceGen)
	}
	if st := r.Stats(); st.SourceEvicted != 2 || st.SourceFull != 2 {
		t.Errorf("stats %+v", st)
	}
}

// TestSourceIdleNegativeNeverEvicts: SourceIdle < 0 keeps the first
// MaxSources sources for good.
func TestSourceIdleNegativeNeverEvicts(t *testing.T) {
	r, c := newPair(t, Config{MaxSources: 1, SourceIdle: -1, Window: time.Hour})
	r.Append(srcA, 1, []byte("a"))
	r.Flush()
	drain(t, c, &Reference{})
	if r.Append(srcB, 1+uint64(time.Hour), []byte("b")) {
		t.Fatal("an entry was evicted with SourceIdle < 0")
	}
}
