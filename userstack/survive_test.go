package userstack

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// bridgeEvents collects a stack's events and lets a test wait for them.
type bridgeEvents struct {
	mu     sync.Mutex
	events []Event
}

func (l *bridgeEvents) add(e Event) {
	l.mu.Lock()
	l.events = append(l.events, e)
	l.mu.Unlock()
}

func (l *bridgeEvents) count(k EventKind) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.events {
		if e.Kind == k {
			n++
		}
	}
	return n
}

func (l *bridgeEvents) await(t *testing.T, k EventKind, n int) {
	t.Helper()
	if !eventually(10*time.Second, func() bool { return l.count(k) >= n }) {
		l.mu.Lock()
		defer l.mu.Unlock()
		t.Fatalf("no %d× %v among the events %v", n, k, l.events)
	}
}

func (w *world) openWithEvents(t *testing.T, app string) (*Stack, *bridgeEvents) {
	t.Helper()
	log := &bridgeEvents{}
	s, err := Open(testCtx(t, 10*time.Second), Options{App: app, Control: w.path, Events: log.add})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, log
}

// explainFailure logs, if t fails, what the bridge and the stacks saw.
func (w *world) explainFailure(t *testing.T, stacks map[string]*Stack, events map[string]*bridgeEvents) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		t.Logf("fake bridge: %+v; apps: %+v", w.fb.Counters(), w.srv.Apps())
		for name, s := range stacks {
			events[name].mu.Lock()
			t.Logf("%s: link %+v; events %v", name, s.LinkStats(), events[name].events)
			events[name].mu.Unlock()
		}
	})
}

// servePaced writes want to every connection it accepts, a chunk every
// millisecond, so that a transfer spans what a test does meanwhile.
func servePaced(l net.Listener, want []byte) {
	serveConns(l, func(c net.Conn) {
		for b := want; len(b) > 0; {
			n, err := c.Write(b[:min(len(b), 32<<10)])
			if err != nil {
				return
			}
			b = b[n:]
			time.Sleep(time.Millisecond)
		}
	})
}

// transfer is want arriving on a connection from servePaced.
type transfer struct {
	c         net.Conn
	got, want []byte
	rest      chan error // the read of what follows the first MiB, once started
}

// transferStarted reads the first MiB of want from c and, with
// readOn, goes on reading the rest meanwhile, as a client does. A reader
// that stops lets its window close, and if its window update is lost in
// a restart the sender waits for its zero-window probes, seconds apart.
// But a kernel reader's window updates sent into the gap reach the
// bridge host's kernel, which resets the connection (docs/restart.md):
// with a kernel peer, read once the bridge is back.
func transferStarted(t *testing.T, c net.Conn, want []byte, readOn bool) *transfer {
	t.Helper()
	x := &transfer{c: c, got: make([]byte, len(want)), want: want}
	c.SetReadDeadline(time.Now().Add(60 * time.Second))
	if _, err := io.ReadFull(c, x.got[:1<<20]); err != nil {
		t.Fatal(err)
	}
	x.rest = make(chan error, 1)
	if readOn {
		x.readRest()
	}
	return x
}

func (x *transfer) readRest() {
	go func() {
		_, err := io.ReadFull(x.c, x.got[1<<20:])
		x.rest <- err
	}()
}

// survived waits for the rest of the transfer after a restart, and checks
// that a new connection (dial) is served within a second.
func (x *transfer) survived(t *testing.T, dial func(context.Context, string, string) (net.Conn, error), addr string) {
	t.Helper()
	got, want := x.got, x.want
	if err := <-x.rest; err != nil {
		t.Fatalf("the transfer did not survive the restart: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the transfer survived the restart with other bytes than were sent")
	}
	c2, err := dial(testCtx(t, time.Second), "tcp", addr)
	if err != nil {
		t.Fatalf("a new connection after the restart: %v", err)
	}
	defer c2.Close()
	c2.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c2, got[:1000]); err != nil || !bytes.Equal(got[:1000], want[:1000]) {
		t.Fatalf("a new connection after the restart: %v", err)
	}
}

// pacedTransfer opens stacks a and b, b serving a 16 MiB paced body on
// :9000, and starts a's download of it; listener and connection close
// with the test.
func (w *world) pacedTransfer(t *testing.T) (a, b *Stack, aEvents, bEvents *bridgeEvents, x *transfer) {
	t.Helper()
	a, aEvents = w.openWithEvents(t, "a")
	b, bEvents = w.openWithEvents(t, "b")
	w.explainFailure(t, map[string]*Stack{"a": a, "b": b}, map[string]*bridgeEvents{"a": aEvents, "b": bEvents})
	l, err := b.Listen("tcp", ":9000")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	want := body(16 << 20)
	go servePaced(l, want)
	c, err := a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:9000")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return a, b, aEvents, bEvents, transferStarted(t, c, want, true)
}

// TestStacksOutliveTheirBridge restarts the control server under two
// stacks with a transfer running between them, through a's flow and b's
// listener: the transfer completes byte-exact over the new streams, a
// Dial made while the bridge is away completes once it is back, and b's
// listener accepts new connections.
func TestStacksOutliveTheirBridge(t *testing.T) {
	tcps := watchTCP(t)
	w := newWorld(t)
	t.Cleanup(func() {
		if t.Failed() {
			tcps.log(t)
		}
	})
	a, _, aEvents, bEvents, x := w.pacedTransfer(t)

	w.stop()
	aEvents.await(t, BridgeLost, 1)
	bEvents.await(t, BridgeLost, 1)
	if _, ok := w.app("a"); ok {
		t.Fatal("a still registered with the closed server")
	}
	// A Dial while the bridge is away waits for it.
	dialed := make(chan error, 1)
	go func() {
		c, err := a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:9000")
		if err == nil {
			c.Close()
		}
		dialed <- err
	}()
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-dialed:
		t.Fatalf("Dial returned while the bridge was away: %v", err)
	default:
	}

	w.srv = w.serve(t, w.path)
	aEvents.await(t, BridgeBack, 1)
	bEvents.await(t, BridgeBack, 1)
	if err := <-dialed; err != nil {
		t.Fatalf("Dial made while the bridge was away: %v", err)
	}
	// b's listener was claimed again and its Accept kept waiting.
	x.survived(t, a.Dial, "198.18.0.2:9000")
	if bi, ok := w.app("b"); !ok || bi.Listeners != 1 {
		t.Fatalf("b at the new bridge: %+v", bi)
	}
	if n := aEvents.count(ClaimLost) + bEvents.count(ClaimLost); n != 0 {
		t.Fatalf("%d claims lost in a restart nobody else used", n)
	}
}

// TestALostClaimIsReported has another application take a stack's port
// while the bridge is away: the stack says so.
func TestALostClaimIsReported(t *testing.T) {
	w := newWorld(t)
	b, events := w.openWithEvents(t, "b")
	if _, err := b.Listen("tcp", ":9000"); err != nil {
		t.Fatal(err)
	}
	w.stop()
	events.await(t, BridgeLost, 1)
	// The new bridge hears from the intruder first, on a socket of its own.
	side := filepath.Join(t.TempDir(), "side.sock")
	w.srv = w.serve(t, side)
	ctx := testCtx(t, 10*time.Second)
	intruder, err := control.DialLocal(ctx, side, "c")
	if err != nil {
		t.Fatal(err)
	}
	defer intruder.Close()
	_, st, err := intruder.RegisterLocal(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := intruder.Listen(ctx, "tcp", netip.Addr{}, 9000); err != nil {
		t.Fatal(err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: w.path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	go w.srv.ServeLocal(l)
	events.await(t, BridgeBack, 1)
	events.await(t, ClaimLost, 1)
	events.mu.Lock()
	var lost Event
	for _, e := range events.events {
		if e.Kind == ClaimLost {
			lost = e
		}
	}
	events.mu.Unlock()
	if !errors.Is(lost.Err, control.ErrPortInUse) || !strings.Contains(lost.Err.Error(), "port 9000") || !strings.Contains(lost.Err.Error(), `"c"`) {
		t.Fatalf("the lost claim is reported as %v", lost)
	}
	// The rest of the stack goes on.
	if _, err := b.Listen("tcp", ":9001"); err != nil {
		t.Fatal(err)
	}
}

// TestARefusingBridgeIsReported restarts the bridge with a configuration
// that no longer lets the application in: the stack says why, once, and
// attaches when a bridge takes it again.
func TestARefusingBridgeIsReported(t *testing.T) {
	w := newWorld(t)
	_, events := w.openWithEvents(t, "b")
	w.stop()
	events.await(t, BridgeLost, 1)
	open := w.cfg
	w.cfg.Apps = map[string]control.Policy{"a": {Addrs: addrA}}
	w.cfg.RefuseUnlisted = true
	w.srv = w.serve(t, w.path)
	events.await(t, BridgeRefused, 1)
	time.Sleep(2500 * time.Millisecond) // two more refusals
	if n := events.count(BridgeRefused); n != 1 {
		t.Fatalf("the same refusal reported %d times", n)
	}
	w.stop()
	w.cfg = open
	w.srv = w.serve(t, w.path)
	events.await(t, BridgeBack, 1)
	events.mu.Lock()
	defer events.mu.Unlock()
	for _, e := range events.events {
		if e.Kind == BridgeRefused && !errors.Is(e.Err, control.ErrNotPermitted) {
			t.Fatalf("refusal reported as %v", e)
		}
	}
}

// TestStacksOutliveRepeatedRestarts restarts the control server five
// times in quick succession, some restarts landing while the stacks are
// still claiming again from the one before: the transfer completes
// byte-exact and no claim is lost.
func TestStacksOutliveRepeatedRestarts(t *testing.T) {
	w := newWorld(t)
	a, _, aEvents, bEvents, x := w.pacedTransfer(t)
	const restarts = 5
	for i := range restarts {
		w.stop()
		time.Sleep(time.Duration(i%3) * 20 * time.Millisecond) // 0: the stacks' first attempt may find the new server
		w.srv = w.serve(t, w.path)
		time.Sleep(time.Duration(i) * 15 * time.Millisecond)
	}
	// A restart while a stack is away is no loss of its own.
	aEvents.await(t, BridgeBack, 1)
	x.survived(t, a.Dial, "198.18.0.2:9000")
	if n := aEvents.count(ClaimLost) + bEvents.count(ClaimLost); n != 0 {
		t.Fatalf("%d claims lost in restarts nobody else used", n)
	}
	if ai, ok := w.app("a"); !ok || ai.Flows == 0 {
		t.Fatalf("a at the last bridge: %+v", ai)
	}
}
