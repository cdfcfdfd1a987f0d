package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// The serving benchmark's child processes are this test binary: with
// FB_TEST_MAIN=1 it is fabricbridge (TestMain), with FB_BENCH_KERNEL_HTTP it
// is the kernel baseline. With FB_BENCH_CPUPROFILE=FILE,FOR a SIGUSR1 starts
// a CPU profile of FOR: the benchmark picks the window, and the daemon's
// signal handling would exit without flushing a profile kept to the end.
func init() {
	if spec := os.Getenv("FB_BENCH_CPUPROFILE"); spec != "" {
		profileOnSignal(spec)
	}
	if addr := os.Getenv("FB_BENCH_KERNEL_HTTP"); addr != "" {
		size, _ := strconv.Atoi(os.Getenv("FB_BENCH_SIZE"))
		srv := &http.Server{Addr: addr, Handler: httpHandler(size, &httpCounters{}), ReadHeaderTimeout: 10 * time.Second}
		fmt.Fprintln(os.Stderr, srv.ListenAndServe())
		os.Exit(1)
	}
}

func profileOnSignal(spec string) {
	file, span, _ := strings.Cut(spec, ",")
	d, err := time.ParseDuration(span)
	if err != nil {
		fmt.Fprintln(os.Stderr, "FB_BENCH_CPUPROFILE wants FILE,DURATION")
		os.Exit(2)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	go func() {
		<-sig
		f, err := os.Create(file)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return
		}
		time.Sleep(d)
		pprof.StopCPUProfile()
	}()
}

// servingProc is one serving process in the bridge namespace.
type servingProc struct {
	name string
	cmd  *exec.Cmd
	out  *testenv.Output
}

func startServing(tb testing.TB, ns *topology.NS, name string, env []string, args ...string) *servingProc {
	tb.Helper()
	self, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	p := &servingProc{name: name, out: &testenv.Output{}}
	// ip netns exec execs the command: the pid is the server's.
	p.cmd = exec.Command("ip", append([]string{"netns", "exec", ns.Name, self}, args...)...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	tb.Cleanup(func() {
		p.cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			p.cmd.Process.Kill()
			<-done
		}
	})
	return p
}

// cpuTicks is the process's user and system time in clock ticks.
func (p *servingProc) cpuTicks() (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name, which may hold spaces, in parentheses.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", p.cmd.Process.Pid, len(f))
	}
	utime, _ := strconv.ParseUint(f[11], 10, 64)
	stime, _ := strconv.ParseUint(f[12], 10, 64)
	return utime + stime, nil
}

// machineTicks is the busy time of all CPUs in clock ticks (everything in
// /proc/stat's cpu line but idle and iowait).
func machineTicks() (uint64, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	var busy uint64
	for i, s := range f[1:] {
		v, _ := strconv.ParseUint(s, 10, 64)
		if i != 3 && i != 4 {
			busy += v
		}
	}
	return busy, nil
}

// retransmits is the TCP segments retransmitted by the namespace's kernel.
func retransmits(ns *topology.NS) (n uint64, err error) {
	err = ns.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		var names []string
		for line := range strings.Lines(string(b)) {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != "Tcp:" {
				continue
			}
			if names == nil {
				names = f
				continue
			}
			if i := slices.Index(names, "RetransSegs"); i > 0 && i < len(f) {
				n, err = strconv.ParseUint(f[i], 10, 64)
				return err
			}
		}
		return errors.New("no Tcp RetransSegs in /proc/net/snmp")
	})
	return n, err
}

// wrkResult is what one wrk run and the counters around it measured.
type wrkResult struct {
	reqs, rate        float64
	p50, p99          time.Duration
	errors            string
	machineCPU, owned time.Duration // per request
	ringFull, retrans uint64
}

var (
	wrkRequests = regexp.MustCompile(`(?m)^\s*(\d+) requests in`)
	wrkRate     = regexp.MustCompile(`(?m)^Requests/sec:\s+([\d.]+)`)
	wrkErrors   = regexp.MustCompile(`(?m)^\s*(Socket errors:.*|Non-2xx.*)$`)
)

func wrkPercentile(out, p string) time.Duration {
	m := regexp.MustCompile(`(?m)^\s+` + p + `%\s+([\d.]+)(us|ms|s)\s*$`).FindStringSubmatch(out)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	unit := map[string]time.Duration{"us": time.Microsecond, "ms": time.Millisecond, "s": time.Second}[m[2]]
	return time.Duration(v * float64(unit))
}

// BenchmarkServeHTTP is issue 14's measurement: the outside namespace's wrk
// against `fabricbridge app http` behind the daemon (native-copy) and against
// a kernel net/http server in the same bridge namespace serving the same
// body, alternately, at 50 and 1000 keep-alive connections. It reports each
// median as a ratio against the kernel's in the same run: req/s, CPU per
// request (the whole machine from /proc/stat; the serving processes from
// /proc/PID/stat: daemon and application against the kernel server, whose
// softirq work is not in its own time), p50/p99, stream ring-full drops and
// the client's retransmissions.
//
//	FB_REQUIRE_PRIVILEGED=1 go test -run '^$' -bench ServeHTTP -benchtime 1x -v ./cmd/fabricbridge
//
// FB_BENCH_ROUNDS (3), FB_BENCH_SECONDS (10, c1000 half of it), FB_BENCH_CONNS
// (50,1000) and FB_BENCH_PROFILE_DIR (CPU profiles of the daemon and the
// application during the first bridge round at the first connection count)
// change the run.
func BenchmarkServeHTTP(b *testing.B) {
	testenv.RequirePrivileged(b)
	wrk, err := exec.LookPath("wrk")
	if err != nil {
		b.Skip("wrk is not installed (Debian: apt-get install wrk)")
	}
	rounds := envInt("FB_BENCH_ROUNDS", 3)
	seconds := envInt("FB_BENCH_SECONDS", 10)
	conns := []int{50, 1000}
	if s := os.Getenv("FB_BENCH_CONNS"); s != "" {
		conns = nil
		for _, f := range strings.Split(s, ",") {
			n, _ := strconv.Atoi(f)
			conns = append(conns, n)
		}
	}
	const size = 4096
	const kernelPort, appPort = 8080, 80
	const metricsAddr = "127.0.0.1:9471" // inside the bridge namespace

	bridgeNS, outside, v := topology.Pair(b, topology.VethOptions{})
	if err := ethtool.DisableTxChecksum(outside, v.B.Name); err != nil {
		b.Fatal(err)
	}
	addr := v.A.Addr4.Addr()
	dir := b.TempDir()
	cfgPath := filepath.Join(dir, "fb.yaml")
	control := filepath.Join(dir, "control.sock")
	cfg := fmt.Sprintf(`interfaces: [{name: %s, path: native-copy}]
addresses: [%s]
applications: [{name: web, ports: [%d]}]
listeners: [{id: 1, name: http, protocol: tcp, port: %d, app: web}]
control: {socket: %s}
metrics: {address: %q}
`, v.A.Name, addr, appPort, appPort, control, metricsAddr)
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}

	profileDir := os.Getenv("FB_BENCH_PROFILE_DIR")
	profileEnv := func(name string) []string {
		if profileDir == "" {
			return nil
		}
		span := time.Duration(seconds) * time.Second * 8 / 10
		return []string{fmt.Sprintf("FB_BENCH_CPUPROFILE=%s,%s", filepath.Join(profileDir, name+".pprof"), span)}
	}
	main := []string{"FB_TEST_MAIN=1"}
	daemon := startServing(b, bridgeNS, "daemon", append(main, profileEnv("daemon")...), "run", "--config", cfgPath)
	waitServing(b, func() error { _, err := scrapeIn(bridgeNS, metricsAddr); return err }, daemon)
	kernel := startServing(b, bridgeNS, "kernel", []string{fmt.Sprintf("FB_BENCH_KERNEL_HTTP=:%d", kernelPort), fmt.Sprintf("FB_BENCH_SIZE=%d", size)})
	app := startServing(b, bridgeNS, "app", append(main, profileEnv("app")...), "app", "http", "--name", "web", "--control", control, "--listen", fmt.Sprintf(":%d", appPort), "--size", strconv.Itoa(size))
	get := func(port int) func() error {
		return func() error {
			tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
				err = outside.Do(func() (err error) {
					c, err = (&net.Dialer{Timeout: time.Second}).DialContext(ctx, network, a)
					return err
				})
				return c, err
			}}
			resp, err := (&http.Client{Transport: tr, Timeout: time.Second}).Get(fmt.Sprintf("http://%s/", net.JoinHostPort(addr.String(), strconv.Itoa(port))))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if n, err := io.Copy(io.Discard, resp.Body); err != nil || n != size {
				return fmt.Errorf("port %d answered %d bytes (%v)", port, n, err)
			}
			return nil
		}
	}
	waitServing(b, get(kernelPort), kernel)
	waitServing(b, get(appPort), app, daemon)
	profiled := profileDir == ""

	ringFull := func() uint64 {
		s, err := scrapeIn(bridgeNS, metricsAddr)
		if err != nil {
			b.Fatalf("metrics: %v\n%s", err, daemon.out.String())
		}
		var n float64
		for _, x := range metrics.Find(s, "fabricbridge_queue_rx_drops_total", metrics.L("reason", "ring_full")...) {
			n += x.Value
		}
		return uint64(n)
	}
	ticks := func(ps ...*servingProc) uint64 {
		var n uint64
		for _, p := range ps {
			t, err := p.cpuTicks()
			if err != nil {
				b.Fatal(err)
			}
			n += t
		}
		return n
	}
	tick := time.Second / 100 // USER_HZ on Linux
	run := func(port, c int, owners ...*servingProc) wrkResult {
		d := seconds
		if c > 100 {
			d = max(1, seconds/2)
		}
		m0, _ := machineTicks()
		o0 := ticks(owners...)
		r0, err := retransmits(outside)
		if err != nil {
			b.Fatal(err)
		}
		f0 := ringFull()
		// wrk needs a descriptor per connection; Go gives children the
		// limit it found, often 1024.
		script := fmt.Sprintf("ulimit -n $(ulimit -Hn) && exec %s -t2 -c%d -d%ds --latency http://%s/", wrk, c, d, net.JoinHostPort(addr.String(), strconv.Itoa(port)))
		out, err := exec.Command("ip", "netns", "exec", outside.Name, "sh", "-c", script).CombinedOutput()
		if err != nil {
			b.Fatalf("wrk: %v\n%s", err, out)
		}
		m1, _ := machineTicks()
		o1 := ticks(owners...)
		r1, _ := retransmits(outside)
		f1 := ringFull()
		var r wrkResult
		text := string(out)
		if m := wrkRequests.FindStringSubmatch(text); m != nil {
			r.reqs, _ = strconv.ParseFloat(m[1], 64)
		}
		if m := wrkRate.FindStringSubmatch(text); m != nil {
			r.rate, _ = strconv.ParseFloat(m[1], 64)
		}
		if r.reqs == 0 {
			b.Fatalf("wrk served nothing:\n%s", text)
		}
		r.p50, r.p99 = wrkPercentile(text, "50"), wrkPercentile(text, "99")
		if m := wrkErrors.FindAllString(text, -1); m != nil {
			r.errors = strings.Join(m, "; ")
		}
		r.machineCPU = time.Duration(float64(m1-m0) * float64(tick) / r.reqs)
		r.owned = time.Duration(float64(o1-o0) * float64(tick) / r.reqs)
		r.ringFull, r.retrans = f1-f0, r1-r0
		return r
	}

	b.ResetTimer()
	for range b.N {
		for _, c := range conns {
			var kr, br []wrkResult
			for i := range rounds {
				kr = append(kr, run(kernelPort, c, kernel))
				if !profiled {
					// The first bridge round is the profiles' window.
					daemon.cmd.Process.Signal(syscall.SIGUSR1)
					app.cmd.Process.Signal(syscall.SIGUSR1)
					profiled = true
				}
				br = append(br, run(appPort, c, daemon, app))
				for _, x := range []struct {
					who string
					r   wrkResult
				}{{"kernel", kr[i]}, {"bridge", br[i]}} {
					b.Logf("c=%d round %d %s: %.0f req/s, CPU/req machine %v serving %v, p50 %v p99 %v, ring-full %d, client retransmits %d %s",
						c, i, x.who, x.r.rate, x.r.machineCPU, x.r.owned, x.r.p50, x.r.p99, x.r.ringFull, x.r.retrans, x.r.errors)
				}
			}
			k, br1 := medianResult(kr), medianResult(br)
			b.Logf("c=%d medians of %d: bridge/kernel req/s %.0f/%.0f = %.2fx; CPU/req machine %v/%v = %.2fx; serving %v/%v = %.2fx; p50 %v/%v = %.2fx; p99 %v/%v = %.2fx; ring-full %d/%d; retransmits %d/%d",
				c, rounds, br1.rate, k.rate, br1.rate/k.rate, br1.machineCPU, k.machineCPU, ratio(br1.machineCPU, k.machineCPU),
				br1.owned, k.owned, ratio(br1.owned, k.owned), br1.p50, k.p50, ratio(br1.p50, k.p50), br1.p99, k.p99, ratio(br1.p99, k.p99),
				br1.ringFull, k.ringFull, br1.retrans, k.retrans)
			tag := fmt.Sprintf("c%d-", c)
			b.ReportMetric(br1.rate/k.rate, tag+"rate-ratio")
			b.ReportMetric(ratio(br1.machineCPU, k.machineCPU), tag+"cpu-ratio")
			b.ReportMetric(ratio(br1.p99, k.p99), tag+"p99-ratio")
			b.ReportMetric(float64(br1.ringFull), tag+"ring-full")
		}
	}
}

// medianResult takes each field's median on its own.
func medianResult(rs []wrkResult) wrkResult {
	med := func(f func(wrkResult) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	return wrkResult{
		rate:       med(func(r wrkResult) float64 { return r.rate }),
		p50:        time.Duration(med(func(r wrkResult) float64 { return float64(r.p50) })),
		p99:        time.Duration(med(func(r wrkResult) float64 { return float64(r.p99) })),
		machineCPU: time.Duration(med(func(r wrkResult) float64 { return float64(r.machineCPU) })),
		owned:      time.Duration(med(func(r wrkResult) float64 { return float64(r.owned) })),
		ringFull:   uint64(med(func(r wrkResult) float64 { return float64(r.ringFull) })),
		retrans:    uint64(med(func(r wrkResult) float64 { return float64(r.retrans) })),
	}
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// waitServing polls ready until it succeeds, failing with the output of the
// processes that should have made it so.
func waitServing(tb testing.TB, ready func() error, ps ...*servingProc) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		err := ready()
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			var logs strings.Builder
			for _, p := range ps {
				fmt.Fprintf(&logs, "--- %s:\n%s\n", p.name, p.out.String())
			}
			tb.Fatalf("not serving: %v\n%s", err, logs.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}
