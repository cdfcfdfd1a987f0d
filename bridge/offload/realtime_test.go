package offload

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// TestPriority: with Config.Priority the engine's loops run on real-time
// threads (one per queue, SCHED_FIFO at that priority), datagrams still
// arrive complete and in order, and after Close no thread of the process
// is left real-time (not the loop's, not one the runtime cloned from it).
func TestPriority(t *testing.T) {
	const prio = 9
	if n := len(testenv.FIFOThreads(t, prio)); n != 0 {
		t.Fatalf("%d real-time threads before the engine started", n)
	}
	tp := newTopo(t, map[uint32]ingest.Config{bufTrigger: {Buffers: 64, BufferSize: 64 << 10}}, Config{Priority: prio})
	if n := len(testenv.FIFOThreads(t, prio)); n != 1 {
		t.Fatalf("%d threads at SCHED_FIFO %d, want the one loop's", n, prio)
	}
	rd := tp.reader(bufTrigger, checkTrigger)
	senders := []*ingesttest.Sender{tp.sender(false, 5001, portTrigger), tp.sender(true, 5002, portTrigger+1)}
	const perSender, chunk = 500, 25
	ingesttest.SendPaced(t, rd, senders, perSender, chunk)
	rd.CloseComplete(t, len(senders), perSender)
	lat := rd.C.Stats().Latency
	t.Logf("%d buffers; latency p50 %v p99 %v", lat.Count, time.Duration(lat.Quantile(0.5)), time.Duration(lat.Quantile(0.99)))
	tp.eng.Close()
	deadline := time.Now().Add(5 * time.Second)
	for len(testenv.FIFOThreads(t, prio)) != 0 {
		if time.Now().After(deadline) {
			var stats []string
			for _, tid := range testenv.FIFOThreads(t, prio) {
				b, _ := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/stat")
				stats = append(stats, string(b))
			}
			t.Fatalf("the real-time thread outlived the engine: %q", stats)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestPriorityRefused: a priority outside SCHED_FIFO's range fails Start.
func TestPriorityRefused(t *testing.T) {
	for _, p := range []int{-1, 100} {
		if _, err := Start(Config{Priority: p}); err == nil || !strings.Contains(err.Error(), "priority") {
			t.Errorf("priority %d: %v", p, err)
		}
	}
}
