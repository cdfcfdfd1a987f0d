package bridge

import (
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// threadLog is a capture hook that records which OS thread handled each
// packet, by direction.
type threadLog struct {
	mu   sync.Mutex
	tids [2]map[int]int // direction → thread id → packets
}

func (l *threadLog) hook(dir Direction, _ []byte, _ time.Time) {
	tid := unix.Gettid()
	l.mu.Lock()
	if l.tids[dir] == nil {
		l.tids[dir] = map[int]int{}
	}
	l.tids[dir][tid]++
	l.mu.Unlock()
}

func (l *threadLog) threads(dir Direction) []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []int
	for tid := range l.tids[dir] {
		out = append(out, tid)
	}
	slices.Sort(out)
	return out
}

// TestOneThreadServesBothDirections: a queue's RX and TX run on one locked
// OS thread. The capture hook runs on the data path, so the thread it runs
// on is the thread that delivered (inbound) or verified and sent
// (outbound) the packet: over traffic in both directions at once, both
// directions must see exactly one thread, the same one, the queue's loop.
// With an RX loop and a TX loop per queue this sees two threads.
func TestOneThreadServesBothDirections(t *testing.T) {
	forEachPath(t, func(t *testing.T, cfg Config) {
		r := newRig(t, cfg)
		r.standardTables()
		app := r.stream(1, r.ownership1(), fabric.Config{})
		var log threadLog
		if err := r.b.SetCapture(1, log.hook); err != nil {
			t.Fatal(err)
		}
		if _, err := r.out.Ping(r.local4, 1, 3*time.Second); err != nil {
			t.Fatal(err)
		}
		r.waitNeighbour(r.remote4)
		sock := udpSocket(t, r.out, netip.AddrPortFrom(r.remote4, remotePort))
		from, to := netip.AddrPortFrom(r.local4, udpPort1), netip.AddrPortFrom(r.remote4, remotePort)
		const rounds, each = 10, 20
		buf := make([]byte, 2048)
		for round := range rounds {
			// Both directions in flight together.
			var out [][]byte
			for _, p := range payloads(each, "out") {
				out = append(out, ippkt.UDP(from, to, p))
			}
			sendTo(t, sock, from, payloads(each, "in"))
			if _, err := app.Send(out); err != nil {
				t.Fatal(err)
			}
			if got := recvN(t, app, each, 3*time.Second); len(got) != each {
				t.Fatalf("round %d: the stream got %d of %d", round, len(got), each)
			}
			for i := range each {
				sock.SetReadDeadline(time.Now().Add(3 * time.Second))
				if _, err := sock.Read(buf); err != nil {
					t.Fatalf("round %d: the outside got %d of %d: %v", round, i, each, err)
				}
			}
		}
		s := r.eventually(func(s Stats) bool {
			return s.Streams[0].TxPackets >= rounds*each && s.Streams[0].RxPackets >= rounds*each
		})
		in, out := log.threads(Inbound), log.threads(Outbound)
		loop := int(r.b.queues[0].tid.Load())
		t.Logf("inbound on threads %v, outbound on %v, the queue's loop is %d", in, out, loop)
		if len(in) != 1 || !slices.Equal(in, out) || in[0] != loop {
			t.Fatalf("inbound packets were handled on threads %v, outbound on %v: want both on the queue's loop thread %d only", in, out, loop)
		}
		if st := s.Streams[0]; st.RxPackets != rounds*each || st.TxPackets != rounds*each {
			t.Fatalf("stream counters %+v, want %d each way", st, rounds*each)
		}
	})
}
