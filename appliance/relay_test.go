package appliance

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// relayRig is a relay between a stand-in remote stream (the application
// end of a shm pair, whose other end plays the remote application: app)
// and the pair the bridge would serve (its bridge end: wire, where the
// test plays the bridge).
type relayRig struct {
	r    *relay
	app  *fabric.Stream // the remote application's side of far
	wire *fabric.Stream // the bridge's side of the relay's pair
}

func newRelayRig(t *testing.T, farCfg, pairCfg fabric.Config) *relayRig {
	t.Helper()
	app, far, err := fabric.NewPair(farCfg)
	if err != nil {
		t.Fatal(err)
	}
	r, err := newRelay(far, pairCfg)
	if err != nil {
		t.Fatal(err)
	}
	r.start()
	t.Cleanup(func() {
		r.close()
		app.Close()
	})
	return &relayRig{r: r, app: app, wire: r.bridge}
}

// ip makes a minimal IPv4-looking packet of n bytes carrying seq.
func ip(seq uint32, n int) []byte {
	p := make([]byte, n)
	p[0] = 0x45
	binary.BigEndian.PutUint32(p[4:], seq)
	for i := 8; i < n; i++ {
		p[i] = byte(seq) + byte(i)
	}
	return p
}

// sendAll queues pkts on a bridge-side stream (which never waits and
// drops what does not fit), offering the rest again until all are in.
func sendAll(t *testing.T, s *fabric.Stream, pkts [][]byte) {
	deadline := time.Now().Add(10 * time.Second)
	for len(pkts) > 0 {
		n, err := s.Send(pkts)
		if err != nil {
			t.Errorf("send: %v", err)
			return
		}
		pkts = pkts[n:]
		if len(pkts) > 0 {
			if time.Now().After(deadline) {
				t.Errorf("%d packets never fit", len(pkts))
				return
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
}

// recvN reads n packets from s and checks they are want(0..n-1) in order.
func recvN(t *testing.T, s *fabric.Stream, n int, want func(i int) []byte) {
	bufs := make([][]byte, relayBatch)
	for i := range bufs {
		bufs[i] = make([]byte, 4096)
	}
	for got := 0; got < n; {
		for i := range bufs {
			bufs[i] = bufs[i][:cap(bufs[i])]
		}
		k, err := s.RecvTimeout(bufs, 10*time.Second)
		if err != nil {
			t.Errorf("after %d of %d packets: %v", got, n, err)
			return
		}
		for _, b := range bufs[:k] {
			if w := want(got); !bytes.Equal(b, w) {
				t.Errorf("packet %d: %d bytes %x..., want %d bytes %x...", got, len(b), b[:min(12, len(b))], len(w), w[:12])
				return
			}
			got++
		}
	}
}

// TestRelayCarriesBothWays: packets cross the relay in both directions at
// once, complete and in order.
func TestRelayCarriesBothWays(t *testing.T) {
	rig := newRelayRig(t, fabric.Config{RxSlots: 256, TxSlots: 256}, fabric.Config{RxSlots: 256, TxSlots: 256})
	const n = 20000
	size := func(i int) int { return 20 + i%1400 }
	pkts := func(base uint32) [][]byte {
		out := make([][]byte, n)
		for i := range out {
			out[i] = ip(base+uint32(i), size(i))
		}
		return out
	}
	in, out := pkts(0), pkts(1<<20)
	done := make(chan struct{}, 4)
	go func() { sendAll(t, rig.wire, in); done <- struct{}{} }()
	go func() { sendAll(t, rig.app, out); done <- struct{}{} }()
	go func() { recvN(t, rig.app, n, func(i int) []byte { return in[i] }); done <- struct{}{} }()
	go func() { recvN(t, rig.wire, n, func(i int) []byte { return out[i] }); done <- struct{}{} }()
	for range 4 {
		<-done
	}
	if d := rig.r.dropped.Load(); d != 0 {
		t.Errorf("relay dropped %d", d)
	}
}

// TestRelayAllocatesNothing: a batch each way through the relay allocates
// nothing (pumps, streams and the test's own loop together).
func TestRelayAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts mean nothing under the race detector")
	}
	rig := newRelayRig(t, fabric.Config{RxSlots: 256, TxSlots: 256}, fabric.Config{RxSlots: 256, TxSlots: 256})
	batch := make([][]byte, relayBatch)
	for i := range batch {
		batch[i] = ip(uint32(i), 1000)
	}
	bufs := make([][]byte, relayBatch)
	for i := range bufs {
		bufs[i] = make([]byte, 2048)
	}
	var failed error
	recv := func(s *fabric.Stream) {
		for got := 0; got < len(batch) && failed == nil; {
			for i := range bufs {
				bufs[i] = bufs[i][:cap(bufs[i])]
			}
			k, err := s.Recv(bufs)
			if err != nil {
				failed = err
			}
			got += k
		}
	}
	round := func() {
		if n, err := rig.wire.Send(batch); n != len(batch) || err != nil {
			failed = errors.Join(failed, err, errors.New("inbound batch did not fit"))
		}
		recv(rig.app)
		if n, err := rig.app.Send(batch); n != len(batch) || err != nil {
			failed = errors.Join(failed, err, errors.New("outbound batch did not fit"))
		}
		recv(rig.wire)
	}
	round() // warm up
	if a := testing.AllocsPerRun(200, round); a != 0 {
		t.Errorf("%v allocations per round of %d packets each way", a, relayBatch)
	}
	if failed != nil {
		t.Fatal(failed)
	}
}

// TestRelayDropsWhatDoesNotFit: a packet too big for the other side is
// dropped and counted; the packets around it pass.
func TestRelayDropsWhatDoesNotFit(t *testing.T) {
	rig := newRelayRig(t, fabric.Config{SlotSize: 4096}, fabric.Config{SlotSize: 2048})
	pkts := [][]byte{ip(1, 100), ip(2, 3000), ip(3, 200), ip(4, 3500), ip(5, 300)}
	sendAll(t, rig.app, pkts)
	keep := [][]byte{pkts[0], pkts[2], pkts[4]}
	recvN(t, rig.wire, len(keep), func(i int) []byte { return keep[i] })
	if d := rig.r.dropped.Load(); d != 2 {
		t.Errorf("dropped %d, want 2", d)
	}
}

// waitPumps fails unless both pumps end within a second.
func waitPumps(t *testing.T, r *relay) {
	t.Helper()
	ended := make(chan struct{})
	go func() { r.pumps.Wait(); close(ended) }()
	select {
	case <-ended:
	case <-time.After(time.Second):
		t.Fatal("the relay's pumps still run")
	}
}

// TestRelayTeardown: the lease's end (close) and the death of the remote
// side each stop both pumps and leave both sides closed or broken.
func TestRelayTeardown(t *testing.T) {
	t.Run("LeaseEnds", func(t *testing.T) {
		rig := newRelayRig(t, fabric.Config{}, fabric.Config{})
		// Pumps are parked in Recv on both sides.
		time.Sleep(10 * time.Millisecond)
		rig.r.close()
		waitPumps(t, rig.r)
		buf := [][]byte{make([]byte, 2048)}
		if _, err := rig.app.RecvTimeout(buf, time.Second); !errors.Is(err, fabric.ErrBroken) {
			t.Errorf("remote application's stream after the lease ended: %v, want broken", err)
		}
		if err := rig.wire.Err(); !errors.Is(err, fabric.ErrClosed) {
			t.Errorf("bridge end after the lease ended: %v, want closed", err)
		}
	})
	t.Run("RemoteDies", func(t *testing.T) {
		rig := newRelayRig(t, fabric.Config{}, fabric.Config{})
		sendAll(t, rig.app, [][]byte{ip(1, 100)})
		recvN(t, rig.wire, 1, func(int) []byte { return ip(1, 100) })
		rig.app.Close()
		waitPumps(t, rig.r)
		if h := rig.r.health(); h != fabric.Broken {
			t.Errorf("health %v after the remote side died, want broken", h)
		}
		buf := [][]byte{make([]byte, 2048)}
		if _, err := rig.wire.RecvTimeout(buf, time.Second); !errors.Is(err, fabric.ErrBroken) {
			t.Errorf("bridge end after the remote side died: %v, want broken", err)
		}
		rig.r.close() // the lease's end still comes, and finds nothing to do
	})
}

// BenchmarkRelay moves 1000-byte packets from the bridge's side of the pair
// through the relay to the remote side (shm stand-in), a batch at a time:
// the relay's own cost per packet (one Recv, one Send, one copy each).
func BenchmarkRelay(b *testing.B) {
	app, far, err := fabric.NewPair(fabric.Config{})
	if err != nil {
		b.Fatal(err)
	}
	r, err := newRelay(far, fabric.Config{})
	if err != nil {
		b.Fatal(err)
	}
	r.start()
	defer func() { r.close(); app.Close() }()
	batch := make([][]byte, relayBatch)
	for i := range batch {
		batch[i] = ip(uint32(i), 1000)
	}
	bufs := make([][]byte, relayBatch)
	for i := range bufs {
		bufs[i] = make([]byte, 2048)
	}
	round := func() {
		if n, _ := r.bridge.Send(batch); n != len(batch) {
			b.Fatalf("%d of %d fit", n, len(batch))
		}
		for got := 0; got < len(batch); {
			for i := range bufs {
				bufs[i] = bufs[i][:cap(bufs[i])]
			}
			k, err := app.Recv(bufs)
			if err != nil {
				b.Fatal(err)
			}
			got += k
		}
	}
	round() // the pump has its buffers
	b.SetBytes(int64(relayBatch * 1000))
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		round()
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*relayBatch), "ns/packet")
}
