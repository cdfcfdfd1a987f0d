package ingest

import (
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestFirstPassCostsNoMore: the first pass over a new ring's buffers
// costs about what a later pass does. Before Create wrote every page once
// it cost 13–20 times as much on this project's VM (the hypervisor backing
// each page at its first write, on the data path). The best of three rings
// must stay under 3 times, so one pass slowed by a loaded machine does not
// fail the test; where first writes cost nothing extra it passes anyway.
func TestFirstPassCostsNoMore(t *testing.T) {
	const buffers, size, payload = 128, 256 << 10, 64
	perBuffer := size / (RecordHeader + payload)
	p := make([]byte, payload)
	pass := func(r *Ring) time.Duration {
		start := time.Now()
		for k := range buffers {
			for range perBuffer {
				r.Append(Source{SrcPort: 1}, uint64(k), p)
			}
			r.Flush()
			storeU32(r.mem, r.l.desc(k)+dState, stateFree) // released, as a consumer would
		}
		return time.Since(start)
	}
	best := 1e9
	for i := range 3 {
		r, err := Create(Config{Name: filepath.Join(t.TempDir(), "r"+strconv.Itoa(i)+".sock"), Buffers: buffers, BufferSize: size, Window: time.Hour, BufferID: 1})
		if err != nil {
			t.Fatal(err)
		}
		first := pass(r)
		second := pass(r)
		if st := r.Stats(); st.Dropped() != 0 || st.Published != 2*buffers {
			t.Fatalf("ring %+v", st)
		}
		r.Close()
		ratio := float64(first) / float64(second)
		t.Logf("ring %d: first pass %v, second %v (%.1f×)", i, first, second, ratio)
		best = min(best, ratio)
	}
	if best > 3 {
		t.Errorf("the first pass over a ring costs %.1f times a later one", best)
	}
}
