package bridge

import (
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// threadCPU is the CPU time a thread of this process has used so far
// (from /proc/self/task/TID/schedstat, in nanoseconds), 0 if unknown.
func threadCPU(tid int32) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/schedstat", tid))
	if err != nil {
		return 0
	}
	var ns int64
	fmt.Sscan(string(b), &ns)
	return time.Duration(ns)
}

// cpuMeter measures the CPU time a set of threads uses between start and
// stop.
type cpuMeter struct {
	tids  []int32
	start []time.Duration
}

func newCPUMeter(tids ...int32) *cpuMeter {
	m := &cpuMeter{tids: tids}
	for _, t := range tids {
		m.start = append(m.start, threadCPU(t))
	}
	return m
}

// used is the CPU time of thread i since newCPUMeter.
func (m *cpuMeter) used(i int) time.Duration { return threadCPU(m.tids[i]) - m.start[i] }

// rxTid is the loop thread of queue 0 (RX and TX), once it has started.
func (r *rig) rxTid() int32 {
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if t := r.b.queues[0].tid.Load(); t != 0 {
			return t
		}
	}
	r.t.Fatal("the RX loop never started")
	return 0
}

// countingReader is the benchmarks' application: it drains a stream on a
// thread of its own (so that its CPU time can be measured), copying each
// packet out as an application does, without allocating.
type countingReader struct {
	n   atomic.Uint64
	tid atomic.Int32
}

func startReader(app *fabric.Stream) *countingReader {
	c := &countingReader{}
	started := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		c.tid.Store(int32(unix.Gettid()))
		close(started)
		bufs := make([][]byte, 64)
		mem := make([]byte, 64*2048)
		for {
			for i := range bufs {
				bufs[i] = mem[i*2048 : (i+1)*2048]
			}
			k, err := app.Recv(bufs)
			c.n.Add(uint64(k))
			if err != nil {
				return
			}
		}
	}()
	<-started
	return c
}
