package userstack

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
)

// quietPair is two stacks joined by a wire that allocates nothing.
func quietPair(t testing.TB) (a, b *Stack) {
	t.Helper()
	pa, pb := wirePair(t, nil, 0, false)
	return pa.s, pb.s
}

// connBetween is a connection from a to b's port: the client dialled from
// a and the server b accepted.
func connBetween(t testing.TB, a, b *Stack, port int) (client, server net.Conn) {
	t.Helper()
	l, err := b.Listen("tcp", fmt.Sprint(":", port))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	client, err = a.Dial(testCtx(t, 10*time.Second), "tcp", fmt.Sprint("198.18.0.2:", port))
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() {
		client.Close()
		server.Close()
	})
	return client, server
}

// backgroundReader reads one byte from c whenever start is signalled and
// hands back the error, as net/http's server does between a request and
// the next from a long-lived goroutine, so that starting it allocates
// nothing.
type backgroundReader struct {
	start chan struct{}
	done  chan error
}

func newBackgroundReader(t *testing.T, c net.Conn) *backgroundReader {
	r := &backgroundReader{start: make(chan struct{}), done: make(chan error)}
	go func() {
		var one [1]byte
		for range r.start {
			_, err := c.Read(one[:])
			r.done <- err
		}
	}()
	t.Cleanup(func() { close(r.start) })
	return r
}

// isDeadline reports whether err is a deadline's, as a kernel socket
// reports it (without errors.As, which would allocate).
func isDeadline(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout() && errors.Is(err, os.ErrDeadlineExceeded)
}

// TestTCPConnAllocs checks that a steady stream of requests and responses
// allocates nothing, with the deadlines net/http's server sets and clears
// around each request and the background Read it aborts by a deadline in
// the past. With gonet's conn a round here allocated 29 objects (a timer
// and a channel per deadline, a waiter channel per wait, a fresh error
// with two fresh addresses per timeout, and gVisor's one-packet list per
// packet sent), with tcpConn 4 (the lists), with linkQDisc 0; the
// interrupted Read with its deadlines 10, then 0.
func TestTCPConnAllocs(t *testing.T) {
	a, b := quietPair(t)
	client, server := connBetween(t, a, b, 80)
	req, resp := make([]byte, 100), make([]byte, 300)
	sbuf, cbuf := make([]byte, 1000), make([]byte, 1000)
	bg := newBackgroundReader(t, server)
	var failure error
	fail := func(err error) {
		if failure == nil {
			failure = err
		}
	}
	round := func() {
		server.SetReadDeadline(time.Now().Add(time.Minute))
		bg.start <- struct{}{} // the request's Read, blocked until it comes
		if _, err := client.Write(req); err != nil {
			fail(err)
		}
		if err := <-bg.done; err != nil {
			fail(err)
		}
		if n, err := server.Read(sbuf[:len(req)-1]); n != len(req)-1 || err != nil {
			fail(fmt.Errorf("server read %d bytes, %v", n, err))
		}
		server.SetReadDeadline(time.Time{})
		server.SetWriteDeadline(time.Now().Add(time.Minute))
		if _, err := server.Write(resp); err != nil {
			fail(err)
		}
		server.SetWriteDeadline(time.Time{})
		for n := 0; n < len(resp); {
			m, err := client.Read(cbuf)
			if err != nil {
				fail(err)
				return
			}
			n += m
		}
		// Between requests: a background Read, aborted.
		bg.start <- struct{}{}
		server.SetReadDeadline(time.Unix(1, 0))
		if err := <-bg.done; !isDeadline(err) {
			fail(fmt.Errorf("background read: %v", err))
		}
		server.SetReadDeadline(time.Time{})
		_, _ = server.LocalAddr(), server.RemoteAddr()
	}
	for range 20 {
		round()
	}
	if failure != nil {
		t.Fatal(failure)
	}
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector (sync.Pool drops items)")
	}
	// Nothing per round: not the conns, not the stack's send path (the
	// NIC's discipline, linkQDisc, writes each packet without wrapping it
	// in a list as gVisor's default does), not the receive loop.
	const runs = 500
	allocs := testing.AllocsPerRun(runs, round)
	if failure != nil {
		t.Fatal(failure)
	}
	if allocs != 0 {
		t.Errorf("%.0f allocations per request/response round, want 0", allocs)
	}

	// Without traffic, nothing at all.
	idle := func() {
		server.SetDeadline(time.Now().Add(time.Minute))
		bg.start <- struct{}{}
		server.SetReadDeadline(time.Unix(1, 0))
		if err := <-bg.done; !isDeadline(err) {
			fail(fmt.Errorf("background read: %v", err))
		}
		server.SetDeadline(time.Time{})
	}
	if allocs := testing.AllocsPerRun(runs, idle); allocs != 0 || failure != nil {
		t.Errorf("%.0f allocations per interrupted Read and its deadlines (%v)", allocs, failure)
	}
}

// waitReturn is the result of f, run on its own, once it returns; it fails
// the test if f returns within early or not within late.
func waitReturn[T any](t *testing.T, what string, early, late time.Duration, f func() T, between func()) T {
	t.Helper()
	done := make(chan T, 1)
	start := time.Now()
	go func() { done <- f() }()
	select {
	case v := <-done:
		if early > 0 {
			t.Fatalf("%s returned after %v, before %v: %v", what, time.Since(start), early, v)
		}
		return v
	case <-time.After(early):
	}
	if between != nil {
		between()
	}
	select {
	case v := <-done:
		return v
	case <-time.After(late):
		t.Fatalf("%s still blocked after %v", what, late)
	}
	panic("unreachable")
}

type ioResult struct {
	n   int
	err error
}

func TestTCPConnDeadlines(t *testing.T) {
	a, b := quietPair(t)
	client, server := connBetween(t, a, b, 80)
	buf := make([]byte, 100)
	read := func() ioResult {
		n, err := server.Read(buf)
		return ioResult{n, err}
	}
	expectTimeout := func(what string, r ioResult) {
		t.Helper()
		if r.n != 0 || !isDeadline(r.err) {
			t.Fatalf("%s: %d bytes, %v; want a deadline's timeout", what, r.n, r.err)
		}
	}
	expectData := func(what string, r ioResult, want string) {
		t.Helper()
		if r.err != nil || string(buf[:r.n]) != want {
			t.Fatalf("%s: %q, %v; want %q", what, buf[:r.n], r.err, want)
		}
	}

	// A deadline in the past interrupts the Read blocked now.
	r := waitReturn(t, "read", 100*time.Millisecond, 2*time.Second, read, func() { server.SetReadDeadline(time.Unix(1, 0)) })
	expectTimeout("read interrupted by a past deadline", r)
	// ... and fails the next Read at once, data or not.
	client.Write([]byte("x"))
	time.Sleep(50 * time.Millisecond)
	expectTimeout("read after a past deadline", read())
	// Zero clears it.
	server.SetReadDeadline(time.Time{})
	expectData("read after clearing", read(), "x")

	// A deadline in the future expires.
	start := time.Now()
	server.SetReadDeadline(start.Add(100 * time.Millisecond))
	r = waitReturn(t, "read", 50*time.Millisecond, 5*time.Second, read, nil)
	expectTimeout("read until a future deadline", r)
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Fatalf("read timed out after %v, before its deadline", d)
	}

	// A deadline as far away as time goes is no deadline yet.
	server.SetReadDeadline(time.Unix(1<<62, 0))
	r = waitReturn(t, "read", 100*time.Millisecond, 2*time.Second, read, func() { client.Write([]byte("far")) })
	expectData("read before a distant deadline", r, "far")

	// A timer that fired with nobody waiting leaves no timeout behind.
	server.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	time.Sleep(60 * time.Millisecond)
	server.SetReadDeadline(time.Time{})
	r = waitReturn(t, "read", 100*time.Millisecond, 2*time.Second, read, func() { client.Write([]byte("after a stale timer")) })
	expectData("read after a stale timer", r, "after a stale timer")
	// Nor does a deadline moved later while a Read waits, or one cleared.
	server.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	r = waitReturn(t, "read", 20*time.Millisecond, 2*time.Second, read, func() {
		server.SetReadDeadline(time.Now().Add(time.Hour))
		time.Sleep(100 * time.Millisecond)
		server.SetReadDeadline(time.Time{})
		time.Sleep(50 * time.Millisecond)
		client.Write([]byte("after a moved deadline"))
	})
	expectData("read after a moved deadline", r, "after a moved deadline")
	// A deadline set and cleared before the Read times nothing out.
	server.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
	server.SetReadDeadline(time.Time{})
	r = waitReturn(t, "read", 100*time.Millisecond, 2*time.Second, read, func() { client.Write([]byte("after a cleared deadline")) })
	expectData("read after a cleared deadline", r, "after a cleared deadline")
	// A deadline moved earlier expires at the earlier time (waitReturn
	// fails a Read still blocked after 2 s, the hour's deadline).
	start = time.Now()
	server.SetReadDeadline(start.Add(time.Hour))
	server.SetReadDeadline(start.Add(80 * time.Millisecond))
	r = waitReturn(t, "read", 40*time.Millisecond, 2*time.Second, read, nil)
	expectTimeout("read until a deadline moved earlier", r)
	if d := time.Since(start); d < 80*time.Millisecond {
		t.Fatalf("read timed out after %v, before its deadline of 80 ms", d)
	}
	server.SetReadDeadline(time.Time{})

	// Writes: the client reads nothing, so a large Write fills the
	// buffers and blocks.
	big := make([]byte, 32<<20)
	write := func() ioResult {
		n, err := server.Write(big)
		return ioResult{n, err}
	}
	start = time.Now()
	server.SetWriteDeadline(start.Add(200 * time.Millisecond))
	w := waitReturn(t, "write", 100*time.Millisecond, 5*time.Second, write, nil)
	if w.n == 0 || w.n == len(big) || !isDeadline(w.err) || time.Since(start) < 200*time.Millisecond {
		t.Fatalf("write until a future deadline: %d of %d bytes after %v, %v", w.n, len(big), time.Since(start), w.err)
	}
	server.SetWriteDeadline(time.Time{})
	w = waitReturn(t, "write", 100*time.Millisecond, 2*time.Second, write, func() { server.SetWriteDeadline(time.Unix(1, 0)) })
	if w.n == len(big) || !isDeadline(w.err) {
		t.Fatalf("write interrupted by a past deadline: %d bytes, %v", w.n, w.err)
	}
	// SetDeadline sets both.
	server.SetDeadline(time.Unix(1, 0))
	if _, err := server.Write([]byte("x")); !isDeadline(err) {
		t.Fatalf("write after SetDeadline in the past: %v", err)
	}
	expectTimeout("read after SetDeadline in the past", read())
	server.SetDeadline(time.Time{})
	client.Write([]byte("y"))
	expectData("read after SetDeadline(zero)", read(), "y")
}

// BenchmarkTCPConnDeadlines: the deadlines net/http's server sets around
// each request (the header timeout, cleared, a past one that aborts the
// background Read, cleared), on a conn with nothing blocked. About 430 ns
// on the 2-vCPU VM; see docs/performance.md for the lazier timer tried.
func BenchmarkTCPConnDeadlines(b *testing.B) {
	a, s := quietPair(b)
	_, server := connBetween(b, a, s, 80)
	past := time.Unix(1, 0)
	b.ReportAllocs()
	for b.Loop() {
		server.SetReadDeadline(time.Now().Add(10 * time.Second))
		server.SetReadDeadline(time.Time{})
		server.SetReadDeadline(past)
		server.SetReadDeadline(time.Time{})
	}
}

func TestTCPConnHalfCloseAndClose(t *testing.T) {
	a, b := quietPair(t)
	client, server := connBetween(t, a, b, 80)
	buf := make([]byte, 100)
	// CloseWrite: the peer reads the data, then io.EOF, and can still
	// send.
	server.Write([]byte("last words"))
	if err := server.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(client)
	if err != nil || string(got) != "last words" {
		t.Fatalf("client read %q, %v; want the data, then io.EOF", got, err)
	}
	client.Write([]byte("reply"))
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := server.Read(buf); err != nil || string(buf[:n]) != "reply" {
		t.Fatalf("server read %q, %v after closing its sending half", buf[:n], err)
	}
	server.SetReadDeadline(time.Time{})
	// Close ends the calls blocked in it, Read's and Write's.
	read := func() ioResult {
		n, err := server.Read(buf)
		return ioResult{n, err}
	}
	_, sc := connBetween(t, a, b, 81)
	write := func() ioResult {
		n, err := sc.Write(make([]byte, 32<<20))
		return ioResult{n, err}
	}
	r := waitReturn(t, "read", 100*time.Millisecond, 2*time.Second, read, func() { server.Close() })
	if r.err == nil {
		t.Fatalf("read on a closed conn: %d bytes, no error", r.n)
	}
	t.Logf("read ended by Close: %v", r.err)
	w := waitReturn(t, "write", 100*time.Millisecond, 2*time.Second, write, func() { sc.Close() })
	if w.err == nil {
		t.Fatalf("write on a closed conn: %d bytes, no error", w.n)
	}
	t.Logf("write ended by Close: %v", w.err)
}

// TestHTTPKeepAliveOverTCPConn serves many requests over one keep-alive
// connection with the server's timeouts set, so that net/http sets,
// clears and trips the conn's deadlines (and aborts its background Read)
// around every one.
func TestHTTPKeepAliveOverTCPConn(t *testing.T) {
	a, b := wiredPair(t, nil)
	l, err := b.s.Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	states := map[http.ConnState]int{}
	srv := &http.Server{
		ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second, IdleTimeout: 30 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			fmt.Fprintf(w, "%s %s %d", r.Method, r.URL.Path, len(body))
		}),
		ConnState: func(_ net.Conn, s http.ConnState) {
			mu.Lock()
			states[s]++
			mu.Unlock()
		},
	}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	tr := &http.Transport{DialContext: a.s.Dial, MaxIdleConnsPerHost: 1}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	const n = 300
	for i := range n {
		var resp *http.Response
		var want string
		if i%3 == 0 {
			resp, err = c.Post(fmt.Sprintf("http://198.18.0.2/%d", i), "text/plain", strings.NewReader(strings.Repeat("x", i*10)))
			want = fmt.Sprintf("POST /%d %d", i, i*10)
		} else {
			resp, err = c.Get(fmt.Sprintf("http://198.18.0.2/%d", i))
			want = fmt.Sprintf("GET /%d 0", i)
		}
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != want {
			t.Fatalf("request %d: %q, %v; want %q", i, got, err, want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if states[http.StateNew] != 1 || states[http.StateActive] != n {
		t.Fatalf("connection states %v: want one connection serving all %d requests", states, n)
	}
}

// TestTCPConnConcurrentUse runs what net.Conn allows at once: a Read, a
// Write and deadline changes in goroutines of their own, then a Close
// that ends the blocked Read (go test -race checks the rest).
func TestTCPConnConcurrentUse(t *testing.T) {
	a, b := quietPair(t)
	client, server := connBetween(t, a, b, 80)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // deadlines that never expire, set and cleared
		for {
			select {
			case <-stop:
				return
			default:
			}
			server.SetDeadline(time.Now().Add(time.Hour))
			server.SetReadDeadline(time.Time{})
			server.SetWriteDeadline(time.Now().Add(time.Minute))
			server.SetDeadline(time.Time{})
		}
	})
	serverRead := make(chan error, 1)
	chunks := make(chan []byte, 64)
	go func() { // echo: the Read here, the Write in the next goroutine
		defer close(chunks)
		for {
			buf := make([]byte, 4096)
			n, err := server.Read(buf)
			if err != nil {
				serverRead <- err
				return
			}
			chunks <- buf[:n]
		}
	}()
	go func() {
		for c := range chunks {
			server.Write(c)
		}
	}()
	const total = 1 << 20
	sent := body(total)
	go client.Write(sent)
	client.SetReadDeadline(time.Now().Add(30 * time.Second))
	got := make([]byte, total)
	if _, err := io.ReadFull(client, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, sent) {
		t.Fatal("echo differs")
	}
	close(stop)
	wg.Wait()
	server.Close()
	select {
	case err := <-serverRead:
		if err == nil {
			t.Fatal("read on a closed conn succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close left the Read blocked")
	}
}

// BenchmarkHTTPKeepAlive is GET requests, one after the other, over one
// keep-alive connection between two stacks: its allocs/op are net/http's
// own (client and server), the stacks' and the conns'.
// BenchmarkHTTPKeepAlive times a keep-alive GET over two stacks, with
// ACKs delayed (the default) and without.
func BenchmarkHTTPKeepAlive(b *testing.B) {
	for _, noDelay := range []bool{false, true} {
		b.Run(fmt.Sprint("no-ack-delay=", noDelay), func(b *testing.B) {
			pa, pb := wirePairConfig(b, nil, LinkConfig{NoAckDelay: noDelay}, false)
			benchHTTPKeepAlive(b, pa.s, pb.s)
		})
	}
}

// BenchmarkHTTPConnPerRequest is ab's workload between two stacks: a
// connection per GET of a 4096-byte body, so each op is both stacks'
// handshake, request, answer and close, and net/http's goroutine per
// connection on each side.
func BenchmarkHTTPConnPerRequest(b *testing.B) {
	pa, pb := wirePairConfig(b, nil, LinkConfig{}, false)
	l, err := pb.s.Listen("tcp", ":80")
	if err != nil {
		b.Fatal(err)
	}
	page := bytes.Repeat([]byte("x"), 4096)
	srv := &http.Server{ReadTimeout: time.Minute, WriteTimeout: time.Minute, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(page)
	})}
	go srv.Serve(l)
	b.Cleanup(func() { srv.Close() })
	tr := &http.Transport{DialContext: pa.s.Dial, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	b.ReportAllocs()
	// Many connections at once, as ab's are, so that the op is bound by
	// CPU, not by the round trips of one connection; cpu-ns/op is the
	// process's CPU time (both stacks, both sides of net/http) per op.
	b.SetParallelism(8)
	cpu0 := processCPU(b)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := c.Get("http://198.18.0.2/")
			if err != nil {
				b.Error(err)
				return
			}
			if n, _ := io.Copy(io.Discard, resp.Body); n != int64(len(page)) {
				b.Errorf("body of %d bytes, want %d", n, len(page))
			}
			resp.Body.Close()
		}
	})
	b.StopTimer()
	b.ReportMetric(float64((processCPU(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// processCPU is the CPU time this process has used, user and system.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func benchHTTPKeepAlive(b *testing.B, client, server *Stack) {
	l, err := server.Listen("tcp", ":80")
	if err != nil {
		b.Fatal(err)
	}
	srv := &http.Server{ReadTimeout: time.Minute, WriteTimeout: time.Minute, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("hello"))
	})}
	go srv.Serve(l)
	b.Cleanup(func() { srv.Close() })
	tr := &http.Transport{DialContext: client.Dial}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	get := func() {
		resp, err := c.Get("http://198.18.0.2/")
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	get()
	b.ReportAllocs()
	for b.Loop() {
		get()
	}
}

// TestTCPConnResetIsECONNRESET: a reset from the peer fails the blocked
// Read with the kernel's errno, as "read: connection reset by peer".
func TestTCPConnResetIsECONNRESET(t *testing.T) {
	a, b := quietPair(t)
	client, server := connBetween(t, a, b, 80)
	// Linger 0: Close sends a reset instead of a FIN.
	server.(*tcpConn).ep.SocketOptions().SetLinger(tcpip.LingerOption{Enabled: true})
	buf := make([]byte, 10)
	r := waitReturn(t, "read", 100*time.Millisecond, 5*time.Second, func() ioResult {
		n, err := client.Read(buf)
		return ioResult{n, err}
	}, func() { server.Close() })
	var oe *net.OpError
	if !errors.Is(r.err, syscall.ECONNRESET) || !errors.As(r.err, &oe) || oe.Op != "read" || !strings.HasSuffix(r.err.Error(), "read: connection reset by peer") {
		t.Fatalf("read after the peer's reset: %d bytes, %v; want ECONNRESET in a read *net.OpError", r.n, r.err)
	}
}
