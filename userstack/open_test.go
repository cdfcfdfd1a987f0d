package userstack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/fakebridge"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// world is a control server over the fake bridge, with two applications'
// address sets configured.
type world struct {
	fb   *fakebridge.Bridge
	cfg  control.Config
	srv  *control.Server
	ln   *net.UnixListener // srv's
	path string
}

var ephemeral = classifier.PortRange{Lo: 41000, Hi: 41999}

func newWorld(t *testing.T) *world {
	t.Helper()
	return newWorldStreams(t, fabric.Config{RxSlots: 1024, TxSlots: 1024})
}

// newWorldStreams is newWorld whose streams take shape sc by default.
func newWorldStreams(t *testing.T, sc fabric.Config) *world {
	t.Helper()
	fb := fakebridge.New()
	w := &world{fb: fb, path: filepath.Join(t.TempDir(), "control.sock"), cfg: control.Config{
		Dataplane: fb,
		Addrs:     addrA,
		Ephemeral: ephemeral,
		Stream:    sc,
		Apps:      map[string]control.Policy{"a": {Addrs: addrA}, "b": {Addrs: addrB}},
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	}}
	w.srv = w.serve(t, w.path)
	return w
}

// serve starts a control server of w's configuration on path.
func (w *world) serve(t *testing.T, path string) *control.Server {
	t.Helper()
	srv, err := control.NewServer(w.cfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	go srv.ServeLocal(l)
	t.Cleanup(func() { srv.Close() })
	w.ln = l
	return srv
}

// stop closes the server and its socket, which the server would leave
// behind if it had not yet begun to serve it.
func (w *world) stop() {
	w.srv.Close()
	w.ln.Close()
}

func (w *world) open(t *testing.T, app string) *Stack {
	t.Helper()
	s, err := Open(testCtx(t, 10*time.Second), Options{App: app, Control: w.path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func (w *world) app(name string) (control.AppInfo, bool) {
	for _, a := range w.srv.Apps() {
		if a.Name == name {
			return a, true
		}
	}
	return control.AppInfo{}, false
}

// eventually polls cond for up to d.
func eventually(d time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

func TestOpenServesHTTPThroughTheBridge(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	if got := b.Addrs(); len(got) != 2 || got[0] != addrB[0] {
		t.Fatalf("b's addresses %v, want the configured %v", got, addrB)
	}
	l, err := b.Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	want := body(10 << 20)
	serveBody(t, l, want)
	for _, url := range []string{"http://198.18.0.2/", "http://[2001:db8::2]/"} {
		got, err := httpGet(testCtx(t, 60*time.Second), a.Dial, url)
		if err != nil {
			t.Fatalf("%s: %v", url, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: %d bytes, not the %d served", url, len(got), len(want))
		}
	}
	if c := w.fb.Counters(); c.Rejected != 0 || c.Steered == 0 {
		t.Fatalf("bridge counters %+v: the stacks sent something they do not own", c)
	}
	// The connections' flows go back once they have closed.
	if !eventually(10*time.Second, func() bool { ai, _ := w.app("a"); return ai.Flows == 0 }) {
		ai, _ := w.app("a")
		t.Fatalf("a still holds %d flows after its connections closed", ai.Flows)
	}
	// The listener's port goes back once it is closed and the connections
	// it accepted have finished closing.
	l.Close()
	if !eventually(10*time.Second, func() bool { bi, _ := w.app("b"); return bi.Listeners == 0 }) {
		t.Fatal("b still holds its listener after closing it and all its connections")
	}
}

// echo serves l, echoing every connection until EOF.
func echo(l net.Listener) {
	serveConns(l, func(c net.Conn) {
		io.Copy(c, c)
	})
}

func TestTwoHundredConcurrentConnectionsBothWays(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	la, err := a.Listen("tcp", ":7")
	if err != nil {
		t.Fatal(err)
	}
	defer la.Close()
	lb, err := b.Listen("tcp", ":7")
	if err == nil || !errors.Is(err, control.ErrPortInUse) {
		t.Fatalf("b listening on a's wildcard port: %v", err)
	}
	lb, err = b.Listen("tcp", "198.18.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	go echo(la)
	go echo(lb)
	const n, size = 200, 16 << 10
	var wg sync.WaitGroup
	var failed atomic.Int32
	ctx := testCtx(t, 90*time.Second)
	for i := range n {
		from, to := a, lb.Addr().String()
		if i%2 == 1 {
			from, to = b, "198.18.0.1:7"
		}
		wg.Go(func() {
			err := func() error {
				c, err := from.Dial(ctx, "tcp", to)
				if err != nil {
					return err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(80 * time.Second))
				msg := body(size)
				msg[0] = byte(i)
				go c.Write(msg)
				got := make([]byte, size)
				if _, err := io.ReadFull(c, got); err != nil {
					return err
				}
				if !bytes.Equal(got, msg) {
					return errors.New("echo differs")
				}
				return nil
			}()
			if err != nil && failed.Add(1) <= 3 {
				t.Errorf("connection %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d of %d connections failed", failed.Load(), n)
	}
}

func TestUDPThroughTheBridgeBothWays(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	for _, fam := range []struct{ net, any, aAddr, bAddr string }{
		{"udp4", ":0", "198.18.0.1", "198.18.0.2"},
		{"udp6", ":0", "2001:db8::1", "2001:db8::2"},
	} {
		// a -> b with a connected socket, b answering from a listening one.
		pb, err := b.ListenPacket(fam.net, fam.any)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			buf := make([]byte, 2000)
			for {
				n, from, err := pb.ReadFrom(buf)
				if err != nil {
					return
				}
				pb.WriteTo(buf[:n], from)
			}
		}()
		bport := pb.LocalAddr().(*net.UDPAddr).Port
		c, err := a.Dial(testCtx(t, 10*time.Second), fam.net, net.JoinHostPort(fam.bAddr, fmt.Sprint(bport)))
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		for i := range 10 {
			msg := fmt.Appendf(nil, "%s %d", fam.net, i)
			c.Write(msg)
			got := make([]byte, 100)
			n, err := c.Read(got)
			if err != nil || !bytes.Equal(got[:n], msg) {
				t.Fatalf("%s a->b: %q %v", fam.net, got[:n], err)
			}
		}
		// b -> a, both unconnected.
		pa, err := a.ListenPacket(fam.net, net.JoinHostPort(fam.aAddr, "0"))
		if err != nil {
			t.Fatal(err)
		}
		pa.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := pb.WriteTo([]byte("hello a"), pa.LocalAddr()); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 100)
		n, from, err := pa.ReadFrom(got)
		if err != nil || string(got[:n]) != "hello a" || from.(*net.UDPAddr).Port != bport {
			t.Fatalf("%s b->a: %q from %v, %v", fam.net, got[:n], from, err)
		}
		c.Close()
		pa.Close()
		pb.Close()
	}
	if !eventually(5*time.Second, func() bool {
		ai, _ := w.app("a")
		bi, _ := w.app("b")
		return ai.Flows+ai.Listeners+bi.Flows+bi.Listeners == 0
	}) {
		t.Fatalf("claims left after closing everything: %+v", w.srv.Apps())
	}
}

func TestTheFlowIsInstalledBeforeTheSYN(t *testing.T) {
	w := newWorld(t)
	a := w.open(t, "a")
	var syns atomic.Int32
	var flowsAtSYN atomic.Int32
	w.fb.Wire = func(pkt []byte) {
		p, err := ippkt.Parse(pkt)
		if err != nil || p.Dst.Port() != 80 {
			return
		}
		if syns.Add(1) == 1 {
			ai, _ := w.app("a")
			flowsAtSYN.Store(int32(ai.Flows))
			if !ephemeral.Contains(p.Src.Port()) {
				t.Errorf("SYN from port %d, outside the reserved range", p.Src.Port())
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := a.Dial(ctx, "tcp", "198.18.7.7:80"); err == nil {
		t.Fatal("dial to nobody succeeded")
	}
	if syns.Load() == 0 || flowsAtSYN.Load() != 1 {
		t.Fatalf("%d SYNs reached the wire; the flow count when the first did was %d, want 1", syns.Load(), flowsAtSYN.Load())
	}
	if !eventually(5*time.Second, func() bool { ai, _ := w.app("a"); return ai.Flows == 0 }) {
		t.Fatal("a failed dial kept its flow")
	}
}

func TestClosingTheStackEndsTheLease(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	l, err := a.Listen("tcp", ":9000")
	if err != nil {
		t.Fatal(err)
	}
	go echo(l)
	c, err := b.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.1:9000")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if !eventually(5*time.Second, func() bool { _, ok := w.app("a"); return !ok }) {
		t.Fatal("a still registered after Close")
	}
	// b's connection was reset, not left hanging.
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("read on a connection whose peer closed its stack succeeded")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the peer's stack closed but the connection was not reset")
	}
	// The port is free for b now.
	lb, err := b.Listen("tcp", ":9000")
	if err != nil {
		t.Fatalf("port of a closed stack still held: %v", err)
	}
	lb.Close()
	if _, err := a.Listen("tcp", ":9001"); err == nil {
		t.Fatal("Listen on a closed stack worked")
	}
}

func TestOpenErrors(t *testing.T) {
	w := newWorld(t)
	ctx := testCtx(t, 10*time.Second)
	if _, err := Open(ctx, Options{App: "a"}); err == nil {
		t.Error("Open without a bridge accepted")
	}
	if _, err := Open(ctx, Options{App: "a", Control: w.path, Remote: &RemoteOptions{}}); err == nil {
		t.Error("Open with both transports accepted")
	}
	if _, err := Open(ctx, Options{App: "a", Control: filepath.Join(t.TempDir(), "none")}); !errors.Is(err, control.ErrBridgeGone) {
		t.Errorf("Open on a missing socket: %v", err)
	}
	if _, err := Open(ctx, Options{App: "bad name", Control: w.path}); !errors.Is(err, control.ErrBadRequest) {
		t.Errorf("Open with a bad name: %v", err)
	}
	s := w.open(t, "a")
	if _, err := s.Listen("tcp", "198.18.0.2:80"); err == nil {
		t.Error("listen on b's address from a accepted")
	}
	w.srv.Close()
	// The stack waits for a bridge to come back, within the context.
	if _, err := s.Dial(testCtx(t, 300*time.Millisecond), "tcp", "198.18.0.2:80"); !errors.Is(err, ErrBridgeUnavailable) || !errors.Is(err, control.ErrBridgeGone) {
		t.Errorf("dial after the bridge went: %v", err)
	}
	_ = netip.Addr{}
}

func TestAcceptedConnectionsOutliveTheirListener(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	l, err := b.Listen("tcp", ":9100")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	c, err := a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:9100")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sc := <-accepted
	l.Close()
	// Still steered: data flows after the listener closed.
	c.Write([]byte("still there?"))
	sc.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 20)
	if n, err := sc.Read(buf); err != nil || string(buf[:n]) != "still there?" {
		t.Fatalf("after the listener closed: %q %v", buf[:n], err)
	}
	if bi, _ := w.app("b"); bi.Listeners != 1 {
		t.Fatalf("b holds %d listeners while an accepted connection is open, want 1", bi.Listeners)
	}
	// The port stays claimed until the connection's closing handshake is
	// done on both sides (the peer may still send after our FIN).
	sc.Close()
	c.Close()
	if !eventually(10*time.Second, func() bool { bi, _ := w.app("b"); return bi.Listeners == 0 }) {
		t.Fatal("the port stayed claimed after the last connection closed")
	}
}

// TestWindowsFollowTheStreamsDepth checks that a local stack sizes its TCP
// receive windows by the RX ring the bridge actually made, whether the
// application asked for a depth or took the bridge's default (which is
// not 1024 here, so an assumed depth would show).
func TestWindowsFollowTheStreamsDepth(t *testing.T) {
	w := newWorldStreams(t, fabric.Config{RxSlots: 128, TxSlots: 128})
	for _, c := range []struct {
		app       string
		ask, want int
	}{{"a", 0, 128}, {"b", 512, 512}} {
		s, err := Open(testCtx(t, 10*time.Second), Options{App: c.app, Control: w.path, RxSlots: c.ask})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		var got tcpip.TCPReceiveBufferSizeRangeOption
		if err := s.ns.TransportProtocolOption(tcp.ProtocolNumber, &got); err != nil {
			t.Fatal(err)
		}
		if want := receiveBufferMax(c.want, int(s.ep.MTU())); got.Max != want {
			t.Errorf("asked for %d slots: receive buffers up to %d bytes, want %d (a %d-slot ring)", c.ask, got.Max, want, c.want)
		}
	}
}

// TestClosingConnectionsShareOneWatcher closes many connections at once:
// their claims are watched by one goroutine of the stack, not one each,
// the side that closed first keeps its claim through TIME-WAIT's hold,
// and every claim goes back in the end.
func TestClosingConnectionsShareOneWatcher(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	l, err := b.Listen("tcp", ":9101")
	if err != nil {
		t.Fatal(err)
	}
	const n = 100
	accepted := make(chan net.Conn, n)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	var clients, servers []net.Conn
	for range n {
		c, err := a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:9101")
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
		servers = append(servers, <-accepted)
	}
	l.Close() // from now on b's claim is held by its connections alone
	before := runtime.NumGoroutine()
	for i := range n {
		servers[i].Close() // b closes first: its side ends in TIME-WAIT
		clients[i].Close()
	}
	// A goroutine per connection would live through TIME-WAIT's hold, a
	// second; the stack's timers start short-lived ones, which a moment
	// lets end.
	grew := 0
	if !eventually(300*time.Millisecond, func() bool {
		grew = runtime.NumGoroutine() - before
		return grew <= n/10
	}) {
		t.Errorf("closing %d connections on each side left %d more goroutines", n, grew)
	}
	time.Sleep(timeWaitHold / 2)
	if bi, _ := w.app("b"); bi.Listeners != 1 {
		t.Fatalf("b holds %d listeners half a TIME-WAIT hold after its connections closed, want 1", bi.Listeners)
	}
	if !eventually(10*time.Second, func() bool {
		ai, _ := w.app("a")
		bi, _ := w.app("b")
		return ai.Flows == 0 && bi.Listeners == 0
	}) {
		t.Fatalf("claims left after every connection closed: %+v", w.srv.Apps())
	}
	if !eventually(time.Second, func() bool {
		b.linger.mu.Lock()
		defer b.linger.mu.Unlock()
		return !b.linger.running
	}) {
		t.Error("the watcher goroutine runs on with nothing to watch")
	}
}

// TestTimeWaitEndsWithItsHold checks that a connection this stack closed
// first leaves TIME-WAIT when the bridge stops steering its tuple here
// (timeWaitHold), not after gVisor's default minute.
func TestTimeWaitEndsWithItsHold(t *testing.T) {
	w := newWorld(t)
	a, b := w.open(t, "a"), w.open(t, "b")
	l, err := b.Listen("tcp", ":9102")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	timeWaits := func() int {
		n := 0
		for _, ep := range b.ns.RegisteredEndpoints() {
			if e, ok := ep.(*tcp.Endpoint); ok && e.EndpointState() == tcp.StateTimeWait {
				n++
			}
		}
		return n
	}
	const n = 50
	var clients, servers []net.Conn
	for range n {
		c, err := a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:9102")
		if err != nil {
			t.Fatal(err)
		}
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		clients, servers = append(clients, c), append(servers, s)
	}
	for _, s := range servers {
		s.Close() // b closes first: its side ends in TIME-WAIT
	}
	for _, c := range clients {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil {
			t.Fatalf("client side: %v, want the server's FIN", err)
		}
		c.Close()
	}
	// Half is proof enough that they get there: on a loaded machine the
	// first may leave before the last arrives.
	if !eventually(2*time.Second, func() bool { return timeWaits() >= n/2 }) {
		t.Fatalf("%d of b's %d connections in TIME-WAIT after both sides closed, want at least half", timeWaits(), n)
	}
	start := time.Now()
	if !eventually(timeWaitHold+3*time.Second, func() bool { return timeWaits() == 0 }) {
		t.Fatalf("%d connections still in TIME-WAIT %v later, with a hold of %v", timeWaits(), time.Since(start).Round(time.Millisecond), timeWaitHold)
	}
	t.Logf("TIME-WAIT over %v after half the connections were in it (hold %v)", time.Since(start).Round(time.Millisecond), timeWaitHold)
}
