package offload

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/testing/xdpgen"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

var benchTrace = os.Getenv("FB_BENCH_TRACE") != ""

// benchPriority (FB_BENCH_PRIORITY) runs the engine's loop and the
// consumers at this SCHED_FIFO priority (Config.Priority,
// ingest.LockRealtime with NoYield).
var benchPriority, _ = strconv.Atoi(os.Getenv("FB_BENCH_PRIORITY"))

// benchFrames sizes the engine's UMEM (and so its RX ring): 16384
// frames hold about as many small datagrams as the kernel reader's 8 MB
// socket buffer, the same slack against a receiver the scheduler holds
// back.
const benchFrames = 16384

// latencyWindow is the window of the ring the latency is measured on.
const latencyWindow = 20 * time.Microsecond

// kernelPort is a port no rule claims: the kernel's UDP socket reader gets
// its datagrams.
const kernelPort = 9500

// BenchmarkIngest measures, in one run and with one generator
// (internal/testing/xdpgen: AF_XDP TX on the outside end of the veth, four source
// ports, paced in batches of 64), the highest rate at which every datagram
// reaches its reader, for the offload path (XDP strip, engine, ring, a
// consumer walking every record), for the AF_PACKET path (the bridge on
// its packet sockets classifying and stripping in Go, feeding a fed engine
// that fills the same rings for the same consumers) and for a kernel UDP
// socket read with recvmmsg (with the classifier attached and passing,
// and with no XDP program at all), and then both ingest paths'
// wire-to-consumer latency. Each zero-loss rate is the median of three
// rounds of a bisection (a quarter of a second per trial); the ratio is
// against the better kernel variant. Run it once: -benchtime 1x.
// FB_BENCH_TRACE=1 prints every trial; FB_BENCH_ROUNDS changes the number
// of rounds; FB_BENCH_LATENCY_ONLY=1 skips the rates and measures latency
// at 100 k records/s only. Knobs for the latency experiments:
// FB_BENCH_ENGINE_SPIN and FB_BENCH_CONSUMER_SPIN (durations; the engine's
// Config.Spin, the consumers' ConsumerOptions.Spin, negative: never
// sleep), FB_BENCH_GC=off (no garbage collection during the run),
// FB_BENCH_LATENCY_SECONDS (default 1), FB_BENCH_PRIORITY (real-time
// engine and consumers, see benchPriority).
func BenchmarkIngest(b *testing.B) {
	for _, payload := range []int{64, 1024} {
		b.Run(fmt.Sprintf("payload=%d", payload), func(b *testing.B) { benchIngest(b, payload) })
	}
}

// OpenAFPacketPath opens the bridge on its AF_PACKET path on ifname in br
// with rules, feeding rings through a fed engine; close undoes it and
// leaves the rings open. Set by afpacket_bench_test.go: this package's own
// test files cannot import the bridge.
var OpenAFPacketPath func(tb testing.TB, br *topology.NS, ifname string, rules []classifier.Rule, rings map[uint32]*ingest.Ring) (close func())

func envDuration(name string) time.Duration {
	d, _ := time.ParseDuration(os.Getenv(name))
	return d
}

func benchIngest(b *testing.B, payload int) {
	if OpenAFPacketPath == nil {
		b.Fatal("OpenAFPacketPath not set")
	}
	if os.Getenv("FB_BENCH_GC") == "off" {
		defer debug.SetGCPercent(debug.SetGCPercent(-1))
	}
	// Throughput through a ring with the default 100 µs window (256
	// buffers: 25 ms of slack for a consumer the scheduler holds back);
	// latency through one with a 20 µs window, on another port.
	tp := newTopo(b, map[uint32]ingest.Config{
		bufTrigger: {Buffers: 256, BufferSize: 256 << 10},
		bufOther:   {Buffers: 256, BufferSize: 256 << 10, Window: latencyWindow},
	}, Config{FrameCount: benchFrames, Spin: envDuration("FB_BENCH_ENGINE_SPIN"), Priority: benchPriority})
	// One queue takes one UMEM: each measurement opens its generator
	// (the same code and frames but for the destination port) and
	// closes it.
	ing := func() *paced { return tp.generator(b, portTrigger, payload) }
	lat := func() *paced { return tp.generator(b, portOther, payload) }
	ker := func() *paced { return tp.generator(b, kernelPort, payload) }
	kr := tp.kernelReader(b)
	copts := ingest.ConsumerOptions{Spin: envDuration("FB_BENCH_CONSUMER_SPIN"), NoYield: benchPriority > 0}
	cons := tp.countingConsumer(b, bufTrigger, copts)
	lcons := tp.countingConsumer(b, bufOther, copts)
	// The AF_PACKET path: the XDP program off (as where it cannot
	// attach), the bridge on packet sockets, and the same rings, handed
	// from the XDP engine to the fed one and back.
	afpacket := func(f func()) {
		tp.detach(b)
		for id := range tp.rings {
			if err := tp.eng.Detach(id); err != nil {
				b.Fatal(err)
			}
		}
		closeAFP := OpenAFPacketPath(b, tp.br, tp.v.A.Name, standardRules, tp.rings)
		f()
		closeAFP()
		for id, r := range tp.rings {
			if err := tp.eng.Attach(id, r); err != nil {
				b.Fatal(err)
			}
		}
		tp.attach(b)
	}
	latencyOnly := os.Getenv("FB_BENCH_LATENCY_ONLY") != ""

	for range b.N {
		ingest, afp := 200_000.0, 200_000.0 // latency at 100 k/s only
		if !latencyOnly {
			var rates [4][]float64 // ingest, kernel with XDP pass, kernel without XDP, AF_PACKET ingest
			rounds := 3
			if n, err := strconv.Atoi(os.Getenv("FB_BENCH_ROUNDS")); err == nil && n > 0 {
				rounds = n
			}
			for round := range rounds {
				var r [4]float64
				r[0] = zeroLossRate(ing(), func() uint64 { return cons.records.Load() })
				r[1] = zeroLossRate(ker(), kr.count.Load)
				tp.detach(b)
				r[2] = zeroLossRate(ker(), kr.count.Load)
				tp.attach(b)
				afpacket(func() { r[3] = zeroLossRate(ing(), func() uint64 { return cons.records.Load() }) })
				var f [4]string
				for i, v := range r {
					f[i] = fmt.Sprintf("%.0f/s", max(v, -v))
					if v < 0 {
						f[i] += " (lossless at the generator's full rate)"
					}
					rates[i] = append(rates[i], max(v, -v))
				}
				b.Logf("round %d: ingest %s, kernel (XDP pass) %s, kernel (no XDP) %s, AF_PACKET ingest %s", round, f[0], f[1], f[2], f[3])
			}
			var kpass, knone float64
			ingest, kpass, knone, afp = median(rates[0]), median(rates[1]), median(rates[2]), median(rates[3])
			kernel := max(kpass, knone)
			b.ReportMetric(ingest, "ingest-rec/s")
			b.ReportMetric(ingest*float64(payload)*8/1e9, "ingest-Gbit/s")
			b.ReportMetric(afp, "afpacket-rec/s")
			b.ReportMetric(afp*float64(payload)*8/1e9, "afpacket-Gbit/s")
			b.ReportMetric(kpass, "kernel-xdp-pass-rec/s")
			b.ReportMetric(knone, "kernel-no-xdp-rec/s")
			b.ReportMetric(kernel*float64(payload)*8/1e9, "kernel-Gbit/s")
			b.ReportMetric(ingest/kernel, "x-kernel")
			b.ReportMetric(afp/kernel, "afpacket-x-kernel")
		}

		measure := func(path string, rate float64) {
			l := lcons.latencies(lat(), rate)
			if len(l.lat) == 0 {
				b.Fatalf("%s: no buffer reached the consumer", path)
			}
			name := fmt.Sprintf("%.0fk", rate/1e3)
			b.Logf("%s latency at %s records/s, %v window: %s", path, name, latencyWindow, l)
			b.ReportMetric(l.q(0.5), path+"-p50-µs@"+name)
			b.ReportMetric(l.q(0.99), path+"-p99-µs@"+name)
			b.ReportMetric(l.q(0.999), path+"-p99.9-µs@"+name)
		}
		for _, rate := range []float64{100_000, ingest / 2} {
			measure("xdp", rate)
			if latencyOnly {
				break
			}
		}
		afpacket(func() {
			for _, rate := range []float64{100_000, afp / 2} {
				measure("afpacket", rate)
				if latencyOnly {
					break
				}
			}
		})
	}
	b.Logf("engine %+v; ring %+v", tp.eng.Stats(), tp.rings[bufTrigger].Stats())
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// paced is the generator of one path: xdpgen on end B, sending a given
// number of frames at a given rate.
type paced struct {
	gen *xdpgen.Gen
}

func (tp *topo) generator(b *testing.B, dport uint16, payload int) *paced {
	var frames [][]byte
	for i := range 4 {
		f := framegen.Spec{L3: 4, L4: 17, Src: tp.v.B.Addr4.Addr(), Dst: tp.v.A.Addr4.Addr(),
			SrcPort: uint16(5001 + i), DstPort: dport, Payload: payload}.Build()
		copy(f[0:6], tp.v.A.MAC)
		copy(f[6:12], tp.v.B.MAC)
		frames = append(frames, f)
	}
	// The kernel tears down the previous generator's UMEM binding
	// asynchronously: retry while the queue is still busy.
	var g *xdpgen.Gen
	var err error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		err = tp.out.Do(func() (err error) {
			g, err = xdpgen.New(tp.v.B.Index, frames)
			return err
		})
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		b.Fatal(err)
	}
	return &paced{gen: g}
}

// send sends n frames at rate per second, in batches of 64, and returns
// how many went out.
func (p *paced) send(n int, rate float64) int {
	const batch = 64
	interval := time.Duration(float64(batch) / rate * 1e9)
	start := time.Now()
	sent := 0
	for i := 0; sent < n; i++ {
		// Sleep through most of a long wait (a generator on another
		// machine would not take this machine's processor), spin the
		// rest.
		slot := time.Duration(i) * interval
		if wait := slot - time.Since(start); wait > 80*time.Microsecond {
			time.Sleep(wait - 60*time.Microsecond)
		}
		for time.Since(start) < slot {
		}
		sent += p.gen.Send(min(batch, n-sent), time.Second)
	}
	return sent
}

// zeroLossRate searches for the highest rate at which every frame sent
// arrives (received is the reader's running count): the generator's
// unpaced rate first, then a bisection. A negative result is the
// generator's unpaced rate, reached without loss.
func zeroLossRate(p *paced, received func() uint64) float64 {
	defer p.gen.Close()
	trial := func(rate float64, n int) (float64, bool) {
		before := received()
		start := time.Now()
		sent := p.send(n, rate)
		took := time.Since(start)
		deadline := time.Now().Add(200 * time.Millisecond)
		for received()-before < uint64(sent) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(20 * time.Millisecond) // and nothing more arrives late
		got := received() - before
		if benchTrace {
			fmt.Fprintf(os.Stderr, "trial %.0f/s: sent %d in %v, got %d\n", rate, sent, took, got)
		}
		return float64(sent) / took.Seconds(), got == uint64(sent)
	}
	top, ok := trial(1e9, 200_000) // as fast as the generator goes
	if ok {
		// Lossless at the generator's own limit: the path was not
		// saturated, the figure is a floor (marked negative for the log).
		return -top
	}
	lo, hi := 0.0, top
	for range 8 {
		mid := (lo + hi) / 2
		if _, ok := trial(mid, max(1000, int(mid/4))); ok { // a quarter of a second
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// detach and attach take the XDP program off end A and put it back, for
// the kernel baseline without XDP.
func (tp *topo) detach(b *testing.B) {
	if err := tp.prog.Detach(); err != nil {
		b.Fatal(err)
	}
}

func (tp *topo) attach(b *testing.B) {
	if err := tp.br.Do(func() error {
		_, err := tp.prog.Attach(tp.v.A.Index, fbebpf.ModeNative)
		return err
	}); err != nil {
		b.Fatal(err)
	}
}

// kernelReader is a UDP socket on end A's address and kernelPort, read
// with recvmmsg in batches of 64 by one goroutine.
type kernelReader struct {
	count atomic.Uint64
	bytes atomic.Uint64
	// pause (drain measurements): while set the reader does not read;
	// parked says it has stopped.
	pause, parked atomic.Bool
	// target, if not 0, is a count at which the reader notes the time
	// (doneAt, Unix ns) it got there.
	target, doneAt atomic.Int64
	tid            atomic.Int64 // the reading thread
}

func (tp *topo) kernelReader(b *testing.B) *kernelReader {
	var fd int
	if err := tp.br.Do(func() (err error) {
		if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<20)
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
		addr := tp.v.A.Addr4.Addr().As4()
		return unix.Bind(fd, &unix.SockaddrInet4{Port: kernelPort, Addr: addr})
	}); err != nil {
		b.Fatal(err)
	}
	kr := &kernelReader{}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		runtime.LockOSThread() // for its CPU time (threadCPU)
		defer runtime.UnlockOSThread()
		kr.tid.Store(int64(unix.Gettid()))
		const batch = 64
		bufs := make([][2048]byte, batch)
		iovs := make([]unix.Iovec, batch)
		msgs := make([]unix.Mmsghdr, batch)
		for i := range msgs {
			iovs[i].Base = &bufs[i][0]
			iovs[i].SetLen(len(bufs[i]))
			msgs[i].Hdr.Iov = &iovs[i]
			msgs[i].Hdr.SetIovlen(1)
		}
		tv := unix.Timeval{Usec: 50_000} // so the loop sees stop
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		for !stop.Load() {
			if kr.pause.Load() {
				kr.parked.Store(true)
				time.Sleep(100 * time.Microsecond)
				continue
			}
			kr.parked.Store(false)
			n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&msgs[0])), batch, unix.MSG_WAITFORONE, 0, 0)
			if errno != 0 {
				continue
			}
			var bytes uint64
			for i := range int(n) {
				bytes += uint64(msgs[i].Len)
			}
			c := kr.count.Add(uint64(n))
			kr.bytes.Add(bytes)
			if t := kr.target.Load(); t != 0 && int64(c) >= t && kr.doneAt.Load() == 0 {
				kr.doneAt.Store(time.Now().UnixNano())
			}
		}
	}()
	b.Cleanup(func() { stop.Store(true); wg.Wait(); unix.Close(fd) })
	return kr
}

// countingConsumer reads a ring like a trigger would: it walks every
// record of every buffer (reading its header and payload length), then
// releases the buffer.
type countingConsumer struct {
	c       *ingest.Consumer
	records atomic.Uint64
	mu      sync.Mutex
	s       latencySample
	keep    atomic.Bool
}

// latencySample is, per buffer, the wire-to-consumer latency and its two
// parts: first RX to publication (the window and the engine) and
// publication to the consumer's wake-up; and what the process went
// through meanwhile.
type latencySample struct {
	lat, pub, hand []uint64
	gcs            uint32        // garbage collections during the sample
	gcPause        time.Duration // their stop-the-world pauses
	runDelay       time.Duration // time this process's threads waited for a CPU (schedstat)
	cpu            time.Duration // CPU time this process used (generator included)
	took           time.Duration
}

func (tp *topo) countingConsumer(b *testing.B, id uint32, opts ingest.ConsumerOptions) *countingConsumer {
	c, err := ingest.Open(tp.rings[id].Name(), opts)
	if err != nil {
		b.Fatal(err)
	}
	cc := &countingConsumer{c: c}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if opts.NoYield {
			unlock, err := ingest.LockRealtime(benchPriority)
			if err != nil {
				b.Error(err)
				return
			}
			defer unlock()
		}
		for !stop.Load() {
			buf, err := c.Next(20 * time.Millisecond)
			if errors.Is(err, ingest.ErrTimeout) {
				continue
			}
			if err != nil {
				return
			}
			if cc.keep.Load() {
				cc.mu.Lock()
				cc.s.lat = append(cc.s.lat, uint64(buf.Latency()))
				cc.s.pub = append(cc.s.pub, buf.PublishNs-buf.FirstNs)
				cc.s.hand = append(cc.s.hand, buf.WakeNs-buf.PublishNs)
				cc.mu.Unlock()
			}
			it := buf.Iter()
			var bytes int
			for it.Next() {
				bytes += len(it.Record().Payload)
			}
			cc.records.Add(uint64(buf.Records))
			c.Release(&buf)
		}
	}()
	b.Cleanup(func() { stop.Store(true); wg.Wait(); c.Close() })
	return cc
}

// latencies sends for FB_BENCH_LATENCY_SECONDS (default 1) at rate and
// returns the latency of every buffer the consumer took meanwhile.
func (cc *countingConsumer) latencies(p *paced, rate float64) latencySample {
	defer p.gen.Close()
	secs := 1.0
	if v, err := strconv.ParseFloat(os.Getenv("FB_BENCH_LATENCY_SECONDS"), 64); err == nil && v > 0 {
		secs = v
	}
	n := int(rate * secs)
	cc.mu.Lock()
	// Room for every buffer: no slice grows while the sample runs.
	cc.s = latencySample{lat: make([]uint64, 0, n), pub: make([]uint64, 0, n), hand: make([]uint64, 0, n)}
	cc.mu.Unlock()
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	rd0, cpu0 := runDelay(), processCPU()
	start := time.Now()
	cc.keep.Store(true)
	p.send(n, rate)
	time.Sleep(50 * time.Millisecond)
	cc.keep.Store(false)
	took := time.Since(start)
	rd1, cpu1 := runDelay(), processCPU()
	runtime.ReadMemStats(&ms1)
	cc.mu.Lock()
	defer cc.mu.Unlock()
	s := latencySample{lat: slices.Clone(cc.s.lat), pub: slices.Clone(cc.s.pub), hand: slices.Clone(cc.s.hand),
		gcs: ms1.NumGC - ms0.NumGC, gcPause: time.Duration(ms1.PauseTotalNs - ms0.PauseTotalNs),
		runDelay: rd1 - rd0, cpu: cpu1 - cpu0, took: took}
	return s
}

// q is the latency's quantile p in µs.
func (s *latencySample) q(p float64) float64 { return quantile(s.lat, p) }

func quantile(v []uint64, p float64) float64 {
	d := slices.Clone(v)
	slices.Sort(d)
	return float64(d[min(len(d)-1, int(p*float64(len(d))))]) / 1e3
}

// String gives the percentiles, the parts', and the parts of the buffers
// beyond p99: whether the tail is the engine's (first RX to publish) or
// the consumer's (publish to wake-up).
func (s latencySample) String() string {
	out := fmt.Sprintf("%d buffers: p50 %.1f µs, p99 %.1f µs, p99.9 %.1f µs, max %.1f µs", len(s.lat), s.q(0.5), s.q(0.99), s.q(0.999), s.q(1))
	for _, v := range []struct {
		name string
		d    []uint64
	}{{"RX to publish", s.pub}, {"publish to wake-up", s.hand}} {
		out += fmt.Sprintf("; %s p50 %.1f p99 %.1f p99.9 %.1f µs", v.name, quantile(v.d, 0.5), quantile(v.d, 0.99), quantile(v.d, 0.999))
	}
	cut := uint64(s.q(0.99) * 1e3)
	var engine, consumer int
	for i, l := range s.lat {
		if l >= cut && l > 0 {
			if s.pub[i] >= s.hand[i] {
				engine++
			} else {
				consumer++
			}
		}
	}
	out += fmt.Sprintf("; of the buffers at or beyond p99, %d mostly before publication, %d mostly after", engine, consumer)
	out += fmt.Sprintf("; %d GCs (%v stopped), %v of CPU wait (threads runnable, not running) and %v of CPU used in %v",
		s.gcs, s.gcPause, s.runDelay.Round(time.Microsecond), s.cpu.Round(time.Millisecond), s.took.Round(time.Millisecond))
	return out
}

// processCPU is the CPU time this process has used.
func processCPU() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// threadCPU is the time thread tid of this process has run on a CPU
// (the first field of its schedstat).
func threadCPU(tid int64) time.Duration {
	b, err := os.ReadFile("/proc/self/task/" + strconv.FormatInt(tid, 10) + "/schedstat")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	v, _ := strconv.ParseInt(f[0], 10, 64)
	return time.Duration(v)
}

// runDelay sums, over this process's threads, the time they spent
// runnable but waiting for a CPU (the second field of
// /proc/self/task/*/schedstat); 0 if the kernel does not say.
func runDelay() time.Duration {
	dirs, _ := os.ReadDir("/proc/self/task")
	var sum int64
	for _, d := range dirs {
		b, err := os.ReadFile("/proc/self/task/" + d.Name() + "/schedstat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) >= 2 {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			sum += v
		}
	}
	return time.Duration(sum)
}
