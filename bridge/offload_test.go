package bridge

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge/offload"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// TestAFPacketIngestNoAllocations drives the AF_PACKET RX loop by hand
// over blocks of ingest datagrams: classifying, stripping and appending
// them to a ring through the feeder allocates nothing.
func TestAFPacketIngestNoAllocations(t *testing.T) {
	r := newRig(t, Config{Path: PathAFPacket, Mode: ModeStrict, manual: true})
	const buffer, port = 10, 9000
	r.setTables(&classifier.RuleSet{Rules: []classifier.Rule{
		{ID: 1, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(port), Action: classifier.ActionIngest, Stream: buffer},
	}})
	ring, err := ingest.Create(ingest.Config{Name: filepath.Join(t.TempDir(), "r.sock"), Buffers: 64, BufferSize: 1 << 20, Window: time.Hour, BufferID: buffer})
	if err != nil {
		t.Fatal(err)
	}
	defer ring.Close()
	off, err := r.b.StartOffload(OffloadConfig{}, map[uint32]*ingest.Ring{buffer: ring})
	if err != nil {
		t.Fatal(err)
	}
	defer off.Close() // before the ring closes
	allocs, frames := r.rxAllocs(t, r.b.queues[0], port, "ingest")
	st := off.Stats()
	// Six blocks were taken (a warm-up and five measured); a slow loop
	// (-race) can see a burst split over two blocks, so ask for one burst.
	if allocs != 0 || st.Appended < 48 || st.Appended != st.Received || uint64(frames) < st.Appended {
		t.Fatalf("%v allocations per block over %d frames; engine %+v", allocs, frames, st)
	}
}

// TestFeedOnlyOnAFPacket: on an XDP path the engine reads its own
// sockets, and setIngest says so.
func TestFeedOnlyOnAFPacket(t *testing.T) {
	r := newRig(t, Config{Path: PathGeneric, Mode: ModeStrict})
	eng := offload.StartFed()
	defer eng.Close()
	if err := r.b.setIngest(eng); err == nil {
		t.Fatal("setIngest accepted on the generic XDP path")
	}
}
