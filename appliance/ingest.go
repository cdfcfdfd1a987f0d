package appliance

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// ingestPlane is the UDP offload path: one persistent buffer ring per
// configured ingest entry, and the bridge's offload engine that fills them.
type ingestPlane struct {
	offload *bridge.Offload
	rings   []*ingestRing
}

type ingestRing struct {
	name   string // as configured
	id     uint32
	ring   *ingest.Ring
	budget time.Duration // ingest[].latency_budget
}

// IngestPath is where consumers open the named ring of a configuration: a
// socket in the ingest directory beside the control socket (by default
// /run/fabricbridge/ingest, fabric/ingest's DefaultDir).
func IngestPath(cfg *config.Config, name string) string {
	return filepath.Join(filepath.Dir(cfg.Control.Socket), "ingest", name)
}

// openIngest creates the rings and starts the engine; nothing when the
// configuration has no ingest entries. It runs on a thread in the
// interface's namespace, after the bridge.
func openIngest(cfg *config.Config, b *bridge.Bridge, log *slog.Logger) (_ *ingestPlane, err error) {
	if len(cfg.Ingest) == 0 {
		return nil, nil
	}
	p := &ingestPlane{}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	for i, g := range cfg.Ingest {
		path := IngestPath(cfg, g.Name)
		if removed, err := removeStaleSocket(path); err != nil {
			return nil, cfg.Errorf(fmt.Sprintf("ingest[%d].name", i), "%v", err)
		} else if removed {
			log.Warn("removed a stale ingest socket left by a crashed daemon", "path", path)
		}
		r, err := ingest.Create(ingest.Config{
			Name: path, Buffers: g.Buffers, BufferSize: int(g.BufferSize), Window: time.Duration(g.Window),
			BufferID: cfg.IngestID(g.Name), NoHugepages: !g.Hugepages,
			MaxSources: g.Sources, SourceIdle: time.Duration(g.SourceIdle),
		})
		if err != nil {
			return nil, cfg.Errorf(fmt.Sprintf("ingest[%d]", i), "%v", err)
		}
		p.rings = append(p.rings, &ingestRing{name: g.Name, id: cfg.IngestID(g.Name), ring: r, budget: time.Duration(g.LatencyBudget)})
		st := r.Stats()
		log.Info("ingest ring", "name", g.Name, "buffer_id", cfg.IngestID(g.Name), "socket", path,
			"bytes", r.Size(), "hugetlb", st.Hugetlb, "locked", st.Locked, "lock_error", r.LockError())
	}
	rings := make(map[uint32]*ingest.Ring, len(p.rings))
	for _, r := range p.rings {
		rings[r.id] = r.ring
	}
	in := cfg.Interfaces[0]
	p.offload, err = b.StartOffload(bridge.OffloadConfig{BusyPoll: time.Duration(in.BusyPoll), Priority: in.IngestPriority}, rings)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Close stops the engine, then flushes and closes the rings. It must run
// before the bridge closes (see bridge.Bridge.StartOffload).
func (p *ingestPlane) Close() error {
	if p == nil {
		return nil
	}
	var errs []error
	if p.offload != nil {
		errs = append(errs, p.offload.Close())
	}
	for _, r := range p.rings {
		errs = append(errs, r.ring.Close())
	}
	return errors.Join(errs...)
}

var (
	famIngestRecords       = metrics.Family{Name: "fabricbridge_ingest_records_total", Type: metrics.Counter, Help: "Datagrams written into each ingest ring."}
	famIngestBytes         = metrics.Family{Name: "fabricbridge_ingest_bytes_total", Type: metrics.Counter, Help: "Payload bytes written into each ingest ring."}
	famIngestPublished     = metrics.Family{Name: "fabricbridge_ingest_buffers_published_total", Type: metrics.Counter, Help: "Buffers each ingest ring published to its consumer."}
	famIngestDrops         = metrics.Family{Name: "fabricbridge_ingest_drops_total", Type: metrics.Counter, Help: "Datagrams an ingest ring dropped, by reason (no_buffer: the consumer holds every buffer; too_big; source_full: no source-table entry was free or idle)."}
	famIngestSources       = metrics.Family{Name: "fabricbridge_ingest_sources", Type: metrics.Gauge, Help: "Entries of an ingest ring's source table in use."}
	famIngestEvicted       = metrics.Family{Name: "fabricbridge_ingest_source_evictions_total", Type: metrics.Counter, Help: "Source-table entries an ingest ring gave to a new source because their source had gone idle."}
	famIngestConsumer      = metrics.Family{Name: "fabricbridge_ingest_consumer_attached", Type: metrics.Gauge, Help: "1 when a consumer is attached to the ingest ring."}
	famIngestWireToPublish = metrics.Family{Name: "fabricbridge_ingest_wire_to_publish_seconds", Type: metrics.Histogram,
		Help: "Per buffer of an ingest ring, from its earliest datagram's receive timestamp to its publication to the consumer (the window wait included)."}
	famIngestPublishToRelease = metrics.Family{Name: "fabricbridge_ingest_publish_to_release_seconds", Type: metrics.Histogram,
		Help: "Per buffer of an ingest ring, from its publication until the daemon saw the consumer release it (seen at the daemon's next check, so late by up to the ring's window or a tick)."}
	famIngestBudget = metrics.Family{Name: "fabricbridge_ingest_latency_budget_seconds", Type: metrics.Gauge,
		Help: "An ingest ring's configured wire-to-consumer latency budget (ingest[].latency_budget)."}
	famEngine          = metrics.Family{Name: "fabricbridge_ingest_engine_frames_total", Type: metrics.Counter, Help: "Frames the ingest engine handled, by outcome (received, appended, dropped, no_ring, malformed, refused: judged malformed on the AF_PACKET path, kernel_drop)."}
	famEngineFillEmpty = metrics.Family{Name: "fabricbridge_ingest_engine_fill_ring_empty_total", Type: metrics.Counter, Help: "Times the kernel found an ingest socket's fill ring empty."}
)

func (p *ingestPlane) Collect(w *metrics.Writer) {
	if p == nil {
		return
	}
	for _, r := range p.rings {
		st := r.ring.Stats()
		l := metrics.L("ring", r.name, "buffer_id", fmt.Sprint(r.id))
		w.AddUint(famIngestRecords, st.Records, l...)
		w.AddUint(famIngestBytes, st.Bytes, l...)
		w.AddUint(famIngestPublished, st.Published, l...)
		for _, d := range []struct {
			reason string
			n      uint64
		}{{"no_buffer", st.NoBuffer}, {"too_big", st.TooBig}, {"source_full", st.SourceFull}} {
			w.AddUint(famIngestDrops, d.n, append(l, metrics.Label{Name: "reason", Value: d.reason})...)
		}
		w.Add(famIngestSources, float64(st.Sources), l...)
		w.AddUint(famIngestEvicted, st.SourceEvicted, l...)
		att := 0.0
		if st.Attached {
			att = 1
		}
		w.Add(famIngestConsumer, att, l...)
		w.Add(famIngestBudget, r.budget.Seconds(), l...)
		addLatency(w, famIngestWireToPublish, st.WireToPublish, l)
		addLatency(w, famIngestPublishToRelease, st.PublishToRelease, l)
	}
	es := p.offload.Stats()
	for _, o := range []struct {
		outcome string
		n       uint64
	}{{"received", es.Received}, {"appended", es.Appended}, {"dropped", es.Dropped}, {"no_ring", es.NoRing}, {"malformed", es.Malformed}, {"refused", es.Refused}, {"kernel_drop", es.KernelDrops}} {
		w.AddUint(famEngine, o.n, metrics.L("outcome", o.outcome)...)
	}
	w.AddUint(famEngineFillEmpty, es.FillRingEmpty)
}

// addLatency writes a latency histogram in seconds, its buckets merged to
// one per power of two: enough to compare with a budget, and a quarter of
// the series.
func addLatency(w *metrics.Writer, f metrics.Family, h ingest.HistogramSnapshot, labels []metrics.Label) {
	var bounds []float64
	var counts []uint64
	for i, c := range h.Counts {
		if len(counts) == 0 || i > 0 && h.Upper[i-1]&(h.Upper[i-1]-1) == 0 {
			counts = append(counts, 0) // the bucket after a power of two opens a new one
		}
		counts[len(counts)-1] += c
		if u := h.Upper[i]; u != 0 && u&(u-1) == 0 {
			bounds = append(bounds, float64(u)/1e9)
		}
	}
	w.AddHistogram(f, bounds, counts, float64(h.SumNs)/1e9, labels...)
}
