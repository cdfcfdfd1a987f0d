package appliance

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/userstack"
)

// envInt is the integer in environment variable name, or def.
func envInt(tb testing.TB, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		tb.Fatalf("%s: %v", name, err)
	}
	return n
}

// dialMany makes n connections with inflight dials at a time, each worker
// running in its own call of run (which may put it into a namespace), and
// returns the rate and the connections.
func dialMany(tb testing.TB, n, inflight int, run func(func() error) error, dial func() (net.Conn, error)) (float64, []net.Conn) {
	tb.Helper()
	var (
		next  atomic.Int64
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
		errs  = make(chan error, inflight)
	)
	start := time.Now()
	for range inflight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := run(func() error {
				for next.Add(1) <= int64(n) {
					c, err := dial()
					if err != nil {
						return err
					}
					mu.Lock()
					conns = append(conns, c)
					mu.Unlock()
				}
				return nil
			})
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	close(errs)
	for err := range errs {
		tb.Fatalf("after %d connections: %v", len(conns), err)
	}
	return float64(n) / took.Seconds(), conns
}

// BenchmarkDialRate: an application on the bridge host dials a kernel TCP
// server in the outside namespace through the daemon, with FB_DIAL_HELD
// (10,000) of its connections open, FB_DIAL_MEASURED (2,000) dials timed,
// eight in flight; in the same run the bridge host's kernel connects to
// the same server as often, with as many of its own open. It reports both
// rates and their ratio. Run it with -benchtime 1x. The reserved range
// (10000-30000) leaves the kernel its own ephemeral ports (32768-60999).
func BenchmarkDialRate(b *testing.B) {
	held, measured := envInt(b, "FB_DIAL_HELD", 10_000), envInt(b, "FB_DIAL_MEASURED", 2_000)
	const inflight = 8
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	// The kernel client's connections hold a descriptor each (the
	// server closes what it accepts).
	if need := uint64(held + measured + 1000); lim.Max < need {
		b.Skipf("needs %d open files, the hard limit is %d", need, lim.Max)
	}
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	tp := newTopo(b)
	quota := strconv.Itoa(held + measured + 1000)
	var d *Daemon
	cfg := tp.config(b, "reserved_ports: 10000-30000\ndefault_quota: {ports: "+quota+"}\n")
	if err := tp.bridge.Do(func() (err error) { d, err = Start(cfg, Options{Log: io.Discard}); return err }); err != nil {
		b.Fatal(err)
	}
	defer d.Close()

	server := netip.AddrPortFrom(tp.v.B.Addr4.Addr(), 9000)
	var ln net.Listener
	if err := tp.outside.Do(func() (err error) {
		lc := net.ListenConfig{}
		ln, err = lc.Listen(context.Background(), "tcp", server.String())
		return err
	}); err != nil {
		b.Fatal(err)
	}
	// The server closes each connection it accepts, to stay within the
	// descriptor limit (20,000 here): a connection it held would cost a
	// descriptor on each side. The clients keep theirs (half-closed), so
	// the bridge's flows and the kernel's sockets stay.
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	defer ln.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	st, err := userstack.Open(ctx, userstack.Options{App: "dialer", Control: d.Config().Control.Socket})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	here := func(f func() error) error { return f() }
	viaBridge := func() (net.Conn, error) { return st.Dial(ctx, "tcp", server.String()) }
	inBridgeNS := func(f func() error) error { return tp.bridge.Do(f) }
	viaKernel := func() (net.Conn, error) { return net.DialTimeout("tcp", server.String(), 10*time.Second) }
	closeAll := func(cs []net.Conn) {
		for _, c := range cs {
			c.Close()
		}
	}
	for b.Loop() {
		_, open := dialMany(b, held, inflight, here, viaBridge)
		bridgeRate, more := dialMany(b, measured, inflight, here, viaBridge)
		_, kopen := dialMany(b, held, inflight, inBridgeNS, viaKernel)
		kernelRate, kmore := dialMany(b, measured, inflight, inBridgeNS, viaKernel)
		b.ReportMetric(bridgeRate, "dials/s")
		b.ReportMetric(kernelRate, "kernel-connects/s")
		b.ReportMetric(bridgeRate/kernelRate, "ratio")
		b.Logf("%d held: through the bridge %.0f dials/s, the kernel's own connect %.0f/s (ratio %.2f)", held, bridgeRate, kernelRate, bridgeRate/kernelRate)
		closeAll(open)
		closeAll(more)
		closeAll(kopen)
		closeAll(kmore)
	}
}
