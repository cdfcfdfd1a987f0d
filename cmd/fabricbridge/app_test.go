package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// syncWriter is an io.Writer tests read while an application writes.
type syncWriter struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// runApp starts `fabricbridge app ...` and waits until it serves.
func runApp(t *testing.T, ctx context.Context, args ...string) *syncWriter {
	t.Helper()
	return runAppIn(t, ctx, nil, args...)
}

// runAppIn is runApp with the application's sockets in ns (as on another
// node), or in the test's namespace if ns is nil.
func runAppIn(t *testing.T, ctx context.Context, ns *topology.NS, args ...string) *syncWriter {
	t.Helper()
	out := &syncWriter{}
	done := make(chan error, 1)
	run := func() error { return appCommand(ctx, args, out) }
	if ns != nil {
		// Do keeps its thread in ns while the application runs; the
		// application makes its sockets while it starts, on that thread.
		inner := run
		run = func() error { return ns.Do(inner) }
	}
	go func() { done <- run() }()
	t.Cleanup(func() {
		if err := <-done; err != nil {
			t.Errorf("app %v: %v\n%s", args, err, out.String())
		}
	})
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(out.String(), "serving on"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("app %v did not start:\n%s", args, out.String())
		}
	}
	return out
}

func TestApps(t *testing.T) {
	tb := newTestBridge(t, "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sock := tb.cfg.Control.Socket
	addr := tb.v.A.Addr4.Addr()
	httpCtx, stopHTTP := context.WithCancel(ctx)
	defer stopHTTP()
	httpOut := runApp(t, httpCtx, "http", "--control", sock, "--listen", ":80", "--size", "1000")
	echoCtx, stopEcho := context.WithCancel(ctx)
	defer stopEcho()
	echoOut := runApp(t, echoCtx, "echo", "--control", sock, "--listen", ":7", "--udp", "--no-ack-delay")
	sinkOut := runApp(t, ctx, "sink", "--control", sock, "--listen", ":9", "--every", "100ms", "--spin", "50us")

	// HTTP from the outside kernel.
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
			err = tb.outside.Do(func() (err error) { c, err = (&net.Dialer{}).DialContext(ctx, network, a); return err })
			return c, err
		}}}
	for _, tc := range []struct {
		path string
		size int
	}{{"/", 1000}, {"/bytes/3000000", 3000000}} {
		resp, err := client.Get(fmt.Sprintf("http://%s%s", netip.AddrPortFrom(addr, 80), tc.path))
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || n != int64(tc.size) || resp.StatusCode != 200 {
			t.Errorf("GET %s: %d bytes, status %d, %v", tc.path, n, resp.StatusCode, err)
		}
	}
	// Stopped, it says what its link moved: at least the two requests in
	// and the three megabytes out.
	client.CloseIdleConnections()
	stopHTTP()
	linkLine := regexp.MustCompile(`http: link: received (\d+) packets in \d+ batches .*; sent (\d+) packets in \d+ batches \((\d+) pure ACKs delayed`)
	for deadline := time.Now().Add(10 * time.Second); !linkLine.MatchString(httpOut.String()); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("app http stopped without its link's counters:\n%s", httpOut.String())
		}
	}
	m := linkLine.FindStringSubmatch(httpOut.String())
	if in, _ := strconv.Atoi(m[1]); in < 2 {
		t.Errorf("app http's link received too little for two requests: %s", m[0])
	}
	if out, _ := strconv.Atoi(m[2]); out < 3000000/1500 {
		t.Errorf("app http's link sent too little for 3 MB: %s", m[0])
	}
	if held, _ := strconv.Atoi(m[3]); held < 1 {
		t.Errorf("app http held no request's ACK for its answer: %s", m[0])
	}

	// TCP and UDP echo.
	c := tb.dialOutside(t, "tcp", netip.AddrPortFrom(addr, 7))
	msg := bytes.Repeat([]byte("echo!"), 20000)
	go c.Write(msg)
	got := make([]byte, len(msg))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Errorf("tcp echo: %v", err)
	}
	// Small messages, whose ACKs the stack would hold for the echo to
	// carry: with --no-ack-delay it holds none.
	for i := range 5 {
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, got[:4]); err != nil || string(got[:4]) != "ping" {
			t.Fatalf("tcp echo %d: %q, %v", i, got[:4], err)
		}
	}
	c.Close()
	u := tb.dialOutside(t, "udp", netip.AddrPortFrom(addr, 7))
	u.Write([]byte("datagram"))
	u.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 100)
	if n, err := u.Read(buf); err != nil || string(buf[:n]) != "datagram" {
		t.Errorf("udp echo: %q, %v", buf[:n], err)
	}

	stopEcho()
	echoLine := regexp.MustCompile(`echo: link: received \d+ packets .*; sent \d+ packets in \d+ batches \((\d+) pure ACKs delayed`)
	for deadline := time.Now().Add(10 * time.Second); !echoLine.MatchString(echoOut.String()); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("app echo stopped without its link's counters:\n%s", echoOut.String())
		}
	}
	if m := echoLine.FindStringSubmatch(echoOut.String()); m[1] != "0" {
		t.Errorf("app echo --no-ack-delay held ACKs: %s", m[0])
	}

	// The sink takes a megabyte and reports it.
	s := tb.dialOutside(t, "tcp", netip.AddrPortFrom(addr, 9))
	if _, err := s.Write(make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	s.Close()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(sinkOut.String(), "(1048576 bytes"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("sink never reported the megabyte:\n%s", sinkOut.String())
		}
	}
	if !strings.Contains(sinkOut.String(), "sink: the receive loop polls an empty stream for 50µs") {
		t.Errorf("app sink --spin 50us did not say it spins:\n%s", sinkOut.String())
	}
}

func TestAppUsage(t *testing.T) {
	for _, args := range [][]string{nil, {"ftp"}, {"--name", "x"}, {"http", "extra"}, {"http", "--mtu", "-1"},
		{"http", "--remote", "198.18.0.1:7070"}, {"http", "--secret-file", "/dev/null"}, {"http", "--tls-cert", "c.pem"},
		{"http", "--stacks", "0"}, {"echo", "--stacks", "257"}, {"http", "--spin", "-1us"}, {"sink", "--spin", "2s"}} {
		if err := appCommand(context.Background(), args, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
	if err := appCommand(context.Background(), []string{"sink", "--stacks", "0"}, io.Discard); err == nil || !strings.Contains(err.Error(), "--stacks 0: want 1 to 256") {
		t.Errorf("--stacks 0: %v; want an error naming the range", err)
	}
}

// TestSinkCountsAsBytesArrive: the sink counts a connection's bytes while
// it is open, so that its rate covers a long transfer as it runs.
func TestSinkCountsAsBytesArrive(t *testing.T) {
	app, peer := net.Pipe()
	var n atomic.Int64
	done := make(chan struct{})
	go func() { sinkConn(app, &n); close(done) }()
	if _, err := peer.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); n.Load() < 1000 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if got := n.Load(); got != 1000 {
		t.Errorf("with the connection open the sink counted %d bytes, want 1000", got)
	}
	peer.Close()
	<-done
}

// TestAppWithoutDaemon: an application started with no daemon says so and
// names the socket it tried.
func TestAppWithoutDaemon(t *testing.T) {
	sock := t.TempDir() + "/control.sock"
	err := appCommand(context.Background(), []string{"sink", "--control", sock}, io.Discard)
	if want := "app sink: no fabricbridge daemon at " + sock + " (is it running?)"; err == nil || err.Error() != want {
		t.Errorf("got %v, want %q", err, want)
	}
}
