package appliance

import (
	"bytes"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// TestAddLatency: the ring's histogram is exported in seconds with one
// bucket per power of two, each latency in the bucket that holds it.
func TestAddLatency(t *testing.T) {
	var h ingest.Histogram
	for _, ns := range []uint64{100, 300, 600, 700, 1500, 1 << 40} {
		h.Observe(ns)
	}
	w := metrics.NewWriter()
	addLatency(w, famIngestWireToPublish, h.Snapshot(), metrics.L("ring", "r"))
	var out bytes.Buffer
	if _, err := w.WriteTo(&out); err != nil {
		t.Fatal(err)
	}
	s, err := metrics.Parse(&out)
	if err != nil {
		t.Fatal(err)
	}
	buckets := metrics.Find(s, "fabricbridge_ingest_wire_to_publish_seconds_bucket")
	if len(buckets) != 28 { // 256ns to 2^34ns, and +Inf
		t.Errorf("%d buckets", len(buckets))
	}
	for le, want := range map[string]float64{"2.56e-07": 1, "5.12e-07": 2, "1.024e-06": 4, "2.048e-06": 5, "4.096e-06": 5, "+Inf": 6} {
		if v := value(t, s, "fabricbridge_ingest_wire_to_publish_seconds_bucket", "ring", "r", "le", le); v != want {
			t.Errorf("bucket le=%s: %v, want %v", le, v, want)
		}
	}
	if v := value(t, s, "fabricbridge_ingest_wire_to_publish_seconds_count", "ring", "r"); v != 6 {
		t.Errorf("count %v", v)
	}
	if v := value(t, s, "fabricbridge_ingest_wire_to_publish_seconds_sum", "ring", "r"); v != float64(100+300+600+700+1500+1<<40)/1e9 {
		t.Errorf("sum %v", v)
	}
}
