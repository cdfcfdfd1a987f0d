package gpu

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// script is a synthetic producer: a deterministic stream of trigger
// datagrams from several sources, with every quirk the reference counts
// (datagrams dropped here, sender gaps, repeats, short payloads). Appended with back-pressure (wait for a free buffer
// rather than drop), the same script cuts the same buffers in any ring of
// the same configuration, whoever consumes it and however fast.
type script struct {
	records int
	sources int
	maxHits int    // energies per payload: 0..maxHits
	quirks  uint32 // one record in quirks/5 has a quirk; 0 none
	rxStep  uint64 // mean RX time between records, ns
}

func source(i int) ingest.Source {
	return ingest.SourceOf(netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}), uint16(20000+i), 4000)
}

// runLimit bounds a GPU consumer's Run in a test and a producer's wait for
// a free buffer: a kernel that stops making progress fails its own case
// (Run aborts it), and the cases after it still run.
const runLimit = time.Minute

// feed appends the script to r; with wait it never drops for want of a
// free buffer, unless it waited runLimit in all (the consumer is stuck:
// it stops short, and the consumer's Run says why).
func (s script) feed(r *ingest.Ring, bufferSize int, wait bool) {
	giveUp := time.Now().Add(runLimit)
	payload := make([]byte, ingest.TriggerSeqLen+2*s.maxHits)
	tooBig := make([]byte, bufferSize)
	energies := make([]uint16, s.maxHits)
	next := make([]uint32, s.sources)
	rx := uint64(1_000_000_000)
	x := uint32(2463534242)
	rnd := func() uint32 { x ^= x << 13; x ^= x >> 17; x ^= x << 5; return x }
	for range s.records {
		src := int(rnd() % uint32(s.sources))
		rx += uint64(rnd()) % (2*s.rxStep + 1)
		seq := next[src]
		next[src]++
		n := ingest.TriggerSeqLen
		if s.maxHits > 0 {
			hits := int(rnd() % uint32(s.maxHits+1))
			for i := range hits {
				energies[i] = uint16(rnd())
			}
			n = ingest.PutTriggerPayload(payload, seq, energies[:hits])
		} else {
			ingest.PutTriggerPayload(payload, seq, nil)
		}
		if s.quirks > 0 {
			switch q := rnd() % s.quirks; {
			case q == 0: // dropped here: the ring counts it in the source's sequence
				r.Append(source(src), rx, tooBig)
			case q == 1: // the sender skipped some
				next[src] += 3
			case q == 2: // a repeat
				next[src]--
			case q == 3: // too short for a sender sequence
				n = 2
			case q == 4: // odd length: the last byte is no hit
				n = min(n+1, len(payload))
			}
		}
		for wait && !r.Writable() {
			if time.Now().After(giveUp) {
				return
			}
			runtime.Gosched()
		}
		r.Append(source(src), rx, payload[:n])
	}
}

type ringCase struct {
	name      string
	cfg       ingest.Config
	s         script
	threshold uint64 // about the median window's energy
}

var ringCases = []ringCase{
	// Small buffers, aligned windows: windows close by time and continue
	// over full buffers; 12 sources.
	{"windows", ingest.Config{Buffers: 8, BufferSize: 8192, Window: 40 * time.Microsecond, AlignWindows: true, MaxSources: 16},
		script{records: 20000, sources: 12, maxHits: 12, quirks: 400, rxStep: 200}, 40_000_000},
	// Buffers larger than the fake's staging area and holding more than a
	// chunk of records: read in place, walked in several passes, and
	// released after their result.
	{"big", ingest.Config{Buffers: 4, BufferSize: 128 << 10, Window: time.Second, MaxSources: 300},
		script{records: 30000, sources: 300, maxHits: 1, quirks: 400, rxStep: 10}, 66_000_000},
	// A quirk in most records: more gaps in a buffer than the kernel keeps
	// aside before its turn, and sources whose first record in a buffer is
	// behind, both of which make it replay records in turn.
	{"dense", ingest.Config{Buffers: 8, BufferSize: 32 << 10, Window: time.Second, MaxSources: 4},
		script{records: 20000, sources: 4, maxHits: 1, quirks: 6, rxStep: 10}, 13_800_000},
}

// newRing creates a ring for c in a test directory and attaches a consumer.
func newRing(t testing.TB, cfg ingest.Config, opts ingest.ConsumerOptions) (*ingest.Ring, *ingest.Consumer) {
	t.Helper()
	cfg.Name = filepath.Join(t.TempDir(), "ring")
	cfg.NoHugepages = true
	r, err := ingest.Create(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	c, err := ingest.Open(cfg.Name, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return r, c
}

// referenceRun consumes the script with the CPU reference.
func referenceRun(t testing.TB, rc ringCase, threshold uint64) (*ingest.Reference, uint64) {
	t.Helper()
	r, c := newRing(t, rc.cfg, ingest.ConsumerOptions{})
	ref := &ingest.Reference{Threshold: threshold, KeepEnergies: true}
	done := make(chan error, 1)
	var buffers uint64
	go func() {
		for {
			b, err := c.Next(10 * time.Second)
			if errors.Is(err, ingest.ErrClosed) {
				done <- nil
				return
			}
			if err != nil {
				done <- err
				return
			}
			buffers++
			if err := ref.Process(&b); err != nil {
				done <- err
				return
			}
			c.Release(&b)
		}
	}()
	rc.s.feed(r, rc.cfg.BufferSize, true)
	r.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return ref, buffers
}

// gpuRun consumes the script with a GPU consumer on dev.
func gpuRun(t testing.TB, dev device, rc ringCase, opts Options) (*Results, Stats, []Result, *ingest.Consumer) {
	t.Helper()
	r, c := newRing(t, rc.cfg, ingest.ConsumerOptions{})
	opts.KeepEnergies = true
	var seen []Result
	opts.OnResult = func(res Result) { seen = append(seen, res) }
	g, done := startGPU(t, dev, c, opts)
	rc.s.feed(r, rc.cfg.BufferSize, true)
	r.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	res, err := g.Results()
	if err != nil {
		t.Fatal(err)
	}
	return res, g.Stats(), seen, c
}

// startGPU opens a GPU consumer on dev over c and starts Run, with a
// minute to finish; the test's cleanup releases it.
func startGPU(t testing.TB, dev device, c *ingest.Consumer, opts Options) (*Consumer, chan error) {
	t.Helper()
	g, ctx := openGPU(t, dev, c, opts)
	return g, runGPU(ctx, g)
}

// openGPU opens a GPU consumer over c, released when t ends, and the
// context its Run gets: runLimit.
func openGPU(t testing.TB, dev device, c *ingest.Consumer, opts Options) (*Consumer, context.Context) {
	t.Helper()
	g, err := open(dev, c, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), runLimit)
	t.Cleanup(func() {
		cancel()
		if err := g.release(); err != nil {
			t.Error(err)
		}
	})
	return g, ctx
}

// runGPU runs g in a goroutine; the channel gives Run's error.
func runGPU(ctx context.Context, g *Consumer) chan error {
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	return done
}

// sameAsReference fails t where the GPU's results differ from the
// reference's, field by field, window by window, gap by gap.
func sameAsReference(t testing.TB, ref *ingest.Reference, refBuffers uint64, got *Results) {
	t.Helper()
	var records uint64
	for _, s := range ref.Sources {
		records += s.Records
	}
	check := func(what string, want, have any) {
		t.Helper()
		if fmt.Sprint(want) != fmt.Sprint(have) {
			t.Errorf("%s: reference %v, GPU %v", what, want, have)
		}
	}
	check("buffers", refBuffers, got.Buffers)
	check("records", records, got.Records)
	check("windows", ref.Windows, got.Windows)
	check("triggers", ref.Triggers, got.Triggers)
	check("closed windows kept", len(ref.Energies), len(got.Energies))
	for i := range min(len(ref.Energies), len(got.Energies)) {
		if ref.Energies[i] != got.Energies[i] {
			t.Errorf("window %d: reference energy %d, GPU %d", i, ref.Energies[i], got.Energies[i])
			break
		}
	}
	check("source slots", len(ref.Sources), len(got.Sources))
	for i := range min(len(ref.Sources), len(got.Sources)) {
		check(fmt.Sprintf("source %d", i), publicCounts(ref.Sources[i]), publicCounts(got.Sources[i]))
	}
	check("gaps", ref.Gaps, got.Gaps)
	if t.Failed() {
		return
	}
	t.Logf("equal: %d buffers, %d records, %d windows (%d triggered), %d sources, %d gaps listed",
		got.Buffers, got.Records, got.Windows, got.Triggers, len(got.Sources), len(got.Gaps))
}

// publicCounts formats the counts a consumer reports.
func publicCounts(s ingest.SourceCounts) string {
	return fmt.Sprintf("records %d bytes %d dropped %d sender gaps %d backwards %d short %d seq %d..%d rx %d..%d reassigned %d",
		s.Records, s.Bytes, s.DroppedHere, s.SenderGaps, s.SenderBackwards, s.Short, s.FirstSeq, s.LastSeq, s.FirstRxNs, s.LastRxNs, s.Reassigned)
}
