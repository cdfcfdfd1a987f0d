package ingest

import (
	"testing"
	"time"
)

// TestLatencyHistograms: every published buffer is timed from its earliest
// record to publication, and every released one from publication to
// release, whether the producer sees the release at a Tick or only when it
// reuses the buffer.
func TestLatencyHistograms(t *testing.T) {
	r, c := newPair(t, Config{Buffers: 4, BufferSize: 1 << 12, Window: time.Hour})
	const age = 5 * time.Millisecond
	publish := func(n int) {
		for range n {
			rx := Now() - uint64(age)
			r.Append(srcB, rx+1000, []byte{2})
			r.Append(srcA, rx, []byte{1}) // the earlier stamp counts
			r.Flush()
		}
	}
	take := func(n int) []Buffer {
		var bs []Buffer
		for range n {
			b, err := c.Next(time.Second)
			if err != nil {
				t.Fatal(err)
			}
			bs = append(bs, b)
		}
		return bs
	}
	check := func(when string, published, released uint64) {
		t.Helper()
		st := r.Stats()
		if st.WireToPublish.Count != published || st.PublishToRelease.Count != released {
			t.Errorf("%s: %d timed published and %d timed released, want %d and %d",
				when, st.WireToPublish.Count, st.PublishToRelease.Count, published, released)
		}
		if lo := st.WireToPublish.Quantile(0.01); published > 0 && lo < uint64(age) {
			t.Errorf("%s: wire-to-publish p1 %v, below the records' age %v", when, time.Duration(lo), age)
		}
	}

	publish(3)
	check("published 3", 3, 0)
	bs := take(3)
	time.Sleep(2 * time.Millisecond)
	c.Release(&bs[0])
	c.Release(&bs[1])
	r.Tick(Now())
	check("released 2, then a Tick", 3, 2)
	if st := r.Stats(); st.PublishToRelease.Quantile(0.01) < uint64(2*time.Millisecond) {
		t.Errorf("publish-to-release p1 %v, below the 2ms the consumer held the buffers", time.Duration(st.PublishToRelease.Quantile(0.01)))
	}
	r.Tick(Now())
	check("another Tick", 3, 2)

	// No Tick: the producer sees the third release when it wraps onto
	// that buffer.
	c.Release(&bs[2])
	publish(1) // slot 3, never used
	check("published a 4th", 4, 2)
	publish(3) // slots 0, 1, 2: reuses the third buffer
	check("wrapped", 7, 3)
	for _, b := range take(4) {
		c.Release(&b)
	}
	r.Tick(Now())
	check("released all", 7, 7)
}
