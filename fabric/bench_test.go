package fabric

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Benchmarks compare a stream against two baselines measured in the same
// run: a Unix datagram socketpair (one message per send/recv, the usual
// kernel IPC for packets) and a buffered Go channel. Run them with
//
//	go test -run '^$' -bench 'Rate|Depth' -benchtime 1000000x ./fabric/
//	go test -run '^$' -bench 'Latency' -benchtime 3000x ./fabric/
//
// (the latency benchmarks pace their packets 200 µs apart, so keep their
// count small).
// Rates are messages per second from one producer goroutine to one
// consumer goroutine; latencies are one-way, from just before the send to
// just after the receive, on the monotonic clock of this one process.

var baseline struct {
	sync.Mutex
	unix, ch map[int]float64 // msgs/s by packet size
}

const baselineMsgs = 200000

func baselines(tb testing.TB, size int) (unixgram, channel float64) {
	baseline.Lock()
	defer baseline.Unlock()
	if baseline.unix == nil {
		baseline.unix, baseline.ch = map[int]float64{}, map[int]float64{}
	}
	if _, ok := baseline.unix[size]; !ok {
		baseline.unix[size] = unixgramRate(tb, baselineMsgs, size)
		baseline.ch[size] = chanRate(baselineMsgs, size, 1024)
	}
	return baseline.unix[size], baseline.ch[size]
}

func unixgramPair(tb testing.TB) [2]int {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	return [2]int{fds[0], fds[1]}
}

func unixgramRate(tb testing.TB, n, size int) float64 {
	fds := unixgramPair(tb)
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		buf := make([]byte, size)
		for i := 0; i < n; i++ {
			if _, err := unix.Write(fds[0], buf); err != nil {
				tb.Error(err)
				return
			}
		}
	}()
	rbuf := make([]byte, 2048)
	for i := 0; i < n; i++ {
		if _, err := unix.Read(fds[1], rbuf); err != nil {
			tb.Fatal(err)
		}
	}
	el := time.Since(start)
	<-done
	return float64(n) / el.Seconds()
}

// chanRate copies each message into a pooled buffer, sends the slice over
// a channel and copies it out on the other side: the same two copies a
// stream makes.
func chanRate(n, size, depth int) float64 {
	ch := make(chan []byte, depth)
	pool := make([][]byte, depth+2)
	for i := range pool {
		pool[i] = make([]byte, 2048)
	}
	src := make([]byte, size)
	start := time.Now()
	go func() {
		for i := 0; i < n; i++ {
			b := pool[i%len(pool)][:size]
			copy(b, src)
			ch <- b
		}
	}()
	dst := make([]byte, 2048)
	for i := 0; i < n; i++ {
		copy(dst, <-ch)
	}
	return float64(n) / time.Since(start).Seconds()
}

// streamRate sends n packets application→bridge through the TX ring
// (blocking producer, so nothing is dropped) in batches of up to batch;
// the receiver takes up to recvBatch per call.
func streamRate(tb testing.TB, n, size, depth, batch, recvBatch int) float64 {
	br, app, err := NewPair(Config{RxSlots: 2, TxSlots: depth})
	if err != nil {
		tb.Fatal(err)
	}
	defer br.Close()
	defer app.Close()
	pk := mkBufs(batch, size)
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		for sent := 0; sent < n; {
			k := min(batch, n-sent)
			if _, err := app.Send(pk[:k]); err != nil {
				tb.Error(err)
				return
			}
			sent += k
		}
	}()
	out := mkBufs(64, 2048)
	for got := 0; got < n; {
		k, err := br.Recv(out[:recvBatch])
		if err != nil {
			tb.Fatal(err)
		}
		got += k
	}
	el := time.Since(start)
	<-done
	return float64(n) / el.Seconds()
}

// BenchmarkRate: message rate of a stream against the baselines, for 64-
// and 1500-byte packets, ring depth 1024: batches of 64 both ways, single
// packets both ways, and single-packet sends to a receiver that takes
// whatever is there, up to 64 (the bridge's way).
func BenchmarkRate(b *testing.B) {
	for _, size := range []int{64, 1500} {
		for _, bt := range []struct{ send, recv int }{{64, 64}, {1, 1}, {1, 64}} {
			b.Run(fmt.Sprintf("size=%d/batch=%d/recv=%d", size, bt.send, bt.recv), func(b *testing.B) {
				u, c := baselines(b, size)
				b.ResetTimer()
				r := streamRate(b, b.N, size, 1024, bt.send, bt.recv)
				b.ReportMetric(r, "msgs/s")
				b.ReportMetric(r/u, "x-unixgram")
				b.ReportMetric(r/c, "x-chan")
				b.ReportMetric(u, "unixgram-msgs/s")
				b.ReportMetric(c, "chan-msgs/s")
			})
		}
	}
}

// BenchmarkDepth: rate against ring depth, the analogue of APEnet+'s
// efficiency-versus-FIFO-depth table (batches of 64).
func BenchmarkDepth(b *testing.B) {
	for _, size := range []int{64, 1500} {
		for _, depth := range []int{256, 512, 1024, 2048, 4096} {
			b.Run(fmt.Sprintf("size=%d/depth=%d", size, depth), func(b *testing.B) {
				u, _ := baselines(b, size)
				b.ResetTimer()
				r := streamRate(b, b.N, size, depth, 64, 64)
				b.ReportMetric(r, "msgs/s")
				b.ReportMetric(r*float64(size)*8/1e9, "Gbit/s")
				b.ReportMetric(r/u, "x-unixgram")
			})
		}
	}
}

func pct(d []time.Duration, p float64) time.Duration {
	slices.Sort(d)
	return d[int(float64(len(d)-1)*p)]
}

// streamLatency sends b.N single packets with a gap between them and records
// send-to-receive time. With parked=true the gap (200 µs) is far longer
// than the receiver's spin, so every packet wakes a sleeping receiver: the
// tripwire's wake-up latency. With parked=false the receiver spins.
func streamLatency(b *testing.B, size int, parked bool) []time.Duration {
	br, app, err := NewPair(Config{RxSlots: 2, TxSlots: 256})
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	defer app.Close()
	if parked {
		br.recvWait.Spin = defaultSpin
	} else {
		br.recvWait.Spin = time.Second
	}
	base := time.Now()
	lat := make([]time.Duration, b.N)
	go func() {
		pk := mkBufs(1, size)
		for i := 0; i < b.N; i++ {
			gapUntil(parked)
			binary.LittleEndian.PutUint64(pk[0], uint64(time.Since(base)))
			app.Send(pk)
		}
	}()
	out := mkBufs(1, 2048)
	for i := 0; i < b.N; i++ {
		if _, err := br.RecvTimeout(out, 5*time.Second); err != nil {
			b.Fatal(err)
		}
		lat[i] = time.Since(base) - time.Duration(binary.LittleEndian.Uint64(out[0]))
	}
	return lat
}

func gapUntil(parked bool) {
	if parked {
		time.Sleep(200 * time.Microsecond)
		return
	}
	for t := time.Now(); time.Since(t) < 20*time.Microsecond; {
	}
}

func unixgramLatency(b *testing.B, size int, parked bool) []time.Duration {
	fds := unixgramPair(b)
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	base := time.Now()
	n := b.N
	lat := make([]time.Duration, n)
	go func() {
		pk := make([]byte, size)
		for i := 0; i < n; i++ {
			gapUntil(parked)
			binary.LittleEndian.PutUint64(pk, uint64(time.Since(base)))
			unix.Write(fds[0], pk)
		}
	}()
	out := make([]byte, 2048)
	for i := 0; i < n; i++ {
		if _, err := unix.Read(fds[1], out); err != nil {
			b.Fatal(err)
		}
		lat[i] = time.Since(base) - time.Duration(binary.LittleEndian.Uint64(out))
	}
	return lat
}

// BenchmarkLatency: one-way latency p50/p99, stream and Unix socket, with
// the receiver parked (sleeping in the kernel) or spinning.
func BenchmarkLatency(b *testing.B) {
	for _, size := range []int{64, 1500} {
		for _, parked := range []bool{true, false} {
			mode := "spinning"
			if parked {
				mode = "parked"
			}
			b.Run(fmt.Sprintf("size=%d/%s", size, mode), func(b *testing.B) {
				s := streamLatency(b, size, parked)
				u := unixgramLatency(b, size, parked)
				b.ReportMetric(float64(pct(s, 0.5).Nanoseconds()), "p50-ns")
				b.ReportMetric(float64(pct(s, 0.99).Nanoseconds()), "p99-ns")
				b.ReportMetric(float64(pct(u, 0.5).Nanoseconds()), "unixgram-p50-ns")
				b.ReportMetric(float64(pct(u, 0.99).Nanoseconds()), "unixgram-p99-ns")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// adaptiveLatency is streamLatency with steady 50 µs gaps (the sender
// busy-waits them: time.Sleep cannot sleep that briefly here, it takes
// about 1 ms), with the
// receiver's waiter fixed (Spin 20 µs) or adaptive (up to 200 µs).
func adaptiveLatency(b *testing.B, adaptive bool) ([]time.Duration, uint64) {
	br, app, err := NewPair(Config{RxSlots: 2, TxSlots: 256})
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	defer app.Close()
	w := br.recvWait
	if adaptive {
		w.MaxSpin = 200 * time.Microsecond
	}
	base := time.Now()
	lat := make([]time.Duration, b.N)
	go func() {
		pk := mkBufs(1, 64)
		for i := 0; i < b.N; i++ {
			for t := time.Now(); time.Since(t) < 50*time.Microsecond; {
			}
			binary.LittleEndian.PutUint64(pk[0], uint64(time.Since(base)))
			app.Send(pk)
		}
	}()
	out := mkBufs(1, 2048)
	for i := 0; i < b.N; i++ {
		if _, err := br.RecvTimeout(out, 5*time.Second); err != nil {
			b.Fatal(err)
		}
		lat[i] = time.Since(base) - time.Duration(binary.LittleEndian.Uint64(out[0]))
	}
	return lat, w.Sleeps()
}

// BenchmarkAdaptiveSpin: 64-byte packets 50 µs apart, longer than the
// default spin: a fixed waiter parks for each, an adaptive one learns to
// spin across the gap.
//
//	go test -run '^$' -bench 'AdaptiveSpin' -benchtime 5000x ./fabric/
func BenchmarkAdaptiveSpin(b *testing.B) {
	for _, adaptive := range []bool{false, true} {
		b.Run(fmt.Sprintf("adaptive=%v", adaptive), func(b *testing.B) {
			lat, sleeps := adaptiveLatency(b, adaptive)
			b.ReportMetric(float64(pct(lat, 0.5).Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(pct(lat, 0.99).Nanoseconds()), "p99-ns")
			b.ReportMetric(float64(sleeps)/float64(b.N), "sleeps/pkt")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// parkedWakeups times n wake-ups of a thread parked in sleep: another OS
// thread calls wake 200 µs after the previous wake-up, and each latency is
// from just before wake to just after sleep(i) returns. sleep returns once
// the i-th wake-up (counting from 0) has come.
func parkedWakeups(b *testing.B, n int, wake func(), sleep func(i int) error) []time.Duration {
	stamps := make([]atomic.Int64, n)
	base := time.Now()
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		for i := 0; i < n; i++ {
			time.Sleep(200 * time.Microsecond)
			stamps[i].Store(int64(time.Since(base)))
			wake()
		}
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	lat := make([]time.Duration, n)
	for i := range lat {
		if err := sleep(i); err != nil {
			b.Fatal(err)
		}
		lat[i] = time.Since(base) - time.Duration(stamps[i].Load())
	}
	return lat
}

// eventfdLatency is the wake-up without fabric: one OS thread blocks in
// read(2) on an eventfd, another writes it. It is the kernel's and the
// hypervisor's share of a parked wake-up, the floor under the stream's.
func eventfdLatency(b *testing.B) []time.Duration {
	// A semaphore eventfd: each read takes one write, so a late reader
	// cannot swallow two wake-ups and then wait forever.
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_SEMAPHORE) // blocking
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(efd)
	var buf [8]byte
	return parkedWakeups(b, b.N,
		func() { unix.Write(efd, eventfdOne[:]) },
		func(int) error { _, err := unix.Read(efd, buf[:]); return err })
}

// futexLatency is eventfdLatency with a futex instead of an eventfd: the
// waiter sleeps in FUTEX_WAIT on a word of a shared mapping (as a stream's
// region would be; not FUTEX_PRIVATE), the waker adds one to the word and
// calls FUTEX_WAKE. It answers whether a futex would wake faster than the
// eventfd the streams use (which epoll can wait for, a futex cannot).
func futexLatency(b *testing.B) []time.Duration {
	mem, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Munmap(mem)
	word := u32at(mem, 0)
	futex := func(op, val uint32) {
		unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(word)), uintptr(op), uintptr(val), 0, 0, 0)
	}
	return parkedWakeups(b, b.N,
		func() {
			atomic.AddUint32(word, 1)
			futex(1, 1) // FUTEX_WAKE
		},
		func(i int) error {
			for v := atomic.LoadUint32(word); v <= uint32(i); v = atomic.LoadUint32(word) {
				futex(0, v) // FUTEX_WAIT: returns at once if the word moved
			}
			return nil
		})
}

// spinLowPriority is the body of a spinner process: nice 19, it burns
// whatever CPU nobody else wants, for at most 60 s or until its standard
// input closes. Two of them keep both vCPUs from halting, so that a
// wake-up no longer has to bring a halted vCPU back through the
// hypervisor, while any runnable thread of normal priority preempts them.
func spinLowPriority() {
	unix.Setpriority(unix.PRIO_PROCESS, 0, 19)
	var stop atomic.Bool
	go func() {
		io.Copy(io.Discard, os.Stdin)
		stop.Store(true)
	}()
	for t := time.Now(); !stop.Load() && time.Since(t) < time.Minute; {
	}
}

// startSpinners starts one low-priority spinner process per CPU and
// returns the function that stops them.
func startSpinners(b *testing.B) func() {
	var stops []func()
	for i := 0; i < runtime.NumCPU(); i++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), peerEnv+"=spin")
		in, err := cmd.StdinPipe()
		if err != nil {
			b.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		stops = append(stops, func() { in.Close(); cmd.Wait() })
	}
	time.Sleep(50 * time.Millisecond) // let them get going
	return func() {
		for _, s := range stops {
			s()
		}
	}
}

// BenchmarkWakeup separates the parts of a parked wake-up (receiver
// asleep in the kernel, 200 µs between packets): a bare eventfd and a bare
// futex between two OS threads against the stream, with the vCPUs left to halt when
// idle (the normal case) and kept busy by two nice-19 spinner processes
// (then no wake-up has to revive a halted vCPU through the hypervisor).
// The difference between the two rows is what the VM's idle vCPUs cost.
//
//	go test -run '^$' -bench 'Wakeup' -benchtime 3000x ./fabric/
func BenchmarkWakeup(b *testing.B) {
	for _, busy := range []bool{false, true} {
		b.Run(fmt.Sprintf("vcpus-kept-busy=%v", busy), func(b *testing.B) {
			if busy {
				defer startSpinners(b)()
			}
			e := eventfdLatency(b)
			f := futexLatency(b)
			s := streamLatency(b, 64, true)
			b.ReportMetric(float64(pct(e, 0.5).Nanoseconds()), "eventfd-p50-ns")
			b.ReportMetric(float64(pct(e, 0.99).Nanoseconds()), "eventfd-p99-ns")
			b.ReportMetric(float64(pct(f, 0.5).Nanoseconds()), "futex-p50-ns")
			b.ReportMetric(float64(pct(f, 0.99).Nanoseconds()), "futex-p99-ns")
			b.ReportMetric(float64(pct(s, 0.5).Nanoseconds()), "stream-p50-ns")
			b.ReportMetric(float64(pct(s, 0.99).Nanoseconds()), "stream-p99-ns")
			b.ReportMetric(0, "ns/op")
		})
	}
}
