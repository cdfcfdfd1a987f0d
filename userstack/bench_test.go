package userstack

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/ethtool"
)

// sinkServer reads each connection to its end, then answers one byte so
// the sender knows everything arrived.
func sinkServer(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			io.Copy(io.Discard, c)
			c.Write([]byte{1})
		}()
	}
}

// rrServer answers every byte with one byte.
func rrServer(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			b := make([]byte, 1)
			for {
				if _, err := io.ReadFull(c, b); err != nil {
					return
				}
				if _, err := c.Write(b); err != nil {
					return
				}
			}
		}()
	}
}

// goodput sends n bytes from the outside kernel to addr and returns bit/s.
func (e *e2e) goodput(addr string, n int) (float64, error) {
	c, err := e.dialOutside(context.Background(), "tcp", addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(120 * time.Second))
	buf := make([]byte, 256<<10)
	start := time.Now()
	for sent := 0; sent < n; sent += len(buf) {
		if _, err := c.Write(buf); err != nil {
			return 0, err
		}
	}
	c.(*net.TCPConn).CloseWrite()
	if _, err := io.ReadFull(c, buf[:1]); err != nil {
		return 0, err
	}
	return float64(n) * 8 / time.Since(start).Seconds(), nil
}

// roundTrips times count 1-byte request/responses to addr from the outside
// kernel and returns the sorted durations.
func (e *e2e) roundTrips(addr string, count int) ([]time.Duration, error) {
	c, err := e.dialOutside(context.Background(), "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	b := []byte{7}
	var ds []time.Duration
	for i := range count + 100 {
		start := time.Now()
		if _, err := c.Write(b); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(c, b); err != nil {
			return nil, err
		}
		if i >= 100 { // warm-up
			ds = append(ds, time.Since(start))
		}
	}
	slices.Sort(ds)
	return ds, nil
}

func pct(ds []time.Duration, p float64) time.Duration { return ds[int(float64(len(ds)-1)*p)] }

// connsPerSecond opens and closes connections to addr from the outside
// kernel, one at a time, for d.
func (e *e2e) connsPerSecond(addr string, d time.Duration) (float64, error) {
	n := 0
	start := time.Now()
	for time.Since(start) < d {
		c, err := e.dialOutside(context.Background(), "tcp", addr)
		if err != nil {
			return 0, err
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		// One byte each way, so the connection is really served.
		if _, err := c.Write([]byte{1}); err != nil {
			return 0, err
		}
		if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
			return 0, err
		}
		c.Close()
		n++
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// helperEnv names the control socket when the test binary runs as the
// benchmark's application process.
const helperEnv = "FB_USERSTACK_HELPER_CONTROL"

// TestMain turns the test binary into the benchmark's application process
// when helperEnv is set: the application in a process of its own, as in
// production. It serves a sink on port 5005 and echoes single bytes on
// 5006, says "ready", and exits when its standard input closes.
func TestMain(m *testing.M) {
	path := os.Getenv(helperEnv)
	if path == "" {
		os.Exit(m.Run())
	}
	s, err := Open(context.Background(), Options{App: "child", Control: path})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer s.Close()
	for _, srv := range []struct {
		addr  string
		serve func(net.Listener)
	}{{":5005", sinkServer}, {":5006", rrServer}} {
		l, err := s.Listen("tcp", srv.addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		go srv.serve(l)
	}
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
}

// startHelper runs the application process and waits until it serves.
func startHelper(b *testing.B, path string) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"="+path)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		stdin.Close()
		cmd.Wait()
	})
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "ready" {
			go io.Copy(io.Discard, stdout)
			return
		}
	}
	b.Fatal("the application process did not start")
}

// BenchmarkEndToEnd compares the kernel's TCP with the user-space stack on
// the same topology in the same run: the outside host's kernel talks to a
// server on the bridge host, either the kernel's own (a port no application
// claims: the XDP program passes it) or a userstack behind the bridge. Run
// it once: go test -run '^$' -bench BenchmarkEndToEnd -benchtime 1x ./userstack
func BenchmarkEndToEnd(b *testing.B) {
	e := newE2E(b)
	s := e.open(false)
	userSink, err := s.Listen("tcp", ":5001")
	if err != nil {
		b.Fatal(err)
	}
	go sinkServer(userSink)
	userRR, err := s.Listen("tcp", ":5003")
	if err != nil {
		b.Fatal(err)
	}
	go rrServer(userRR)
	var kernSink, kernRR net.Listener
	if err := e.br.Do(func() (err error) {
		if kernSink, err = net.Listen("tcp", netip.AddrPortFrom(e.local4, 5002).String()); err != nil {
			return err
		}
		kernRR, err = net.Listen("tcp", netip.AddrPortFrom(e.local4, 5004).String())
		return err
	}); err != nil {
		b.Fatal(err)
	}
	defer kernSink.Close()
	defer kernRR.Close()
	go sinkServer(kernSink)
	go rrServer(kernRR)
	at := func(port int) string { return netip.AddrPortFrom(e.local4, uint16(port)).String() }
	offloads := func(on bool) {
		if err := ethtool.SetOffloads(e.out, e.wire.A.Name, on); err != nil {
			b.Fatal(err)
		}
		if err := ethtool.SetOffloads(e.br, e.wire.B.Name, on); err != nil {
			b.Logf("bridge end: %v (left as it was)", err)
		}
	}
	const size = 256 << 20
	startHelper(b, e.path)
	for b.Loop() {
		offloads(true)
		kernOn, err := e.goodput(at(5002), size)
		if err != nil {
			b.Fatal(err)
		}
		offloads(false) // the userstack path needs full checksums anyway
		kernOff, err := e.goodput(at(5002), size)
		if err != nil {
			b.Fatal(err)
		}
		user, err := e.goodput(at(5001), size)
		if err != nil {
			b.Fatal(err)
		}
		child, err := e.goodput(at(5005), size)
		if err != nil {
			b.Fatal(err)
		}
		crr, err := e.roundTrips(at(5006), 5000)
		if err != nil {
			b.Fatal(err)
		}
		krr, err := e.roundTrips(at(5004), 5000)
		if err != nil {
			b.Fatal(err)
		}
		urr, err := e.roundTrips(at(5003), 5000)
		if err != nil {
			b.Fatal(err)
		}
		kcps, err := e.connsPerSecond(at(5004), 2*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		ucps, err := e.connsPerSecond(at(5003), 2*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(kernOn/1e6, "kernel-offload-on-Mbit/s")
		b.ReportMetric(kernOff/1e6, "kernel-offload-off-Mbit/s")
		b.ReportMetric(user/1e6, "userstack-Mbit/s")
		b.ReportMetric(user/kernOff, "goodput-ratio-vs-off")
		b.ReportMetric(user/kernOn, "goodput-ratio-vs-on")
		b.ReportMetric(float64(pct(krr, 0.5).Microseconds()), "kernel-rr-p50-µs")
		b.ReportMetric(float64(pct(urr, 0.5).Microseconds()), "userstack-rr-p50-µs")
		b.ReportMetric(float64(pct(krr, 0.99).Microseconds()), "kernel-rr-p99-µs")
		b.ReportMetric(float64(pct(urr, 0.99).Microseconds()), "userstack-rr-p99-µs")
		b.ReportMetric(float64(pct(urr, 0.5))/float64(pct(krr, 0.5)), "rr-p50-ratio")
		b.ReportMetric(kcps, "kernel-conn/s")
		b.ReportMetric(ucps, "userstack-conn/s")
		b.Log(fmt.Sprintf("goodput Mbit/s: kernel offload on %.0f, off %.0f, userstack %.0f (%.2f of off, %.2f of on)",
			kernOn/1e6, kernOff/1e6, user/1e6, user/kernOff, user/kernOn))
		b.Log(fmt.Sprintf("1-byte RR: kernel p50 %v p99 %v, userstack p50 %v p99 %v", pct(krr, 0.5), pct(krr, 0.99), pct(urr, 0.5), pct(urr, 0.99)))
		b.Log(fmt.Sprintf("application in its own process: goodput %.0f Mbit/s (%.2f of off), RR p50 %v p99 %v (%.1f× kernel)",
			child/1e6, child/kernOff, pct(crr, 0.5), pct(crr, 0.99), float64(pct(crr, 0.5))/float64(pct(krr, 0.5))))
		b.ReportMetric(child/1e6, "own-process-userstack-Mbit/s")
		b.ReportMetric(float64(pct(crr, 0.5).Microseconds()), "own-process-rr-p50-µs")
		b.Log(fmt.Sprintf("connections/s: kernel %.0f, userstack %.0f", kcps, ucps))
		b.Logf("userstack link: %+v", s.LinkStats())
	}
}
