package fabric

import (
	"errors"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"golang.org/x/sys/unix"
)

// offerAll hands pkts to a bridge end the way the bridge's loop would,
// offering again whatever it dropped for want of credit until all went.
func offerAll(b BridgeEnd, pkts [][]byte) error { return offerAllMeta(b, pkts, nil) }

// offerAllMeta is offerAll with metadata words (meta may be nil).
func offerAllMeta(b BridgeEnd, pkts [][]byte, meta []uint32) error {
	deadline := time.Now().Add(10 * time.Second)
	for len(pkts) > 0 {
		n, err := b.SendMeta(pkts, meta)
		if err != nil {
			return err
		}
		pkts = pkts[n:]
		if meta != nil {
			meta = meta[n:]
		}
		if len(pkts) > 0 {
			if time.Now().After(deadline) {
				return errors.New("packets never found credit")
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
	return nil
}

// queueOf puts end alone in a new EventQueue, closed with the test.
func queueOf(t testing.TB, end BridgeEnd) *EventQueue {
	t.Helper()
	q, err := NewEventQueue()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	if _, err := q.Add(end); err != nil {
		t.Fatal(err)
	}
	return q
}

// drainQueued takes packets [from, to) from a bridge end through an
// EventQueue, as the bridge's TX side does, and checks each byte.
func drainQueued(t *testing.T, q *EventQueue, v6 bool, from, to int) {
	t.Helper()
	out := mkBufs(64, 2048)
	want := make([]byte, 1500)
	toks := make([]int, 8)
	deadline := time.Now().Add(10 * time.Second)
	for got := from; got < to; {
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d packets", got-from, to-from)
		}
		k, err := q.Wait(toks, 100*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		for _, tok := range toks[:k] {
			n, err := q.Stream(tok).TryRecv(out)
			if err != nil {
				t.Fatalf("after %d packets: %v", got-from, err)
			}
			for i := 0; i < n; i++ {
				if string(out[i]) != string(ipPkt(want, v6, uint32(got), runSize(got))) {
					t.Fatalf("packet %d differs (len %d)", got, len(out[i]))
				}
				got++
			}
		}
	}
}

// The bridge serves a remote stream through its bridge end in both
// directions at once, with credits small enough that the bridge's
// deliveries run out of them: every packet arrives, complete and in order,
// once offered again after a drop.
func TestRemoteBridgeCarriesBothWays(t *testing.T) {
	testenv.RequirePrivileged(t)
	x := newRemotes(t, false, RemoteConfig{Depth: 128}, RemoteConfig{Depth: 128})
	sa, sb := x.pair(t, 7)
	br := sa.Bridge()
	q := queueOf(t, br)
	const n = 20000
	in := make([][]byte, n)
	for i := range in {
		in[i] = ipPkt(make([]byte, runSize(i)), false, uint32(i), runSize(i))
	}
	errc := make(chan error, 2)
	go func() {
		for i := 0; i < n; i += 64 {
			if err := offerAll(br, in[i:min(i+64, n)]); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	go func() { errc <- sendSeq(sb, false, 0, n, 0) }()
	recvSeq(t, sb, x.rb, false, 0, n, 0)
	drainQueued(t, q, false, 0, n)
	for range 2 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("bridge end dropped %d for want of credit; counters %+v", sa.dropped.Load(), x.rb.Counters())
}

// A batch each way through a bridge end allocates nothing (both Remote
// loops included).
func TestRemoteBridgeAllocatesNothing(t *testing.T) {
	testenv.RequirePrivileged(t)
	if raceEnabled {
		t.Skip("allocation counts mean nothing under the race detector")
	}
	x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{})
	sa, sb := x.pair(t, 8)
	br := sa.Bridge()
	pk := make([][]byte, 16)
	for i := range pk {
		pk[i] = ipPkt(make([]byte, 1000), false, uint32(i), 1000)
	}
	out := mkBufs(64, 2048)
	round := func() {
		if n, err := br.SendMeta(pk, nil); n != len(pk) || err != nil {
			t.Fatal(n, err)
		}
		for got := 0; got < len(pk); {
			n, err := sb.RecvTimeout(out, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			got += n
		}
		if n, err := sb.Send(pk); n != len(pk) || err != nil {
			t.Fatal(n, err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for got := 0; got < len(pk); {
			n, err := br.TryRecv(out)
			if err != nil || time.Now().After(deadline) {
				t.Fatal(got, err)
			}
			got += n
		}
	}
	round()
	if a := testing.AllocsPerRun(50, round); a != 0 {
		t.Fatalf("%v allocations per round of %d packets each way", a, len(pk))
	}
}

// Without credit the bridge end drops instead of waiting, counts what it
// dropped and turns Sick; once the application reads, credit returns and
// packets go again.
func TestRemoteBridgeDropsWithoutCredit(t *testing.T) {
	testenv.RequirePrivileged(t)
	x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{Depth: 64, High: 48, Low: 16})
	sa, sb := x.pair(t, 9)
	// The bridge's end learns the application's water marks from its own
	// configuration: give it the application's.
	sa.gate.high, sa.gate.low = 48, 16
	br := sa.Bridge()
	pk := make([][]byte, 100)
	for i := range pk {
		pk[i] = ipPkt(make([]byte, 200), false, uint32(i), 200)
	}
	start := time.Now()
	n, err := br.SendMeta(pk, nil)
	if err != nil || n != 48 {
		t.Fatalf("sent %d (%v), want the 48 the credit covers", n, err)
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Errorf("a send without credit took %v: it waited", took)
	}
	if d := sa.dropped.Load(); d != 52 {
		t.Errorf("dropped %d, want 52", d)
	}
	if h := br.Health(); h != Sick {
		t.Errorf("health %v after drops, want sick", h)
	}
	recvSeq(t, sb, x.rb, false, 0, 48, 200)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if n, err := br.SendMeta(pk[:1], nil); err != nil || n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("credit never came back")
		}
		time.Sleep(time.Millisecond)
	}
	br.Tick()
	br.Tick()
	if h := br.Health(); h != Normal {
		t.Errorf("health %v two ticks after the last drop, want normal", h)
	}
}

// The lease's end (the bridge closes its end) and the application's death
// (it closes its stream) each leave both ends closed or broken, and the
// bridge drains what the application sent before it left.
func TestRemoteBridgeTeardown(t *testing.T) {
	testenv.RequirePrivileged(t)
	t.Run("LeaseEnds", func(t *testing.T) {
		x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{})
		sa, sb := x.pair(t, 10)
		br := sa.Bridge()
		br.Close()
		if _, err := sb.RecvTimeout(mkBufs(1, 2048), 5*time.Second); !errors.Is(err, ErrBroken) || !errors.Is(err, ErrPeerGone) {
			t.Errorf("application's stream after the lease ended: %v, want broken, peer gone", err)
		}
		if err := br.Err(); !errors.Is(err, ErrClosed) {
			t.Errorf("bridge end after the lease ended: %v, want closed", err)
		}
	})
	t.Run("RemoteDies", func(t *testing.T) {
		x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{})
		sa, sb := x.pair(t, 11)
		br := sa.Bridge()
		q := queueOf(t, br)
		if err := sendSeq(sb, false, 0, 3, 0); err != nil {
			t.Fatal(err)
		}
		sb.Close()
		drainQueued(t, q, false, 0, 3)
		deadline := time.Now().Add(5 * time.Second)
		for br.Health() != Broken {
			if time.Now().After(deadline) {
				t.Fatal("bridge end never broke after the application left")
			}
			time.Sleep(time.Millisecond)
		}
		if _, err := br.TryRecv(mkBufs(1, 2048)); !errors.Is(err, ErrPeerGone) {
			t.Errorf("bridge end after the application left: %v, want peer gone", err)
		}
		if q.Len() != 1 {
			t.Errorf("queue dropped a broken end before the bridge saw its error")
		}
	})
}

// A remote stream closed while an EventQueue holds its bridge end keeps its
// eventfd until the queue lets go, so that the queue never polls or
// deregisters a descriptor that may already name another file.
func TestRemoteBridgeQueueReleasesLate(t *testing.T) {
	testenv.RequirePrivileged(t)
	x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{})
	sa, _ := x.pair(t, 12)
	q := queueOf(t, sa.Bridge())
	open := func() bool { _, err := unix.FcntlInt(uintptr(sa.efd), unix.F_GETFD, 0); return err == nil }
	sa.Close()
	if !open() {
		t.Fatal("eventfd closed while the queue holds the stream")
	}
	if _, err := q.Wait(make([]int, 4), 0); err != nil {
		t.Fatal(err)
	}
	if q.Len() != 0 {
		t.Fatalf("queue still holds %d ends after one was closed", q.Len())
	}
	if open() {
		t.Fatal("eventfd still open after the queue let go")
	}
}

// A packet larger than the stream carries is dropped and counted; the
// packets around it go.
func TestRemoteBridgeDropsWhatDoesNotFit(t *testing.T) {
	testenv.RequirePrivileged(t)
	x := newRemotes(t, false, RemoteConfig{SlotSize: 1024}, RemoteConfig{SlotSize: 1024})
	sa, sb := x.pair(t, 13)
	pkts := [][]byte{
		ipPkt(make([]byte, 100), false, 0, 100),
		ipPkt(make([]byte, 1500), false, 99, 1500),
		ipPkt(make([]byte, 100), false, 1, 100),
	}
	if n, err := sa.Bridge().SendMeta(pkts, nil); n != 3 || err != nil {
		t.Fatalf("SendMeta: %d, %v; want all three taken", n, err)
	}
	if d := sa.dropped.Load(); d != 1 {
		t.Errorf("dropped %d, want 1", d)
	}
	recvSeq(t, sb, x.rb, false, 0, 2, 100)
}
