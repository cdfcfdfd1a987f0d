package fabric

import (
	"encoding/binary"
	"errors"
	"sync"
	"testing"
	"time"
)

// tagPkt writes sender id and sequence number into a packet and fills the
// rest with a pattern derived from both, so a torn or mixed record shows.
func tagPkt(buf []byte, id, seq uint32, size int) []byte {
	buf = buf[:size]
	binary.LittleEndian.PutUint32(buf, id)
	binary.LittleEndian.PutUint32(buf[4:], seq)
	for i := 8; i < size; i++ {
		buf[i] = byte(id*31 + seq + uint32(i))
	}
	return buf
}

func untagPkt(t testing.TB, pkt []byte) (id, seq uint32) {
	if len(pkt) < 8 {
		t.Errorf("packet of %d bytes", len(pkt))
		return 0, 0
	}
	id, seq = binary.LittleEndian.Uint32(pkt), binary.LittleEndian.Uint32(pkt[4:])
	for i := 8; i < len(pkt); i++ {
		if pkt[i] != byte(id*31+seq+uint32(i)) {
			t.Errorf("sender %d packet %d: byte %d corrupted", id, seq, i)
			return id, seq
		}
	}
	return id, seq
}

// Several goroutines send on one side of a stream at once while several
// receive on the other, in both directions: the gates serialise them, so
// no record is torn or lost, each receiver sees every sender's packets in
// that sender's order, every packet arrives exactly once (application to
// bridge, backpressured), sent = received + dropped (bridge to
// application, dropping), and the counters are exact.
func TestStreamConcurrentCallers(t *testing.T) {
	const senders, receivers, perSender = 4, 2, 3000
	for _, dir := range []string{"app-to-bridge", "bridge-to-app"} {
		t.Run(dir, func(t *testing.T) {
			b, a := newTestPair(t, Config{RxSlots: 16, TxSlots: 16, SlotSize: 256})
			tx, rx := &a.end, &b.end
			if dir == "bridge-to-app" {
				tx, rx = &b.end, &a.end
			}
			var sendWG, recvWG sync.WaitGroup
			attempted := make([]uint64, senders)
			for id := range senders {
				sendWG.Add(1)
				go func() {
					defer sendWG.Done()
					in := mkBufs(5, 200)
					pk := make([][]byte, 5)
					for seq := 0; seq < perSender; {
						k := min(1+seq%5, perSender-seq)
						for i := range k {
							pk[i] = tagPkt(in[i], uint32(id), uint32(seq+i), 8+(seq+i)%190)
						}
						n, err := tx.sendMeta(pk[:k], nil)
						if err != nil {
							t.Errorf("sender %d: %v", id, err)
							return
						}
						if !tx.bridge && n != k {
							t.Errorf("sender %d: blocking Send queued %d of %d", id, n, k)
							return
						}
						attempted[id] += uint64(k)
						seq += k
						if tx.bridge && seq%40 < 5 {
							time.Sleep(20 * time.Microsecond) // let some through
						}
					}
				}()
			}
			var mu sync.Mutex
			seen := make([]map[uint32]bool, senders)
			for i := range seen {
				seen[i] = map[uint32]bool{}
			}
			var got uint64
			stop := make(chan struct{})
			for r := range receivers {
				recvWG.Add(1)
				go func() {
					defer recvWG.Done()
					out := mkBufs(7, 256)
					last := make([]int64, senders)
					for i := range last {
						last[i] = -1
					}
					for {
						var n int
						var err error
						if r%2 == 0 {
							n, err = rx.RecvTimeout(out[:1+r], 2*time.Millisecond)
						} else {
							n, err = rx.TryRecv(out)
						}
						if errors.Is(err, ErrTimeout) || (err == nil && n == 0) {
							select {
							case <-stop:
								return
							default:
								continue
							}
						}
						if err != nil {
							t.Errorf("receiver %d: %v", r, err)
							return
						}
						mu.Lock()
						for _, p := range out[:n] {
							id, seq := untagPkt(t, p)
							if id >= senders {
								t.Errorf("receiver %d: sender id %d", r, id)
								continue
							}
							if int64(seq) <= last[id] {
								t.Errorf("receiver %d: sender %d packet %d after %d", r, id, seq, last[id])
							}
							if seen[id][seq] {
								t.Errorf("sender %d packet %d received twice", id, seq)
							}
							last[id] = int64(seq)
							seen[id][seq] = true
						}
						got += uint64(n)
						mu.Unlock()
					}
				}()
			}
			sendWG.Wait()
			// Let the receivers drain, then stop them.
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) {
				mu.Lock()
				g := got
				mu.Unlock()
				if g == tx.Stats().Sent {
					break
				}
				time.Sleep(time.Millisecond)
			}
			close(stop)
			recvWG.Wait()
			var total uint64
			for _, n := range attempted {
				total += n
			}
			ts, rs := tx.Stats(), rx.Stats()
			if ts.Sent+ts.Dropped != total {
				t.Fatalf("sent %d + dropped %d, attempted %d", ts.Sent, ts.Dropped, total)
			}
			if rs.Received != got || got != ts.Sent {
				t.Fatalf("received: counter %d, counted %d, sent %d", rs.Received, got, ts.Sent)
			}
			if !tx.bridge && ts.Dropped != 0 {
				t.Fatalf("backpressured direction dropped %d", ts.Dropped)
			}
			t.Logf("attempted %d, sent %d, dropped %d, sender sleeps %d, receiver sleeps %d", total, ts.Sent, ts.Dropped, ts.Sleeps, rs.Sleeps)
		})
	}
}

// Close, from any goroutine, while both sides are busy in every kind of
// call — senders blocked on a full ring with others queued behind them,
// receivers asleep or polling — makes every call return ErrClosed or
// ErrBroken promptly, Close itself returns, and nothing touches the region
// after it is unmapped (that would be a SIGSEGV, not a test failure).
// Many rounds with varying timing, meant for -race too.
func TestStreamCloseUnderCalls(t *testing.T) {
	rounds := 60
	if testing.Short() {
		rounds = 10
	}
	for round := range rounds {
		b, a, err := NewPair(Config{RxSlots: 8, TxSlots: 8, SlotSize: 128})
		if err != nil {
			t.Fatal(err)
		}
		a.sendWait.Spin = time.Duration(round%3) * 5 * time.Microsecond
		a.recvWait.Spin = time.Duration(round%2) * 10 * time.Microsecond
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		loop := func(f func() error) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					if err := f(); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		for range 3 { // app senders: the bridge receives slowly, so they block
			pk := mkBufs(3, 64)
			loop(func() error { _, err := a.Send(pk); return err })
		}
		{
			out := mkBufs(1, 128)
			loop(func() error {
				_, err := b.TryRecv(out)
				time.Sleep(20 * time.Microsecond)
				return err
			})
		}
		for range 2 { // bridge senders, dropping
			pk := mkBufs(2, 64)
			loop(func() error {
				_, err := b.Send(pk)
				time.Sleep(5 * time.Microsecond)
				return err
			})
		}
		for i := range 2 { // app receivers, sleeping or polling
			out := mkBufs(4, 128)
			loop(func() error {
				var err error
				if i == 0 {
					_, err = a.Recv(out)
				} else {
					_, err = a.RecvTimeout(out, 100*time.Microsecond)
					if errors.Is(err, ErrTimeout) {
						err = nil
					}
				}
				return err
			})
		}
		time.Sleep(time.Duration(round%7) * 300 * time.Microsecond)
		var first, second interface{ Close() error } = a, b
		if round%2 == 1 {
			first, second = b, a
		}
		closed := make(chan struct{})
		go func() {
			first.Close()
			time.Sleep(time.Duration(round%5) * 100 * time.Microsecond)
			second.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: Close did not return", round)
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: calls still running after Close", round)
		}
		close(errs)
		for err := range errs {
			if !errors.Is(err, ErrClosed) && !errors.Is(err, ErrBroken) {
				t.Fatalf("round %d: call returned %v, want ErrClosed or ErrBroken", round, err)
			}
		}
		// Calls after Close fail without touching the (unmapped) region.
		if _, err := a.Send([][]byte{{1}}); !errors.Is(err, ErrClosed) {
			t.Fatalf("Send after Close: %v", err)
		}
		if _, err := b.TryRecv(mkBufs(1, 64)); !errors.Is(err, ErrClosed) {
			t.Fatalf("TryRecv after Close: %v", err)
		}
	}
}

// A Send that blocks for space has already counted what it queued, so
// Stats is exact while it waits, not only after it returns.
func TestStreamStatsExactWhileSendBlocks(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 8, TxSlots: 8, SlotSize: 128})
	a.sendWait.Spin = 0
	res := make(chan int, 1)
	go func() {
		n, err := a.Send(mkBufs(12, 120)) // full-size: 9 fit the (8+1) x 128-byte data area
		if err != nil {
			t.Error(err)
		}
		res <- n
	}()
	deadline := time.Now().Add(5 * time.Second)
	for a.Stats().Sleeps == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if st := a.Stats(); st.Sleeps == 0 || st.Sent != 9 {
		t.Fatalf("while blocked: sent %d, sleeps %d; want 9 sent and a sleep", st.Sent, st.Sleeps)
	}
	out := mkBufs(16, 128)
	got := 0
	for got < 12 && time.Now().Before(deadline) {
		n, err := b.RecvTimeout(out, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		got += n
	}
	if n := <-res; n != 12 {
		t.Fatalf("Send returned %d, want 12", n)
	}
	if s, r := a.Stats().Sent, b.Stats().Received; s != 12 || r != 12 {
		t.Fatalf("sent %d received %d, want 12 and 12", s, r)
	}
}

// A call that panics (here SendMeta given fewer metadata words than
// packets, a caller's bug) writes nothing and leaves through its deferred
// exit: the stream keeps working for the next caller and Close still
// returns.
func TestStreamPanicLeavesGateOpen(t *testing.T) {
	b, a := newTestPair(t, Config{RxSlots: 8, TxSlots: 8, SlotSize: 128})
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("short meta slice did not panic")
			}
		}()
		b.SendMeta(mkBufs(2, 64), make([]uint32, 1))
	}()
	done := make(chan error, 1)
	go func() {
		_, err := b.Send(mkBufs(1, 64))
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Send after a panicking SendMeta never entered")
	}
	// The panicking call wrote nothing: exactly the one packet after it
	// is there, and counted.
	if n, err := a.TryRecv(mkBufs(4, 128)); n != 1 || err != nil {
		t.Fatalf("received %d (%v), want the 1 packet sent after the panic", n, err)
	}
	if st := b.Stats(); st.Sent != 1 {
		t.Fatalf("sent %d, want 1", st.Sent)
	}
	closed := make(chan struct{})
	go func() { b.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close after a panicking SendMeta never returned")
	}
}

// Health and peerDrops, called from another goroutine (the bridge's
// metrics loop) while the stream is closed, never read the region after
// it is unmapped (that would be a SIGSEGV). The window is small, so this
// runs many rounds; without lifeMu around those reads it crashed in three
// runs of three.
func TestStreamHealthDuringClose(t *testing.T) {
	rounds := 300
	if testing.Short() {
		rounds = 30
	}
	for range rounds {
		b, a, err := NewPair(Config{RxSlots: 2, TxSlots: 2, SlotSize: 128})
		if err != nil {
			t.Fatal(err)
		}
		var stop sync.WaitGroup
		quit := make(chan struct{})
		for _, s := range []*end{&a.end, &b.end} {
			stop.Add(1)
			go func() {
				defer stop.Done()
				for {
					select {
					case <-quit:
						return
					default:
					}
					s.Health()
					s.peerDrops()
				}
			}()
		}
		a.Close()
		b.Close()
		if a.Health() != Broken || b.Health() != Broken {
			t.Fatal("closed streams not broken")
		}
		close(quit)
		stop.Wait()
	}
}
