package fabric

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func newTestPair(t testing.TB, cfg Config) (*BridgeStream, *Stream) {
	t.Helper()
	b, a, err := NewPair(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return b, a
}

// RX: when the application does not read, the bridge drops exactly the
// packets the ring's bytes do not hold, the newest ones, and counts them;
// the stream turns sick, and normal again after two quiet intervals.
func TestStreamDropNewestWhenFull(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 16, TxSlots: 16, SlotSize: 256})
	const size = 256 - 8 // full-size records: the (16+1) x 256-byte data area holds 17
	in := mkBufs(10, size)
	pk := make([][]byte, 10)
	sent := uint32(0)
	for round := 0; round < 5; round++ { // 50 packets into room for 17
		for i := range pk {
			pk[i] = seqPkt(in[i], sent+uint32(i), size)
		}
		n, err := b.Send(pk)
		if err != nil {
			t.Fatal(err)
		}
		if want := min(10, max(0, 17-int(sent))); n != want {
			t.Fatalf("round %d: queued %d, want %d", round, n, want)
		}
		sent += 10
	}
	if st := b.Stats(); st.Dropped != 33 || st.Sent != 17 {
		t.Fatalf("stats %+v, want 33 dropped, 17 sent", st)
	}
	if a.peerDrops() != 33 {
		t.Fatalf("application sees %d drops, want 33", a.peerDrops())
	}
	if h := b.Health(); h != Sick {
		t.Fatalf("health %v, want sick", h)
	}
	out := mkBufs(64, 256)
	n, err := a.Recv(out)
	if err != nil || n != 17 {
		t.Fatalf("recv n=%d err=%v, want 17", n, err)
	}
	for i := 0; i < n; i++ {
		checkSeqPkt(t, out[i], uint32(i), size) // the oldest 17 survived
	}
	b.Tick()
	if h := b.Health(); h != Sick {
		t.Fatalf("health after one tick %v, want still sick", h)
	}
	b.Tick()
	if h := b.Health(); h != Normal {
		t.Fatalf("health after two quiet ticks %v, want normal", h)
	}
}

// TX: the application blocks when the ring is full and resumes as the
// bridge drains; everything arrives in order, nothing is dropped.
func TestStreamBackpressure(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 8, TxSlots: 8, SlotSize: 128})
	a.sendWait.Spin = 0 // make it really sleep
	const total = 32 * 160
	done := make(chan error, 1)
	go func() {
		in := mkBufs(32, 64)
		pk := make([][]byte, 32)
		for seq := uint32(0); seq < total; seq += 32 {
			for i := range pk {
				pk[i] = seqPkt(in[i], seq+uint32(i), 20)
			}
			if n, err := a.Send(pk); n != 32 || err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	out := mkBufs(3, 128)
	deadline := time.Now().Add(10 * time.Second)
	for want := uint32(0); want < total; {
		n, err := b.RecvTimeout(out, time.Until(deadline))
		if err != nil {
			t.Fatalf("after %d: %v", want, err)
		}
		for i := 0; i < n; i++ {
			checkSeqPkt(t, out[i], want, 20)
			want++
		}
		if want%97 == 0 {
			time.Sleep(50 * time.Microsecond) // let the sender hit a full ring
		}
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("sender never finished")
	}
	if a.Stats().Sleeps == 0 {
		t.Fatal("sender never blocked: the test did not exercise backpressure")
	}
	if b.Stats().Dropped != 0 || a.Stats().Dropped != 0 {
		t.Fatal("drops on a backpressured stream")
	}
}

// Ping-pong with both sides forced to sleep every time: a lost wake-up
// shows as a timeout. Many iterations, meant for -race.
func TestStreamWakeupsPingPong(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 4, TxSlots: 4, SlotSize: 64})
	iters := 3000
	if testing.Short() {
		iters = 500
	}
	for _, w := range []*waiter{a.recvWait, b.recvWait, a.sendWait} {
		w.Spin = 0
	}
	errc := make(chan error, 1)
	go func() {
		buf := mkBufs(1, 64)
		for i := 0; i < iters; i++ {
			n, err := a.RecvTimeout(buf, 5*time.Second)
			if err != nil || n != 1 {
				errc <- err
				return
			}
			if _, err := a.Send(buf[:1]); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	in, out := mkBufs(1, 64), mkBufs(1, 64)
	for i := 0; i < iters; i++ {
		if n, err := b.Send([][]byte{seqPkt(in[0], uint32(i), 8)}); n != 1 || err != nil {
			t.Fatalf("send %d: %d %v", i, n, err)
		}
		n, err := b.RecvTimeout(out, 5*time.Second)
		if err != nil || n != 1 {
			t.Fatalf("iteration %d: lost wake-up? n=%d err=%v", i, n, err)
		}
		checkSeqPkt(t, out[0], uint32(i), 8)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if s := b.Stats().Sleeps + a.Stats().Sleeps; s < uint64(iters) {
		t.Fatalf("only %d sleeps in %d round trips: waiters did not park", s, iters)
	}
}

// Close from another goroutine unblocks a waiting Recv; the peer sees the
// stream break with ErrPeerGone after draining what was queued.
func TestStreamCloseAndPeerGone(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 8, TxSlots: 8, SlotSize: 128})
	got := make(chan error, 1)
	go func() {
		_, err := b.Recv(mkBufs(1, 128))
		got <- err
	}()
	time.Sleep(20 * time.Millisecond)
	if _, err := a.Send([][]byte{{1, 2, 3}}); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	a.Send([][]byte{{4}})
	go func() {
		_, err := a.Recv(mkBufs(1, 128))
		got <- err
	}()
	time.Sleep(20 * time.Millisecond)
	a.Close()
	select {
	case err := <-got:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("Recv after own Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not unblock Recv")
	}
	out := mkBufs(4, 128)
	if n, err := b.RecvTimeout(out, time.Second); n != 1 || err != nil || out[0][0] != 4 {
		t.Fatalf("queued packet not delivered after peer close: n=%d err=%v", n, err)
	}
	if _, err := b.RecvTimeout(out, 5*time.Second); !errors.Is(err, ErrPeerGone) {
		t.Fatalf("recv from closed peer: %v, want ErrPeerGone", err)
	}
	if b.Health() != Broken {
		t.Fatalf("health %v, want broken", b.Health())
	}
}

// A hostile application scribbles over the TX ring's write index in its
// own mapping; the bridge marks the stream broken and never crashes.
func TestStreamHostileApplication(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 8, TxSlots: 8, SlotSize: 128})
	a.Send([][]byte{{1}, {2}})
	atomic.StoreUint32(a.send.v.prod, 0x7fff0000) // garbage write_i
	out := mkBufs(8, 128)
	_, err := b.TryRecv(out)
	if !errors.Is(err, ErrCorruption) || !errors.Is(err, ErrBroken) {
		t.Fatalf("bridge err %v, want broken by corruption", err)
	}
	if b.Health() != Broken {
		t.Fatal("stream not broken")
	}
	if _, err := b.Send([][]byte{{1}}); err == nil {
		t.Fatal("bridge keeps sending into a broken stream")
	}
	// And the RX direction: garbage read_i makes the bridge's Send fail
	// once it needs the consumer's position, here when 5 full-size
	// packets have filled the (4+1) x 128-byte data area.
	b2, a2 := newTestPair(t, Config{RxSlots: 4, TxSlots: 4, SlotSize: 128})
	b2.Send(mkBufs(5, 120))
	atomic.StoreUint32(a2.recv.v.cons, 77)
	b2.Send([][]byte{{1}, {2}})
	if b2.Health() != Broken || !errors.Is(b2.Err(), ErrCorruption) {
		t.Fatalf("garbage read_i: health %v err %v", b2.Health(), b2.Err())
	}
}

// Send and Recv on streams allocate nothing per batch.
func TestStreamZeroAlloc(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 256, TxSlots: 256, SlotSize: 2048})
	pk := mkBufs(64, 64)
	out := mkBufs(64, 2048)
	allocs := testing.AllocsPerRun(100, func() {
		if n, _ := b.Send(pk); n != 64 {
			t.Fatal("send", n)
		}
		if n, _ := a.Recv(out); n != 64 {
			t.Fatal("recv", n)
		}
		if n, _ := a.Send(pk); n != 64 {
			t.Fatal("app send", n)
		}
		if n, _ := b.TryRecv(out); n != 64 {
			t.Fatal("bridge recv", n)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per round, want 0", allocs)
	}
}

// Many applications send bursts with idle gaps; one EventQueue gathers
// them all, every packet arrives in per-stream order, and the queue did
// sleep (so wake-ups through epoll were exercised).
func TestEventQueueManyStreams(t *testing.T) {
	var q0 *EventQueue
	manyStreams(t, func(q *EventQueue, toks []int) (int, error) {
		q0 = q
		return q.Wait(toks, time.Second)
	})
	if q0.Sleeps() == 0 {
		t.Fatal("event queue never slept")
	}
}

// The same through Poll and poll(2) on Fd beside another descriptor, the
// way the bridge waits for its AF_XDP socket and its streams at once: a
// publish to an armed stream must wake the poll, or the test stalls.
func TestEventQueuePollOnFd(t *testing.T) {
	other, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(other)
	sleeps := 0
	manyStreams(t, func(q *EventQueue, toks []int) (int, error) {
		n, err := q.Poll(toks)
		if n > 0 || err != nil {
			return n, err
		}
		sleeps++
		fds := []unix.PollFd{{Fd: int32(other), Events: unix.POLLIN}, {Fd: int32(q.Fd()), Events: unix.POLLIN}}
		k, err := unix.Poll(fds, 1000)
		if err != nil && err != unix.EINTR {
			return 0, err
		}
		if k == 0 { // the senders pause for 100 µs at most
			return 0, fmt.Errorf("no wake-up in 1 s with packets outstanding")
		}
		if fds[0].Revents != 0 {
			return 0, fmt.Errorf("the other descriptor woke up: %#x", fds[0].Revents)
		}
		return q.Poll(toks)
	})
	if sleeps == 0 {
		t.Fatal("never slept in poll(2)")
	}
}

func manyStreams(t *testing.T, wait func(q *EventQueue, toks []int) (int, error)) {
	const streams, perStream = 12, 2000
	q, err := NewEventQueue()
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	q.Spin = 0
	bridges := make([]*BridgeStream, streams)
	var wg sync.WaitGroup
	for i := range bridges {
		b, a := newTestPair(t, Config{RxSlots: 4, TxSlots: 16, SlotSize: 128})
		bridges[i] = b
		if _, err := q.Add(b); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func(a *Stream, id int) {
			defer wg.Done()
			in := mkBufs(8, 64)
			pk := make([][]byte, 8)
			for seq := 0; seq < perStream; {
				k := 1 + (seq+id)%8
				k = min(k, perStream-seq)
				for j := 0; j < k; j++ {
					pk[j] = seqPkt(in[j], uint32(seq+j), 16)
				}
				if _, err := a.Send(pk[:k]); err != nil {
					t.Error(err)
					return
				}
				seq += k
				if seq%50 < 8 {
					time.Sleep(100 * time.Microsecond)
				}
			}
		}(a, i)
	}
	next := make([]uint32, streams)
	out := mkBufs(16, 128)
	toks := make([]int, 64)
	total := 0
	deadline := time.Now().Add(20 * time.Second)
	for total < streams*perStream {
		if time.Now().After(deadline) {
			for i, b := range bridges {
				v := b.recv.v
				t.Logf("stream %d: next %d prod %d cons %d consArmed %d prodArm %d pend %v sendsleeps %d", i, next[i], *v.prod, *v.cons, *v.consArmed, *v.prodArm, q.inPend[i], b.send.wake.signals.Load())
			}
			t.Fatalf("only %d of %d packets after 20 s", total, streams*perStream)
		}
		n, err := wait(q, toks)
		if err != nil {
			t.Fatal(err)
		}
		for _, tok := range toks[:n] {
			s := q.Stream(tok)
			m, err := s.TryRecv(out)
			if err != nil {
				t.Fatal(err)
			}
			id := -1
			for i, b := range bridges {
				if b == s {
					id = i
				}
			}
			for j := 0; j < m; j++ {
				checkSeqPkt(t, out[j], next[id], 16)
				next[id]++
			}
			total += m
		}
	}
	wg.Wait()
}

// openFDs counts this process's open descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// Dead streams leave an EventQueue by themselves: applications that go
// away (after their packets are drained), bridge-side streams closed from
// another goroutine while queued (no Remove first), and a stream broken
// by a hostile application. Nothing is lost, nothing crashes, the queue
// ends with only the live stream, and every descriptor is released.
func TestEventQueueDropsDeadStreams(t *testing.T) {
	before := openFDs(t)
	q, err := NewEventQueue()
	if err != nil {
		t.Fatal(err)
	}
	q.Spin = 0
	const n = 6
	var br [n]*BridgeStream
	var app [n]*Stream
	for i := range br {
		if br[i], app[i], err = NewPair(Config{RxSlots: 4, TxSlots: 16, SlotSize: 128}); err != nil {
			t.Fatal(err)
		}
		if _, err := q.Add(br[i]); err != nil {
			t.Fatal(err)
		}
	}
	// 0, 1: the application sends three packets and leaves.
	for i := 0; i < 2; i++ {
		for seq := uint32(0); seq < 3; seq++ {
			app[i].Send([][]byte{seqPkt(make([]byte, 16), seq, 16)})
		}
		app[i].Close()
	}
	// 2, 3: closed on the bridge side by another goroutine while the
	// queue may be looking at them.
	closer := make(chan struct{})
	go func() {
		time.Sleep(5 * time.Millisecond)
		br[2].Close()
		br[3].Close()
		close(closer)
	}()
	// 4: the application corrupts its write index.
	app[4].Send([][]byte{{1}})
	atomic.StoreUint32(app[4].send.v.prod, 0x7fff0000)
	eventfdSignal(app[4].fds[fdTxData])

	got := make([]uint32, n)
	errs := make([]error, n)
	idOf := func(s BridgeEnd) int {
		for i := range br {
			if br[i] == s {
				return i
			}
		}
		t.Fatalf("unknown stream")
		return -1
	}
	toks := make([]int, 8)
	out := mkBufs(16, 128)
	sentLive := false
	deadline := time.Now().Add(10 * time.Second)
	for q.Len() > 1 || !sentLive || got[5] == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("queue still holds %d streams; got %v errs %v", q.Len(), got, errs)
		}
		if !sentLive && q.Len() == 1 {
			<-closer
			app[5].Send([][]byte{seqPkt(make([]byte, 16), 0, 16)})
			sentLive = true
		}
		k, err := q.Wait(toks, 100*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		for _, tok := range toks[:k] {
			s := q.Stream(tok)
			if s == nil {
				t.Fatalf("Wait handed out free token %d", tok)
			}
			id := idOf(s)
			m, err := s.TryRecv(out)
			for j := 0; j < m; j++ {
				checkSeqPkt(t, out[j], got[id], 16)
				got[id]++
			}
			if err != nil {
				errs[id] = err
			}
		}
	}
	for i := 0; i < 2; i++ {
		if got[i] != 3 || !errors.Is(errs[i], ErrPeerGone) {
			t.Errorf("stream %d: %d packets, err %v; want 3 then ErrPeerGone", i, got[i], errs[i])
		}
	}
	if !errors.Is(errs[4], ErrCorruption) {
		t.Errorf("hostile stream: err %v, want ErrCorruption", errs[4])
	}
	if q.Stream(0) != nil && q.Stream(0) != br[5] {
		t.Error("a dropped token still names its old stream")
	}
	// Close everything, in the order a careless owner might.
	for i := range br {
		br[i].Close()
		app[i].Close()
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("%d descriptors open before, %d after", before, after)
	}
}

// A queued stream closed while its queue sleeps in epoll is released by
// the queue's next Wait, without Remove.
func TestEventQueueCloseWhileWaiting(t *testing.T) {
	before := openFDs(t)
	q, err := NewEventQueue()
	if err != nil {
		t.Fatal(err)
	}
	q.Spin = 0
	b, a, err := NewPair(Config{RxSlots: 4, TxSlots: 4, SlotSize: 64})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Add(b); err != nil {
		t.Fatal(err)
	}
	toks := make([]int, 4)
	if k, _ := q.Wait(toks, 0); k != 0 { // arms the empty stream
		t.Fatalf("empty stream reported %d", k)
	}
	closed := make(chan struct{})
	go func() {
		time.Sleep(10 * time.Millisecond)
		b.Close()
		close(closed)
	}()
	if k, err := q.Wait(toks, 5*time.Second); k != 0 || err != nil {
		t.Fatalf("Wait returned %d, %v for a closed stream", k, err)
	}
	<-closed // Close itself may still be finishing after Wait saw it
	if q.Len() != 0 {
		t.Fatalf("closed stream still queued")
	}
	if _, err := q.Add(b); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add of a closed stream: %v", err)
	}
	a.Close()
	q.Close()
	if after := openFDs(t); after != before {
		t.Fatalf("%d descriptors open before, %d after", before, after)
	}
}

// countdown becomes ready on its n-th look: a condition without timing.
type countdown struct{ n int }

func (c *countdown) ready() bool { c.n--; return c.n <= 0 }

// The adaptive spin follows what waits needed: steady waits shorter than
// MaxSpin raise it to 1.5 times their length, long ones bring it back to
// Spin; a fixed waiter never moves. And the learned spin is what the next
// wait uses: it catches a condition that a fixed waiter sleeps for.
func TestWaiterAdaptiveSpin(t *testing.T) {
	fd, err := newEventfd()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var flag uint32
	w := newWaiter(fd, &flag)
	w.Spin, w.MaxSpin = 20*time.Microsecond, 200*time.Microsecond
	for i := 0; i < 40; i++ {
		w.learn(80 * time.Microsecond)
	}
	if b := w.Budget(); b < 115*time.Microsecond || b > 120*time.Microsecond {
		t.Fatalf("after steady 80 µs waits the spin is %v, want about 120 µs", b)
	}
	for i := 0; i < 40; i++ {
		w.learn(190 * time.Microsecond)
	}
	if b := w.Budget(); b > w.MaxSpin || b < w.MaxSpin-time.Microsecond {
		t.Fatalf("spin %v, want just under MaxSpin %v", b, w.MaxSpin)
	}
	for i := 0; i < 40; i++ {
		w.learn(5 * time.Millisecond)
	}
	if b := w.Budget(); b > 21*time.Microsecond {
		t.Fatalf("after long waits the spin is still %v", b)
	}
	fixed := newWaiter(fd, &flag)
	fixed.learn(80 * time.Microsecond)
	if fixed.Budget() != defaultSpin {
		t.Fatalf("a fixed waiter moved to %v", fixed.Budget())
	}

	// A learned long spin catches a condition that needs many looks;
	// a waiter that does not spin sleeps for it.
	w.Spin, w.MaxSpin, w.budget = 0, time.Second, time.Second
	if err := w.wait(&countdown{n: 10000}, time.Second); err != nil || w.Sleeps() != 0 {
		t.Fatalf("learned spin: err %v, %d sleeps", err, w.Sleeps())
	}
	fixed.Spin = 0
	fixed.wait(&countdown{n: 10000}, time.Millisecond)
	if fixed.Sleeps() == 0 {
		t.Fatal("a waiter without spin did not sleep")
	}
}
