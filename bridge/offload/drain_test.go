package offload

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// BenchmarkIngestDrain measures the receivers' own capacity, which
// BenchmarkIngest cannot on veth: there the generator's core does the
// receive path's kernel work and sets the pace. Here the receiver is
// stopped, the generator puts drainFrames datagrams in front of it (into
// the engine's AF_XDP RX ring, or the kernel UDP socket's receive
// buffer), and the time the receiver takes to empty its queue is
// measured: the engine's batch loop (poll: AF_XDP RX ring to ring
// buffers, frames back to the fill ring; a consumer releases buffers
// meanwhile) against recvmmsg in batches of 64 (socket buffer to user
// memory), with no XDP program for the kernel reader (its better case).
// Both only move data the kernel has already received; the generator's
// speed does not enter. Rates are the median of FB_BENCH_ROUNDS (default
// 15) drains, with the range, by the wall clock and per second the
// receiving thread spent on a CPU (its schedstat): on a shared machine the
// wall clock also counts the time the thread waited for a CPU.
func BenchmarkIngestDrain(b *testing.B) {
	for _, payload := range []int{64, 1024} {
		b.Run(fmt.Sprintf("payload=%d", payload), func(b *testing.B) { benchDrain(b, payload) })
	}
}

// drainFrames fits the engine's RX ring (benchFrames) and the kernel
// socket's receive buffer (8 MB asked, 16 MB granted) at 1024-byte
// payloads.
const drainFrames = 4000

func benchDrain(b *testing.B, payload int) {
	tp := newTopo(b, map[uint32]ingest.Config{
		bufTrigger: {Buffers: 64, BufferSize: 256 << 10},
	}, Config{FrameCount: benchFrames})
	kr := tp.kernelReader(b)
	cons := tp.countingConsumer(b, bufTrigger, ingest.ConsumerOptions{})
	rounds := 15
	if n, err := strconv.Atoi(os.Getenv("FB_BENCH_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	e := tp.eng
	q := e.queues[0]
	// The engine's loop stops; this goroutine drives its poll.
	e.stop.Store(true)
	unix.Write(e.wakefd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
	e.wg.Wait()
	var ev [8]byte
	unix.Read(e.wakefd, ev[:])
	e.stop.Store(false)
	defer func() {
		started := make(chan error, 1)
		e.wg.Add(1)
		go q.loop(started)
		<-started
	}()

	runtime.LockOSThread() // for its CPU time (threadCPU)
	defer runtime.UnlockOSThread()
	for range b.N {
		var eng, ker, engCPU, kerCPU []float64
		// The first rounds touch memory for the first time (the UMEM's
		// 16384 frames, the ring's 64 buffers) and cost several times more
		// CPU: warmUp untimed rounds cycle through both.
		const warmUp = 6
		for round := range warmUp + rounds {
			// The engine.
			before := q.c.appended.Load()
			cs0, _ := tp.prog.Counters()
			g := tp.generator(b, portTrigger, payload)
			sent := g.send(drainFrames, 1e9)
			g.gen.Close()
			// The frames are in the RX ring once the program counted
			// them.
			deadline := time.Now().Add(2 * time.Second)
			for {
				cs, _ := tp.prog.Counters()
				if n := cs.Verdicts[classifier.VerdictIngest].Packets - cs0.Verdicts[classifier.VerdictIngest].Packets; n >= uint64(sent) || time.Now().After(deadline) {
					break
				}
				time.Sleep(time.Millisecond)
			}
			cpu0 := ownCPU()
			start := time.Now()
			for q.c.appended.Load()-before < uint64(sent) {
				if q.poll() == 0 && time.Since(start) > 100*time.Millisecond {
					break
				}
			}
			took := time.Since(start)
			cpu := ownCPU() - cpu0
			got := q.c.appended.Load() - before
			e.tick()
			// The kernel reader, with no XDP program.
			tp.detach(b)
			kr.pause.Store(true)
			for !kr.parked.Load() {
				time.Sleep(100 * time.Microsecond)
			}
			kbefore := kr.count.Load()
			g = tp.generator(b, kernelPort, payload)
			ksent := g.send(drainFrames, 1e9)
			g.gen.Close()
			time.Sleep(20 * time.Millisecond)
			kr.doneAt.Store(0)
			kr.target.Store(int64(kbefore) + int64(ksent))
			kcpu0 := threadCPU(kr.tid.Load())
			kstart := time.Now()
			kr.pause.Store(false)
			for kr.doneAt.Load() == 0 && time.Since(kstart) < time.Second {
				time.Sleep(time.Millisecond)
			}
			kr.target.Store(0)
			// The reader parks again before its CPU time is read (it may
			// have gone on to wait in recvmmsg meanwhile: a few µs).
			kr.pause.Store(true)
			for !kr.parked.Load() {
				time.Sleep(100 * time.Microsecond)
			}
			kcpu := threadCPU(kr.tid.Load()) - kcpu0
			kr.pause.Store(false)
			ktook := time.Duration(kr.doneAt.Load() - kstart.UnixNano())
			kgot := kr.count.Load() - kbefore
			tp.attach(b)
			if round < warmUp {
				continue
			}
			if got != uint64(sent) || kgot != uint64(ksent) {
				b.Logf("round %d: the engine moved %d of %d, the kernel reader %d of %d: not counted (engine %+v)", round, got, sent, kgot, ksent, e.Stats())
				continue
			}
			eng = append(eng, float64(got)/took.Seconds())
			ker = append(ker, float64(kgot)/ktook.Seconds())
			engCPU = append(engCPU, float64(got)/cpu.Seconds())
			kerCPU = append(kerCPU, float64(kgot)/kcpu.Seconds())
			if benchTrace {
				fmt.Fprintf(os.Stderr, "drain round %d: engine %d in %v (%v on CPU), kernel %d in %v (%v on CPU)\n", round, got, took, cpu, kgot, ktook, kcpu)
			}
		}
		if len(eng) == 0 {
			b.Fatal("no round drained everything")
		}
		me, mk := median(eng), median(ker)
		ce, ck := median(engCPU), median(kerCPU)
		b.Logf("drain, %d-byte payloads, %d rounds: wall clock: engine %.0f/s (%.0f-%.0f), kernel recvmmsg %.0f/s (%.0f-%.0f), ratio %.2f (best rounds %.2f); "+
			"per second on a CPU: engine %.0f/s (%.0f-%.0f), kernel %.0f/s (%.0f-%.0f), ratio %.2f",
			payload, len(eng), me, slices.Min(eng), slices.Max(eng), mk, slices.Min(ker), slices.Max(ker), me/mk, slices.Max(eng)/slices.Max(ker),
			ce, slices.Min(engCPU), slices.Max(engCPU), ck, slices.Min(kerCPU), slices.Max(kerCPU), ce/ck)
		b.ReportMetric(me, "engine-rec/s")
		b.ReportMetric(mk, "kernel-rec/s")
		b.ReportMetric(me/mk, "x-kernel")
		b.ReportMetric(ce, "engine-rec/cpu-s")
		b.ReportMetric(ck, "kernel-rec/cpu-s")
		b.ReportMetric(ce/ck, "x-kernel-cpu")
		b.ReportMetric(ce*float64(payload)*8/1e9, "engine-Gbit/cpu-s")
	}
	_ = cons
}

// ownCPU is the calling thread's CPU time.
func ownCPU() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	return time.Duration(ts.Nano())
}
