package offload

import (
	"slices"
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
	tp := newTopoWith(t, topology.VethOptions{Queues: 2}, spreadRings, Config{Queues: []int{0, 1}})
	sendSpread(t, tp, []int{0, 1})
}

// TestAddQueue: an engine started on queue 0 of two in use gains queue 1
// by AddQueue, its socket where the program looks for that queue's
// datagrams (IngestXSKMap at index 1): the flows that land on queue 1,
// which went to the kernel before, reach the ring through a second loop.
// Adding a queue served already changes nothing.
func TestAddQueue(t *testing.T) {
	tp := newTopoWith(t, topology.VethOptions{Queues: 2}, spreadRings, Config{Queues: []int{0}})
	for _, id := range []int{1, 1, 0} {
		if err := tp.br.Do(func() error { return tp.eng.AddQueue(id) }); err != nil {
			t.Fatalf("AddQueue(%d): %v", id, err)
		}
	}
	sendSpread(t, tp, []int{0, 1})
	if err := tp.eng.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tp.eng.AddQueue(1); err == nil {
		t.Fatal("AddQueue on a closed engine succeeded")
	}
}

var spreadRings = map[uint32]ingest.Config{
	bufTrigger: {Buffers: 256, BufferSize: 64 << 10, Window: 2 * time.Millisecond}, // room for a consumer stalled by -race on a loaded machine
}

// sendSpread has kernel senders on many source ports, spread by their flow
// hash over the receive queues of the interface, feed one ring, and fails
// unless the records arrive complete, in order per source and byte-exact,
// the engine serves exactly the queues want, and each carried some of
// them.
func sendSpread(t *testing.T, tp *topo, want []int) {
	t.Helper()
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
	t.Logf("per queue: %+v", st.Queues)
	var served []int
	for _, q := range st.Queues {
		served = append(served, q.Queue)
		if q.Appended == 0 {
			t.Errorf("queue %d carried no records: %+v", q.Queue, st.Queues)
		}
	}
	if !slices.Equal(served, want) {
		t.Fatalf("the engine serves queues %v, want %v", served, want)
	}
}
