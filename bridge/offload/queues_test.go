package offload

import (
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestSeveralQueues: kernel senders on many source ports, spread by their
// flow hash over the two receive queues of the interface, feed one ring
// through two engine loops at once. Records arrive complete, in order per
// source and byte-exact, and both queues carried some of them.
func TestSeveralQueues(t *testing.T) {
	tp := newTopoWith(t, topology.VethOptions{Queues: 2}, map[uint32]ingest.Config{
		bufTrigger: {Buffers: 256, BufferSize: 64 << 10, Window: 2 * time.Millisecond}, // room for a consumer stalled by -race on a loaded machine
	}, Config{Queues: []int{0, 1}})
	rd := tp.reader(bufTrigger, checkTrigger)
	// The outside picks a transmit queue per flow by hash, and veth hands
	// the frame to the same receive queue here: with 16 flows all landing
	// on one queue of two has a chance of 2^-15.
	const flows, perSender, chunk = 16, 400, 20
	var senders []*ingesttest.Sender
	for i := range flows {
		senders = append(senders, tp.sender(i%4 == 3, uint16(6000+i), portTrigger+uint16(i%4)))
	}
	ingesttest.SendPaced(t, rd, senders, perSender, chunk)
	rd.CloseComplete(t, flows, perSender)
	st := tp.eng.Stats()
	if st.Appended != flows*perSender || st.Dropped != 0 || st.Malformed != 0 || st.KernelDrops != 0 {
		t.Errorf("engine stats %+v, want %d appended", st, flows*perSender)
	}
	busy := 0
	for _, q := range st.Queues {
		if q.Appended > 0 {
			busy++
		}
	}
	t.Logf("per queue: %+v", st.Queues)
	if busy < 2 {
		t.Fatalf("only %d of %d queues carried records: %+v", busy, len(st.Queues), st.Queues)
	}
}
