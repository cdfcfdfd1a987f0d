package gpu

import (
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// genRecord is one record of the generations script: its source index, the
// ring's per-source sequence, the sender's and the source entry's
// generation.
type genRecord struct {
	src            int
	ring, seq, gen uint32
}

// genScript: source-table entries given to new sources, at a buffer's start
// and in its middle. A new generation restarts both sequences, so what
// would be gaps and repeats across it are not; a gap within a generation
// still is.
var genScript = [][]genRecord{
	{{0, 0, 10, 5}, {0, 1, 11, 5}, {1, 0, 100, 0}, {0, 2, 12, 5}},
	{{0, 0, 0, 6}, {1, 2, 102, 0}, {0, 1, 1, 6}, {0, 0, 7, 7}, {0, 1, 8, 7}},
	{{0, 2, 9, 7}, {1, 3, 103, 0}, {0, 5, 10, 7}},
	{{1, 0, 5, 1}},
}

// feedGenerations appends genScript, a buffer per line, writing each
// record's ring sequence and generation itself before the buffer is
// published, as a producer that hands entries on does. It returns the RX
// time of each record, by line and position. region is the consumer's
// mapping, taken before the consumer started: InPlace reads the consumer's
// position, which its own goroutine moves.
func feedGenerations(t testing.TB, r *ingest.Ring, region []byte) [][]uint64 {
	t.Helper()
	le := binary.LittleEndian
	bufOff, size := le.Uint64(region[ingBuffersOff:]), uint64(le.Uint32(region[ingBufferSize:]))
	count := uint64(le.Uint32(region[ingBufferCount:]))
	payload := make([]byte, 64)
	rx := make([][]uint64, len(genScript))
	at := uint64(1_000_000_000)
	for b, line := range genScript {
		for !r.Writable() {
			time.Sleep(time.Millisecond)
		}
		buf := region[bufOff+uint64(b)%count*size:]
		off := uint64(0)
		for _, g := range line {
			at += 1000
			n := ingest.PutTriggerPayload(payload, g.seq, []uint16{uint16(g.seq), 7})
			if !r.Append(source(g.src), at, payload[:n]) {
				t.Fatalf("buffer %d: the ring took no record", b)
			}
			le.PutUint32(buf[off+ingRSeq:], g.ring)
			le.PutUint32(buf[off+ingRSourceGen:], g.gen)
			off += uint64(le.Uint32(buf[off+ingRSize:]))
			rx[b] = append(rx[b], at)
		}
		r.Flush()
	}
	return rx
}

// checkGenerations compares a run over genScript with the reference's
// results worked out by hand: the reference of a ring whose records carry
// source_gen.
func checkGenerations(t *testing.T, got *Results, rx [][]uint64) {
	t.Helper()
	want := []ingest.SourceCounts{
		// Nine records; entry 0 went to new sources twice (generations 6
		// and 7); the last started at rx[1][3] with sender number 7; one
		// gap of 2 in the ring's sequence within generation 7.
		{Records: 9, Bytes: 9 * 8, DroppedHere: 2, FirstSeq: 7, LastSeq: 10, FirstRxNs: rx[1][3], LastRxNs: rx[2][2], Reassigned: 2},
		// Entry 1 went to a new source in the last buffer, whose sender
		// number 5 is no repeat of 104: one gap in each sequence before.
		{Records: 4, Bytes: 4 * 8, DroppedHere: 1, SenderGaps: 1, FirstSeq: 5, LastSeq: 5, FirstRxNs: rx[3][0], LastRxNs: rx[3][0], Reassigned: 1},
	}
	wantGaps := []ingest.Gap{
		{Source: 1, Want: 1, Got: 2}, {Source: 1, Sender: true, Want: 101, Got: 102}, {Source: 0, Want: 3, Got: 5},
	}
	if got.Buffers != uint64(len(genScript)) || got.Records != 13 || got.Windows != uint64(len(genScript)) {
		t.Errorf("%d buffers, %d records, %d windows; want %d, 13, %d", got.Buffers, got.Records, got.Windows, len(genScript), len(genScript))
	}
	if len(got.Sources) != len(want) {
		t.Fatalf("%d sources, want %d", len(got.Sources), len(want))
	}
	for i := range want {
		if g, w := publicCounts(got.Sources[i]), publicCounts(want[i]); g != w {
			t.Errorf("source %d:\n got %s\nwant %s", i, g, w)
		}
	}
	if fmt.Sprint(got.Gaps) != fmt.Sprint(wantGaps) {
		t.Errorf("gaps %v, want %v", got.Gaps, wantGaps)
	}
}

// genRun runs the generations script through a GPU consumer on dev.
func genRun(t *testing.T, dev device, opts Options) {
	r, c := newRing(t, ingest.Config{Buffers: 4, BufferSize: 4096, Window: time.Second, MaxSources: 4}, ingest.ConsumerOptions{})
	region, _ := c.InPlace()
	g, done := startGPU(t, dev, c, opts)
	rx := feedGenerations(t, r, region)
	r.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got, err := g.Results()
	if err != nil {
		t.Fatal(err)
	}
	checkGenerations(t, got, rx)
}

func TestFakeGenerations(t *testing.T) {
	for _, mode := range []Mode{Persistent, HostDriven} {
		t.Run(mode.String(), func(t *testing.T) { genRun(t, newFake(), Options{Mode: mode, Blocks: 2}) })
	}
}

func TestGPUGenerations(t *testing.T) {
	dev := cudaOrSkip(t)
	for _, mode := range []Mode{Persistent, HostDriven} {
		for _, blocks := range []int{1, 4} {
			t.Run(fmt.Sprintf("%s/%d", mode, blocks), func(t *testing.T) { genRun(t, dev, Options{Mode: mode, Blocks: blocks}) })
		}
	}
}
