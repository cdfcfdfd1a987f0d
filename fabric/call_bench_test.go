package fabric

import (
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU is the CPU time the calling OS thread has used. Per-call
// figures from it do not count the time the thread was preempted, so they
// hold up on a loaded machine where ns/op does not.
func threadCPU(tb testing.TB) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// perCallCPU locks the benchmark to its OS thread and starts the timer; the
// function it returns reports the thread's CPU time per iteration
// (cpu-ns/op) and unlocks the thread.
func perCallCPU(b *testing.B) (report func()) {
	runtime.LockOSThread()
	b.ReportAllocs()
	b.ResetTimer()
	cpu := threadCPU(b)
	return func() {
		b.ReportMetric(float64(threadCPU(b)-cpu)/float64(b.N), "cpu-ns/op")
		runtime.UnlockOSThread()
	}
}

// BenchmarkCall is the per-call cost of a stream on one core, without
// cache traffic between cores: one goroutine sends one 64-byte packet
// (application side, TX ring) and takes it back out on the bridge side,
// b.N times. "ring" is the same on the bare version 2 ring (Produce and
// Consume), so the difference is the stream's own work per call: Close
// safety, serialisation of concurrent callers, state checks, counters.
// cpu-ns/op is the thread's CPU time per iteration (getrusage), which
// a loaded machine inflates far less than ns/op.
//
//	go test -run '^$' -bench 'Call' -count 5 ./fabric/
func BenchmarkCall(b *testing.B) {
	b.Run("stream", func(b *testing.B) {
		br, app, err := NewPair(Config{RxSlots: 2, TxSlots: 1024})
		if err != nil {
			b.Fatal(err)
		}
		defer br.Close()
		defer app.Close()
		pk, out := mkBufs(1, 64), mkBufs(1, 2048)
		defer perCallCPU(b)()
		for range b.N {
			if _, err := app.Send(pk); err != nil {
				b.Fatal(err)
			}
			if n, err := br.TryRecv(out); n != 1 || err != nil {
				b.Fatal(n, err)
			}
		}
	})
	b.Run("ring", func(b *testing.B) {
		p, c, err := newRingPair(1024, 2048)
		if err != nil {
			b.Fatal(err)
		}
		pk, out := mkBufs(1, 64), mkBufs(1, 2048)
		defer perCallCPU(b)()
		for range b.N {
			if _, err := p.Produce(pk); err != nil {
				b.Fatal(err)
			}
			if n, err := c.Consume(out); n != 1 || err != nil {
				b.Fatal(n, err)
			}
		}
	})
}
