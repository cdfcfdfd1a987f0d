package userstack

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	_ "unsafe" // go:linkname

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// monoNow is CLOCK_MONOTONIC in ns: the clock the XDP program stamps
// frames with and that every process shares (the runtime reads it through
// the vDSO).
//
//go:linkname monoNow runtime.nanotime
func monoNow() int64

// wallOffset turns the bridge's capture timestamps (wall time made from a
// CLOCK_MONOTONIC stamp by an offset taken once) back into that clock; it
// is taken the same way, as the tightest of a few readings.
var wallOffset = func() int64 {
	best, off := int64(1<<62), int64(0)
	for range 20 {
		a := monoNow()
		w := time.Now().UnixNano()
		z := monoNow()
		if z-a < best {
			best, off = z-a, w-(a+z)/2
		}
	}
	return off
}()

func wallToMono(t time.Time) int64 { return t.UnixNano() - wallOffset }

// timedRoundTrips is roundTrips reporting each exchange's start and end.
func timedRoundTrips(addr string, count int) ([][2]int64, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	b := []byte{7}
	var spans [][2]int64
	for i := range count + 100 {
		start := monoNow()
		if _, err := c.Write(b); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(c, b); err != nil {
			return nil, err
		}
		if i >= 100 {
			spans = append(spans, [2]int64{start, monoNow()})
		}
	}
	return spans, nil
}

// The points of a round trip, in the order a request and its answer pass
// them. The application's own (hop) come from the hop tracer (trace.go);
// the bridge's from its capture hook; the ends from the client process.
const (
	ptClientWrite  = iota // the client process writes the request
	ptXDP                 // the XDP program sees it (its timestamp)
	ptRecv                // hopRecv: the application's receive loop has it
	ptDelivered           // hopDelivered
	ptReadable            // hopReadable
	ptServerRead          // the server's Read returns
	ptWriteData           // hopWriteData: the answer reaches the link
	ptSentData            // hopSentData
	ptBridgeTxData        // the bridge's TX loop has the answer (before its checks)
	ptClientRead          // the client process has read the answer
	ptWrite               // side line: the first WritePackets (gVisor's ACK)
	ptBridgeTxAck         // side line: the bridge's TX loop has that ACK
	ptBridgeRx            // side line: the bridge's RX hook ran, after it filled the stream (a woken application thread may run first)
	ptCount
)

var ptNames = [ptCount]string{"client write", "XDP", "app Recv", "app delivered",
	"gVisor readable", "server Read", "app WritePackets", "app in TX ring", "bridge TX loop", "client read",
	"(ACK WritePackets)", "(ACK at bridge TX)", "(bridge RX hook)"}

// event is one point passed at time t (CLOCK_MONOTONIC ns).
type event struct {
	t  int64
	pt uint8
}

// eventLog gathers timestamped points from any goroutine without locks.
type eventLog struct {
	n  atomic.Int64
	ev [1 << 20]event
}

func (l *eventLog) add(pt int, t int64) {
	i := l.n.Add(1) - 1
	if i < int64(len(l.ev)) {
		l.ev[i] = event{t: t, pt: uint8(pt)}
	}
}

// take returns what was logged and starts over. Call it while nothing is
// being logged.
func (l *eventLog) take() []event {
	n := min(int(l.n.Load()), len(l.ev))
	evs := slices.Clone(l.ev[:n])
	l.n.Store(0)
	return evs
}

// benchLog, when set, receives the points of this process: the
// application's hops and rrServer's reads.
var benchLog atomic.Pointer[eventLog]

// appPoint maps the package's hops to points.
var appPoint = [...]int{hopRecv: ptRecv, hopDelivered: ptDelivered, hopReadable: ptReadable,
	hopWrite: ptWrite, hopWriteData: ptWriteData, hopSentData: ptSentData}

// traceInto sends this process's points to l.
func traceInto(l *eventLog) {
	benchLog.Store(l)
	trace := func(h hop) { l.add(appPoint[h], monoNow()) }
	hopTrace.Store(&trace)
}

// oneBatchLink hands out its packets on the first Recv and ends the
// receive loop on the next.
type oneBatchLink struct {
	replayLink
	given bool
}

func (l *oneBatchLink) Recv(bufs [][]byte) (int, error) {
	if l.given {
		return 0, io.EOF
	}
	l.given = true
	return l.replayLink.Recv(bufs)
}

// TestHopTracerSeesEveryHop checks the points BenchmarkRoundTripHops
// attributes: a traced endpoint reports each hop, in the order packets
// pass them, and passes every packet through both ways; a stack opened
// without a tracer attaches the endpoint itself.
func TestHopTracerSeesEveryHop(t *testing.T) {
	var pkts [][]byte
	for port := range uint16(3) {
		pkts = append(pkts, ippkt.UDP(netip.AddrPortFrom(dst4, 53+port), netip.AddrPortFrom(src4, 40000), pattern(100)))
	}
	link := &oneBatchLink{replayLink: replayLink{pkts: pkts}}
	ep, err := NewLinkEndpoint(link, LinkConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if got := withHopTrace(ep); got != stack.LinkEndpoint(ep) {
		t.Fatalf("without a tracer the stack attaches %T, not the endpoint", got)
	}

	var hops []hop // the receive loop appends until Done, the test after
	tracer := traceHops(ep, func(h hop) { hops = append(hops, h) })
	d := &countingDispatcher{}
	tracer.Attach(d)
	<-ep.Done()
	want := []hop{hopRecv, hopDelivered, hopDelivered, hopDelivered}
	if !slices.Equal(hops, want) || d.packets != len(pkts) {
		t.Fatalf("receiving %d packets: hops %v, %d delivered; want hops %v", len(pkts), hops, d.packets, want)
	}

	hops = nil
	send := func(payload []byte) {
		var l stack.PacketBufferList
		pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithData(payload)})
		l.PushBack(pkt)
		if n, err := tracer.WritePackets(l); n != 1 || err != nil {
			t.Fatalf("WritePackets: %d, %v", n, err)
		}
		pkt.DecRef()
	}
	send(nil)
	send(pkts[0])
	want = []hop{hopWrite, hopWrite, hopWriteData, hopSentData}
	if !slices.Equal(hops, want) {
		t.Fatalf("writing a packet without, then one with payload: hops %v, want %v", hops, want)
	}
	if s := ep.Stats(); s.TxPackets != 2 {
		t.Fatalf("%d packets reached the link, want 2", s.TxPackets)
	}
}

// BenchmarkRoundTripHops attributes the 1-byte round trip of
// BenchmarkEndToEnd's userstack path hop by hop, with the application in
// the bridge's process and in a process of its own: for each exchange it
// takes the first time each point was passed between the client's write
// and its read, and prints each point's median offset and the median step
// from the previous point.
// Run: go test -run '^$' -bench RoundTripHops -benchtime 1x ./userstack
func BenchmarkRoundTripHops(b *testing.B) {
	log := new(eventLog)
	traceInto(log)
	b.Cleanup(func() {
		hopTrace.Store(nil)
		benchLog.Store(nil)
	})

	e := newE2E(b)
	s := e.open(false)
	l, err := s.Listen("tcp", ":5007")
	if err != nil {
		b.Fatal(err)
	}
	go rrServer(l)
	helper := startHelper(b, e.path, true)
	for _, app := range e.srv.Apps() {
		if err := e.b.SetCapture(app.Stream, func(dir bridge.Direction, pkt []byte, ts time.Time) {
			now := monoNow()
			if dir == bridge.Inbound {
				log.add(ptXDP, wallToMono(ts))
				log.add(ptBridgeRx, now)
				return
			}
			if tcpPayload(pkt) > 0 {
				log.add(ptBridgeTxData, now)
			} else {
				log.add(ptBridgeTxAck, now)
			}
		}); err != nil {
			b.Fatal(err)
		}
	}
	client := startClient(b, e)
	const count = 3000
	for b.Loop() {
		for _, where := range []struct {
			name string
			port uint16
		}{{"bridge's process", 5007}, {"own process", 5006}} {
			log.take()
			line, err := client.do(fmt.Sprint("rrt ", netip.AddrPortFrom(e.local4, where.port), " ", count))
			if err != nil {
				b.Fatal(err)
			}
			var spans [][2]int64
			f := strings.Fields(line)
			for i := 0; i+1 < len(f); i += 2 {
				var sp [2]int64
				fmt.Sscan(f[i], &sp[0])
				fmt.Sscan(f[i+1], &sp[1])
				spans = append(spans, sp)
			}
			evs := log.take()
			if where.port == 5006 {
				app, err := helper.events()
				if err != nil {
					b.Fatal(err)
				}
				evs = append(evs, app...)
			}
			fmt.Printf("application in the %s: ", where.name)
			fmt.Print(attribute(spans, evs))
		}
	}
}

// attribute finds, for each exchange, the first time each point was passed
// within it, and tabulates the medians.
func attribute(spans [][2]int64, evs []event) string {
	slices.SortFunc(evs, func(a, b event) int { return int(a.t - b.t) })
	// at[p][i]: offset of point p in exchange i from its start, -1 if the
	// point was not passed within the exchange.
	var at [ptCount][]int64
	j := 0
	for _, sp := range spans {
		for j < len(evs) && evs[j].t < sp[0] {
			j++
		}
		var first [ptCount]int64
		for p := range first {
			first[p] = -1
		}
		first[ptClientWrite], first[ptClientRead] = 0, sp[1]-sp[0]
		for k := j; k < len(evs) && evs[k].t <= sp[1]; k++ {
			if p := evs[k].pt; first[p] < 0 {
				first[p] = evs[k].t - sp[0]
			}
		}
		for p := range at {
			at[p] = append(at[p], first[p])
		}
	}
	med := func(v []int64) (float64, int) {
		var ok []int64
		for _, x := range v {
			if x >= 0 {
				ok = append(ok, x)
			}
		}
		if len(ok) == 0 {
			return 0, len(v)
		}
		slices.Sort(ok)
		return float64(ok[len(ok)/2]) / 1e3, len(v) - len(ok)
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d exchanges; offsets from the client's write, µs (median; step = median over exchanges of this point minus the previous one)\n", len(spans))
	for p := range ptCount {
		off, missing := med(at[p])
		var steps []int64
		if p > 0 && p < ptWrite {
			for i := range at[p] {
				if at[p][i] >= 0 && at[p-1][i] >= 0 {
					steps = append(steps, at[p][i]-at[p-1][i])
				}
			}
		}
		step, _ := med(steps)
		fmt.Fprintf(&sb, "  %-20s %7.1f   step %6.1f   missing %d\n", ptNames[p], off, step, missing)
	}
	return sb.String()
}

// tcpPayload is the TCP payload length of an IPv4 or IPv6 packet without
// extension headers, 0 for anything else.
func tcpPayload(p []byte) int {
	if len(p) < 40 {
		return 0
	}
	var l4 int
	switch p[0] >> 4 {
	case 4:
		if p[9] != unix.IPPROTO_TCP {
			return 0
		}
		l4 = int(p[0]&0xf) * 4
	case 6:
		if p[6] != unix.IPPROTO_TCP {
			return 0
		}
		l4 = 40
	default:
		return 0
	}
	if len(p) < l4+20 {
		return 0
	}
	return len(p) - l4 - int(p[l4+12]>>4)*4
}
