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
	"reflect"
	"regexp"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// The serving benchmark's child processes are this test binary: with
// FB_TEST_MAIN=1 it is fabricbridge (TestMain), with FB_BENCH_KERNEL_HTTP
// and FB_BENCH_KERNEL_SINK the kernel baseline, with FB_BENCH_BULK_SEND the
// bulk sender, with FB_BENCH_BULK_GET the downloader. With FB_BENCH_CPUPROFILE=FILE,FOR a SIGUSR1 starts a CPU
// profile of FOR: the benchmark picks the window, and the daemon's signal
// handling would exit without flushing a profile kept to the end.
func init() {
	if spec := os.Getenv("FB_BENCH_CPUPROFILE"); spec != "" {
		profileOnSignal(spec)
	}
	if dst := os.Getenv("FB_BENCH_BULK_SEND"); dst != "" {
		if err := bulkSend(dst); err != nil {
			fmt.Fprintln(os.Stderr, "bulk:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if url := os.Getenv("FB_BENCH_BULK_GET"); url != "" {
		if err := bulkGet(url); err != nil {
			fmt.Fprintln(os.Stderr, "download:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	httpAddr, sinkAddr := os.Getenv("FB_BENCH_KERNEL_HTTP"), os.Getenv("FB_BENCH_KERNEL_SINK")
	if httpAddr != "" || sinkAddr != "" {
		fmt.Fprintln(os.Stderr, kernelBaseline(httpAddr, sinkAddr))
		os.Exit(1)
	}
}

// kernelBaseline serves on the kernel's stack what `app http` and `app
// sink` serve on the user-space one, with their own handlers.
func kernelBaseline(httpAddr, sinkAddr string) error {
	if sinkAddr != "" {
		ln, err := net.Listen("tcp", sinkAddr)
		if err != nil {
			return err
		}
		var received atomic.Int64
		sink := func() error {
			for {
				c, err := ln.Accept()
				if err != nil {
					return err
				}
				go func() {
					defer c.Close()
					sinkConn(c, &received)
				}()
			}
		}
		if httpAddr == "" {
			return sink()
		}
		go sink()
	}
	size, _ := strconv.Atoi(os.Getenv("FB_BENCH_SIZE"))
	srv := &http.Server{Addr: httpAddr, Handler: httpHandler(size, &httpCounters{}), ReadHeaderTimeout: 10 * time.Second}
	return srv.ListenAndServe()
}

// bulkSend sends FB_BENCH_BULK_BYTES to dst on one connection and prints
// how long the sink took to have them all: the sink closes once it has read
// to the end, so the time runs from the dial to that close.
func bulkSend(dst string) error {
	n, err := strconv.ParseInt(os.Getenv("FB_BENCH_BULK_BYTES"), 10, 64)
	if err != nil || n <= 0 {
		return fmt.Errorf("FB_BENCH_BULK_BYTES=%q is not a positive count", os.Getenv("FB_BENCH_BULK_BYTES"))
	}
	start := time.Now()
	c, err := net.DialTimeout("tcp", dst, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(start.Add(2 * time.Minute))
	buf := make([]byte, 256<<10)
	for left := n; left > 0; {
		k, err := c.Write(buf[:min(left, int64(len(buf)))])
		if err != nil {
			return err
		}
		left -= int64(k)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return err
	}
	if _, err := io.Copy(io.Discard, c); err != nil {
		return fmt.Errorf("waiting for the sink to close: %w", err)
	}
	fmt.Printf("bulk: %d bytes in %d ns\n", n, time.Since(start))
	return nil
}

// bulkGet downloads url, a /bytes/N of httpHandler, on one connection and
// prints, as bulkSend does, how long the whole body took from the dial.
func bulkGet(url string) error {
	start := time.Now()
	c := &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{DisableCompression: true}}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	n, err := io.CopyBuffer(io.Discard, resp.Body, make([]byte, 256<<10))
	if err != nil {
		return err
	}
	if n != resp.ContentLength {
		return fmt.Errorf("GET %s: %d bytes of %d", url, n, resp.ContentLength)
	}
	fmt.Printf("bulk: %d bytes in %d ns\n", n, time.Since(start))
	return nil
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
		// The first window is FILE, the n-th FILE with -n before its
		// extension.
		for n := 1; ; n++ {
			<-sig
			name := file
			if n > 1 {
				ext := filepath.Ext(file)
				name = fmt.Sprintf("%s-%d%s", strings.TrimSuffix(file, ext), n, ext)
			}
			if err := profileFor(name, d); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
		}
	}()
}

func profileFor(file string, d time.Duration) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		return err
	}
	time.Sleep(d)
	pprof.StopCPUProfile()
	return nil
}

// servingProc is one serving process in the bridge namespace.
type servingProc struct {
	name string
	cmd  *exec.Cmd
	out  *testenv.Output
}

// startServing starts the test binary in ns with args, on cpus (nil: where
// the benchmark itself may run).
func startServing(tb testing.TB, ns *topology.NS, name string, env []string, cpus []int, args ...string) *servingProc {
	tb.Helper()
	self, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	return startCommand(tb, ns, name, env, cpus, append([]string{self}, args...)...)
}

// startCommand is startServing for any program: argv[0] and its arguments.
func startCommand(tb testing.TB, ns *topology.NS, name string, env []string, cpus []int, argv ...string) *servingProc {
	tb.Helper()
	p := &servingProc{name: name, out: &testenv.Output{}}
	// ip netns exec execs the command: the pid is the server's.
	p.cmd = exec.Command("ip", append([]string{"netns", "exec", ns.Name}, argv...)...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := startPinned(p.cmd, cpus); err != nil {
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

// startPinned starts cmd confined to cpus (nil: not confined). The fork
// happens on a thread confined to them, and the child keeps that affinity
// across exec, for every thread it makes: setting it on a running child
// would race with the threads the Go runtime starts.
func startPinned(cmd *exec.Cmd, cpus []int) error {
	if len(cpus) == 0 {
		return cmd.Start()
	}
	started := make(chan error, 1)
	go func() {
		// Never unlocked: the runtime ends the thread, still confined, with
		// the goroutine. Threads the runtime starts meanwhile come from its
		// template thread, not from this one.
		runtime.LockOSThread()
		var set unix.CPUSet
		for _, c := range cpus {
			set.Set(c)
		}
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			started <- fmt.Errorf("confine %s to CPUs %s: %w", cmd.Path, formatCPUs(cpus), err)
			return
		}
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		// What the kernel says the child got: a benchmark that believes it
		// pinned must have.
		var got unix.CPUSet
		if err := unix.SchedGetaffinity(cmd.Process.Pid, &got); err == nil && got != set {
			cmd.Process.Kill()
			cmd.Wait()
			started <- fmt.Errorf("%s runs on other CPUs than %s", cmd.Path, formatCPUs(cpus))
			return
		}
		started <- nil
	}()
	return <-started
}

// benchPin is FB_BENCH_PIN: the CPUs of the bridge's loop, of the
// applications on it and of the clients outside.
type benchPin struct{ loop, app, client []int }

// parseBenchPin reads loop=CPUS,app=CPUS,client=CPUS, each part once, CPUS
// a list like 2, 3-5 or 3-5,7 (a piece without = continues the part before
// it) of CPUs in allowed.
func parseBenchPin(spec string, allowed *unix.CPUSet) (benchPin, error) {
	var p benchPin
	bad := func(format string, args ...any) (benchPin, error) {
		return benchPin{}, fmt.Errorf("FB_BENCH_PIN=%q: %s; want loop=CPUS,app=CPUS,client=CPUS, CPUS like 2, 3-5 or 3-5,7", spec, fmt.Sprintf(format, args...))
	}
	parts := map[string]*[]int{"loop": &p.loop, "app": &p.app, "client": &p.client}
	given := map[string]bool{}
	var cur *[]int
	for piece := range strings.SplitSeq(spec, ",") {
		if key, list, ok := strings.Cut(piece, "="); ok {
			if parts[key] == nil {
				return bad("unknown part %q", key)
			}
			if given[key] {
				return bad("%s is given twice", key)
			}
			given[key], cur, piece = true, parts[key], list
		} else if cur == nil {
			return bad("%q belongs to no part", piece)
		}
		lo, hi, isRange := strings.Cut(piece, "-")
		first, err := cpuNumber(lo)
		last := first
		if err == nil && isRange {
			last, err = cpuNumber(hi)
		}
		if err != nil || last < first {
			return bad("%q is neither a CPU nor a range of CPUs", piece)
		}
		for c := first; c <= last; c++ {
			if c >= len(allowed)*64 || !allowed.IsSet(c) {
				return bad("CPU %d is not one this process may run on", c)
			}
			if slices.Contains(*cur, c) {
				return bad("CPU %d is listed twice in one part", c)
			}
			*cur = append(*cur, c)
		}
	}
	for _, key := range []string{"loop", "app", "client"} {
		if !given[key] {
			return bad("%s is missing", key)
		}
	}
	return p, nil
}

func TestParseBenchPin(t *testing.T) {
	var allowed unix.CPUSet
	for c := range 12 {
		allowed.Set(c)
	}
	for _, tc := range []struct {
		spec string
		want benchPin
	}{
		{"loop=2,app=3-5,client=8-11", benchPin{[]int{2}, []int{3, 4, 5}, []int{8, 9, 10, 11}}},
		{"client=0,app=3,5-6,loop=1-2", benchPin{[]int{1, 2}, []int{3, 5, 6}, []int{0}}},
		{"loop=0,app=0,client=0", benchPin{[]int{0}, []int{0}, []int{0}}},
	} {
		got, err := parseBenchPin(tc.spec, &allowed)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseBenchPin(%q) = %v, %v; want %v", tc.spec, got, err, tc.want)
		}
	}
	for spec, why := range map[string]string{
		"":                              `"" belongs to no part`,
		"loop=2,app=3":                  "client is missing",
		"loop=2,app=3,client=4,loop=5":  "loop is given twice",
		"loop=2,app=3,client=4,irq=5":   `unknown part "irq"`,
		"loop=,app=3,client=4":          `"" is neither`,
		"loop=2,app=5-3,client=4":       `"5-3" is neither`,
		"loop=+2,app=3,client=4":        `"+2" is neither`,
		"loop=2,app=3-,client=4":        `"3-" is neither`,
		"loop=2,app=3,,client=4":        `"" is neither`,
		"loop=2 ,app=3,client=4":        `"2 " is neither`,
		"loop=2,app=3-4,3,client=5":     "CPU 3 is listed twice",
		"loop=2,app=3,client=12":        "CPU 12 is not one this process may run on",
		"loop=2,app=3,client=100000000": `"100000000" is neither`,
		"2,loop=2,app=3,client=4":       `"2" belongs to no part`,
	} {
		_, err := parseBenchPin(spec, &allowed)
		if err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("parseBenchPin(%q) = %v; want an error saying %s", spec, err, why)
		}
	}
	if got := formatCPUs([]int{0, 1, 2, 3, 6, 8, 9}); got != "0-3,6,8-9" {
		t.Errorf("formatCPUs = %q, want 0-3,6,8-9", got)
	}
}

func TestStartPinned(t *testing.T) {
	var before unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	last := -1
	for c := range len(before) * 64 {
		if before.IsSet(c) {
			last = c
		}
	}
	cmd := exec.Command("sh", "-c", "grep Cpus_allowed_list /proc/self/status")
	var out strings.Builder
	cmd.Stdout = &out
	if err := startPinned(cmd, []int{last}); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Fields(out.String()), []string{"Cpus_allowed_list:", strconv.Itoa(last)}; !slices.Equal(got, want) {
		t.Errorf("pinned child says %q, want %q", got, want)
	}
	// The confined thread must not go back to the runtime's pool.
	for range 20 {
		var now unix.CPUSet
		runtime.Gosched()
		if err := unix.SchedGetaffinity(0, &now); err != nil || now != before {
			t.Fatalf("the test's own threads now run on %v (%v), want %v", now, err, before)
		}
	}
}

func TestAbReport(t *testing.T) {
	const report = `Concurrency Level:      1000
Time taken for tests:   2.273 seconds
Complete requests:      20000
Failed requests:        3
   (Connect: 0, Receive: 0, Length: 3, Exceptions: 0)
Non-2xx responses:      2
Requests per second:    8799.12 [#/sec] (mean)
Time per request:       113.648 [ms] (mean)

Percentage of the requests served within a certain time (ms)
  50%     58
  66%     61
  99%   1043
 100%   1050 (longest request)
`
	r, err := abTool.parse(report)
	if err != nil {
		t.Fatal(err)
	}
	want := requestResult{reqs: 20000, rate: 8799.12, p50: 58 * time.Millisecond, p99: 1043 * time.Millisecond,
		errors: "Failed requests:        3; Non-2xx responses:      2"}
	if r != want {
		t.Errorf("ab report read as %+v, want %+v", r, want)
	}
	if _, err := abTool.parse("apr_socket_connect(): Connection refused (111)\n"); err == nil {
		t.Error("a report without requests reads as a result")
	}
}

// cpuNumber reads a CPU number: decimal digits only, so that a sign or a
// stray space is an error rather than a CPU.
func cpuNumber(s string) (int, error) {
	if s == "" || len(s) > 4 || strings.Trim(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a CPU number", s)
	}
	return strconv.Atoi(s)
}

// formatCPUs writes sorted CPUs the way the kernel's cpulist files do: 0-3,6.
func formatCPUs(cpus []int) string {
	var parts []string
	for i := 0; i < len(cpus); i++ {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(cpus[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", cpus[i], cpus[j]))
		}
		i = j
	}
	return strings.Join(parts, ",")
}

// cpuTicks is the process's user and system time in clock ticks.
func (p *servingProc) cpuTicks() (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name, which may hold spaces, in parentheses.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 15 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", p.cmd.Process.Pid, len(f))
	}
	// utime, stime, and the same of children it has reaped (socat's
	// sink forks one per connection).
	var sum uint64
	for _, x := range f[11:15] {
		n, _ := strconv.ParseUint(x, 10, 64)
		sum += n
	}
	return sum, nil
}

// peakRSS is the process's peak resident set in KiB (VmHWM).
func (p *servingProc) peakRSS() (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			return strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("/proc/%d/status: no VmHWM", p.cmd.Process.Pid)
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

// clientTCP is the namespace's kernel TCP counters: segments received, sent
// and retransmitted. Outside, they count what the server's side put on the
// wire per request (a pure ACK the server need not send costs both sides).
func clientTCP(ns *topology.NS) (in, out, retrans uint64, err error) {
	v, err := netCounters(ns, "snmp", "Tcp:", "InSegs", "OutSegs", "RetransSegs")
	if err != nil {
		return 0, 0, 0, err
	}
	return v[0], v[1], v[2], nil
}

// netCounters reads the named counters of one protocol's table in the
// namespace's /proc/net/snmp or /proc/net/netstat: a line of names after
// prefix, then a line of values.
func netCounters(ns *topology.NS, file, prefix string, names ...string) ([]uint64, error) {
	vals := make([]uint64, len(names))
	err := ns.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/" + file)
		if err != nil {
			return err
		}
		var header []string
		for line := range strings.Lines(string(b)) {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != prefix {
				continue
			}
			if header == nil {
				header = f
				continue
			}
			for j, name := range names {
				i := slices.Index(header, name)
				if i <= 0 || i >= len(f) {
					return fmt.Errorf("no %s %s in /proc/net/%s", prefix, name, file)
				}
				if vals[j], err = strconv.ParseUint(f[i], 10, 64); err != nil {
					return err
				}
			}
			return nil
		}
		return fmt.Errorf("no %s counters in /proc/net/%s", prefix, file)
	})
	return vals, err
}

// serveCounters are what the benchmark reads before and after each client run,
// in clock ticks (machine: all CPUs busy; owned: the serving processes) and
// counts. lead is the first serving process's share of owned (the
// daemon's, on the bridge's side); client, the client process's own CPU
// time, and wall, how long it ran, are filled in after it exits.
type serveCounters struct {
	machine, owned, lead, ringFull, retrans, segsIn, segsOut uint64
	client, wall                                             time.Duration
	why                                                      retransKinds
}

func (c serveCounters) since(before serveCounters) serveCounters {
	d := serveCounters{c.machine - before.machine, c.owned - before.owned, c.lead - before.lead, c.ringFull - before.ringFull, c.retrans - before.retrans,
		c.segsIn - before.segsIn, c.segsOut - before.segsOut, c.client - before.client, c.wall - before.wall, retransKinds{}}
	for i := range d.why {
		d.why[i] = c.why[i] - before.why[i]
	}
	return d
}

// retransKinds are the client's TcpExt counters that say why it
// retransmitted, in the order of retransKindNames.
type retransKinds [3]uint64

var retransKindNames = [...]string{"TCPSynRetrans", "TCPTimeouts", "TCPLossProbes"}

// String is empty when nothing was counted, else the counts in brackets.
func (k retransKinds) String() string {
	if k == (retransKinds{}) {
		return ""
	}
	return fmt.Sprintf(" (SYN %d, timeouts %d, loss probes %d)", k[0], k[1], k[2])
}

// clientTCPExt reads the namespace's retransmission causes.
func clientTCPExt(ns *topology.NS) (k retransKinds, err error) {
	v, err := netCounters(ns, "netstat", "TcpExt:", retransKindNames[:]...)
	if err == nil {
		copy(k[:], v)
	}
	return k, err
}

// clockTick is USER_HZ on Linux.
const clockTick = time.Second / 100

// requestResult is what one wrk or ab run and the counters around it measured.
type requestResult struct {
	reqs, rate        float64
	p50, p99          time.Duration
	errors            string
	machineCPU, owned time.Duration // per request
	lead              time.Duration // per request: the daemon's part of owned
	ringFull, retrans uint64
	why               retransKinds
	// segsIn and segsOut are the client's TCP segments received and sent
	// per request.
	segsIn, segsOut float64
}

// charge spreads the counters' CPU time over the run's requests.
func (r *requestResult) charge(d serveCounters) {
	r.machineCPU = time.Duration(float64(d.machine) * float64(clockTick) / r.reqs)
	r.owned = time.Duration(float64(d.owned) * float64(clockTick) / r.reqs)
	r.lead = time.Duration(float64(d.lead) * float64(clockTick) / r.reqs)
	r.ringFull, r.retrans, r.why = d.ringFull, d.retrans, d.why
	r.segsIn, r.segsOut = float64(d.segsIn)/r.reqs, float64(d.segsOut)/r.reqs
}

var (
	wrkRequests = regexp.MustCompile(`(?m)^\s*(\d+) requests in`)
	wrkRate     = regexp.MustCompile(`(?m)^Requests/sec:\s+([\d.]+)`)
	wrkErrors   = regexp.MustCompile(`(?m)^\s*(Socket errors:.*|Non-2xx.*)$`)

	abComplete = regexp.MustCompile(`(?m)^Complete requests:\s+(\d+)`)
	abRate     = regexp.MustCompile(`(?m)^Requests per second:\s+([\d.]+)`)
	abErrors   = regexp.MustCompile(`(?m)^(Failed requests:\s+[1-9].*|Non-2xx responses:.*)$`)
	bulkDone   = regexp.MustCompile(`(?m)^bulk: (\d+) bytes in (\d+) ns$`)
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

// abPercentile reads ab's table of the requests served within a time, in
// whole milliseconds.
func abPercentile(out, p string) time.Duration {
	m := regexp.MustCompile(`(?m)^\s+` + p + `%\s+(\d+)\s*$`).FindStringSubmatch(out)
	if m == nil {
		return 0
	}
	v, _ := strconv.Atoi(m[1])
	return time.Duration(v) * time.Millisecond
}

// firstFloat reads the first submatch of re in text; 0 if there is none.
func firstFloat(re *regexp.Regexp, text string) float64 {
	m := re.FindStringSubmatch(text)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v
}

// requestTool is how to read a load generator's report.
type requestTool struct {
	name                   string
	requests, rate, errors *regexp.Regexp
	percentile             func(out, p string) time.Duration
}

var (
	wrkTool = requestTool{"wrk", wrkRequests, wrkRate, wrkErrors, wrkPercentile}
	abTool  = requestTool{"ab", abComplete, abRate, abErrors, abPercentile}
)

func (t requestTool) parse(text string) (requestResult, error) {
	r := requestResult{reqs: firstFloat(t.requests, text), rate: firstFloat(t.rate, text)}
	if r.reqs == 0 {
		return r, fmt.Errorf("%s served nothing:\n%s", t.name, text)
	}
	r.p50, r.p99 = t.percentile(text, "50"), t.percentile(text, "99")
	if m := t.errors.FindAllString(text, -1); m != nil {
		r.errors = strings.Join(m, "; ")
	}
	return r, nil
}

// bulkClient is how a bulk transfer's client moves the bytes.
type bulkClient int

const (
	viaSend  bulkClient = iota // this binary sends (bulkSend)
	viaGet                     // this binary downloads (bulkGet)
	viaSocat                   // socat sends from /dev/zero
)

// bulkResult is what one bulk transfer and the counters around it measured.
type bulkResult struct {
	gbps, cpuPerGB float64 // Gbit/s; the machine's CPU seconds per 10⁹ bytes
	// servingPerGB and clientPerGB split cpuPerGB: the serving processes'
	// own time (daemon and application, or the kernel server) and the
	// client's; the rest is softirq work outside both and other threads.
	servingPerGB, clientPerGB float64
	ringFull, retrans         uint64
	why                       retransKinds
	// segsIn and segsOut are the client's TCP segments received and sent
	// per MiB moved: the sender's ACKs in, or the downloader's data.
	segsIn, segsOut float64
}

// BenchmarkServeHTTP is issue 14's measurement: clients in the outside
// namespace against `fabricbridge app http` and `app sink` behind the daemon
// (native-copy) and against a kernel server in the same bridge namespace
// doing the same (net/http with the same handler; a sink with the same read
// loop), alternately, so that each median is a ratio against the kernel's in
// the same run:
//
//   - wrk at 50 and 1000 keep-alive connections: req/s, CPU per request
//     (the whole machine from /proc/stat; the serving processes from
//     /proc/PID/stat: daemon and application against the kernel server,
//     whose softirq work is not in its own time), p50/p99, stream ring-full
//     drops and the client's retransmissions;
//
//   - ab -n 20000 -c 1000, a connection per request (new connections per
//     second), the same figures; skipped, with a note, without ab (Debian:
//     apache2-utils);
//
//   - one connection sending FB_BENCH_BULK_MB MiB (1000; 0: none) from a
//     process of its own into `app sink` and a kernel sink, then one
//     downloading as much from each HTTP server (/bytes/N): Gbit/s and the
//     machine's CPU seconds per GB.
//
//     FB_REQUIRE_PRIVILEGED=1 go test -run '^$' -bench ServeHTTP -benchtime 1x -v ./cmd/fabricbridge
//
// FB_BENCH_ROUNDS (3, for each test), FB_BENCH_SECONDS (10, c1000 half of
// it), FB_BENCH_CONNS (50,1000; none: no wrk), FB_BENCH_AB (0: no ab),
// FB_BENCH_BULK (which transfers: "bulk,bulk socat,download", the default) and
// FB_BENCH_PROFILE_DIR (CPU profiles of the daemon and the application
// during the first bridge round at the first connection count, or its
// round FB_BENCH_PROFILE_ROUND, counted from 0; with FB_BENCH_CONNS=none,
// two seconds of the first transfer into the sink (daemon.pprof,
// sink.pprof) and of the first download (daemon-2.pprof, app.pprof); with no transfers either
// (FB_BENCH_BULK_MB=0), two seconds of ab's first bridge round) change the
// run. FB_BENCH_PIN=loop=2,app=3-5,client=8-11
// pins the bridge's loop (the interface's cpus; the daemon's other threads
// go to loop and app CPUs), the applications, the kernel server (to the loop
// and app CPUs together, the cores both sides get) and the clients.
// FB_BENCH_INSTANCES runs that many instances of `app http` (web-1, ...),
// which the daemon spreads connections over, FB_BENCH_STACKS that many
// stacks in each application process (`app http --stacks`), and
// FB_BENCH_QUEUES gives the
// veth that many queue pairs, one loop each (pin them with FB_BENCH_PIN's
// loop CPUs): on a machine with cores to spare, several stacks with a
// stream and a loop each instead of one stack on several cores.
// FB_BENCH_APP_ARGS adds flags to every application ("--spin 50us").
// FB_BENCH_INTERFACE adds settings to the daemon's interface, such as
// "no_segment_offload: true". FB_BENCH_BINARY runs another build's
// fabricbridge as the daemon and the applications (the same config and
// flags), for an A/B against an older release.
func BenchmarkServeHTTP(b *testing.B) {
	testenv.RequirePrivileged(b)
	wrk, err := exec.LookPath("wrk")
	if err != nil {
		b.Skip("wrk is not installed (Debian: apt-get install wrk)")
	}
	ab, abErr := exec.LookPath("ab")
	if abErr != nil {
		abErr = errors.New("ab is not installed (Debian: apt-get install apache2-utils)")
	}
	if os.Getenv("FB_BENCH_AB") == "0" {
		ab, abErr = "", errors.New("skipped (FB_BENCH_AB=0)")
	}
	rounds := envInt("FB_BENCH_ROUNDS", 3)
	seconds := envInt("FB_BENCH_SECONDS", 10)
	instances := envInt("FB_BENCH_INSTANCES", 1)
	stacks := envInt("FB_BENCH_STACKS", 1)
	queues := envInt("FB_BENCH_QUEUES", 1)
	conns := []int{50, 1000}
	if s := os.Getenv("FB_BENCH_CONNS"); s == "none" {
		conns = nil
	} else if s != "" {
		conns = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n <= 0 {
				b.Fatalf("FB_BENCH_CONNS=%q: want connection counts such as 50,1000, or none", s)
			}
			conns = append(conns, n)
		}
	}
	bulkMB := 1000
	if s := os.Getenv("FB_BENCH_BULK_MB"); s != "" {
		if bulkMB, err = strconv.Atoi(s); err != nil || bulkMB < 0 {
			b.Fatalf("FB_BENCH_BULK_MB=%q: want MiB to send, 0 for none", s)
		}
	}
	var pin benchPin
	if spec := os.Getenv("FB_BENCH_PIN"); spec != "" {
		var allowed unix.CPUSet
		if err := unix.SchedGetaffinity(0, &allowed); err != nil {
			b.Fatal(err)
		}
		if pin, err = parseBenchPin(spec, &allowed); err != nil {
			b.Fatal(err)
		}
	}
	if abErr != nil {
		b.Logf("clients: %s; ab: %v", wrk, abErr)
	} else {
		b.Logf("clients: %s; ab: %s", wrk, ab)
	}
	servers := slices.Compact(slices.Sorted(slices.Values(slices.Concat(pin.loop, pin.app))))
	if servers != nil {
		b.Logf("pinned: bridge loop on CPUs %s (the daemon's other threads on %s), applications on %s, kernel server on %s, clients (wrk, ab, bulk sender) on %s",
			formatCPUs(pin.loop), formatCPUs(servers), formatCPUs(pin.app), formatCPUs(servers), formatCPUs(pin.client))
	}
	const size = 4096
	const kernelPort, appPort = 8080, 80
	const kernelSinkPort, socatSinkPort, sinkPort = 8009, 8010, 9
	const abRequests, abConns = 20000, 1000
	const metricsAddr = "127.0.0.1:9471" // inside the bridge namespace

	bridgeNS, outside, v := topology.Pair(b, topology.VethOptions{Queues: queues})
	if err := ethtool.DisableTxChecksum(outside, v.B.Name); err != nil {
		b.Fatal(err)
	}
	addr := v.A.Addr4.Addr()
	dir := b.TempDir()
	cfgPath := filepath.Join(dir, "fb.yaml")
	control := filepath.Join(dir, "control.sock")
	loopCPUs := ""
	if pin.loop != nil {
		var list []string
		for _, c := range pin.loop {
			list = append(list, strconv.Itoa(c))
		}
		loopCPUs = ", cpus: [" + strings.Join(list, ", ") + "]"
	}
	if extra := os.Getenv("FB_BENCH_INTERFACE"); extra != "" {
		loopCPUs += ", " + extra
	}
	// A configured listener belongs to one registration of its
	// application; several instances each claim the port when they listen.
	webListener := fmt.Sprintf("  - {id: 1, name: http, protocol: tcp, port: %d, app: web}\n", appPort)
	if instances > 1 || stacks > 1 {
		webListener = ""
	}
	cfg := fmt.Sprintf(`interfaces: [{name: %s, path: native-copy%s}]
addresses: [%s]
applications: [{name: web, ports: [%d]}, {name: bulk, ports: [%d]}]
listeners:
%s  - {id: 2, name: sink, protocol: tcp, port: %d, app: bulk}
control: {socket: %s}
metrics: {address: %q}
`, v.A.Name, loopCPUs, addr, appPort, sinkPort, webListener, sinkPort, control, metricsAddr)
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}

	profileDir := os.Getenv("FB_BENCH_PROFILE_DIR")
	profileEnv := func(name string) []string {
		if profileDir == "" {
			return nil
		}
		// The window is a bridge round, as long as wrkRun makes it;
		// without wrk, two seconds of the first bulk transfer into the sink.
		span := 2 * time.Second
		if len(conns) > 0 {
			first := seconds
			if conns[0] > 100 {
				first = max(1, seconds/2)
			}
			span = time.Duration(first) * time.Second * 8 / 10
		}
		return []string{fmt.Sprintf("FB_BENCH_CPUPROFILE=%s,%s", filepath.Join(profileDir, name+".pprof"), span)}
	}
	main := []string{"FB_TEST_MAIN=1"}
	// startFabricbridge starts this binary as fabricbridge or, with
	// FB_BENCH_BINARY, another build's (an A/B against a release; the
	// kernel side and the clients stay this binary's, and profiles are
	// this binary's only).
	bin := os.Getenv("FB_BENCH_BINARY")
	startFabricbridge := func(name string, cpus []int, env []string, args ...string) *servingProc {
		if bin != "" {
			return startCommand(b, bridgeNS, name, env, cpus, append([]string{bin}, args...)...)
		}
		return startServing(b, bridgeNS, name, slices.Concat(main, profileEnv(name), env), cpus, args...)
	}
	if bin != "" {
		if profileDir != "" {
			b.Fatal("FB_BENCH_PROFILE_DIR profiles this binary only: unset it or FB_BENCH_BINARY")
		}
		b.Logf("daemon and applications: %s", bin)
	}
	daemon := startFabricbridge("daemon", servers, nil, "run", "--config", cfgPath)
	waitServing(b, func() error { _, err := scrapeIn(bridgeNS, metricsAddr); return err }, daemon)
	kernel := startServing(b, bridgeNS, "kernel", []string{fmt.Sprintf("FB_BENCH_KERNEL_HTTP=:%d", kernelPort), fmt.Sprintf("FB_BENCH_KERNEL_SINK=:%d", kernelSinkPort), fmt.Sprintf("FB_BENCH_SIZE=%d", size)}, servers)
	apps := make([]*servingProc, instances)
	// FB_BENCH_APP_ARGS: more flags for every application, the sink's too
	// (such as "--spin 50us" where they have cores of their own).
	appArgs := strings.Fields(os.Getenv("FB_BENCH_APP_ARGS"))
	// Pinned instances share the application CPUs: each gets its part of
	// them as Go threads, not all of them.
	var instanceEnv []string
	if instances > 1 && pin.app != nil {
		instanceEnv = []string{fmt.Sprintf("GOMAXPROCS=%d", max(1, len(pin.app)/instances))}
	}
	for i := range apps {
		name, args := "app", []string{"app", "http", "--name", "web", "--control", control, "--listen", fmt.Sprintf(":%d", appPort), "--size", strconv.Itoa(size)}
		if instances > 1 {
			name = fmt.Sprintf("app-%d", i+1)
			args = append(args, "--instance", fmt.Sprintf("web-%d", i+1))
		}
		if stacks > 1 {
			args = append(args, "--instance", fmt.Sprintf("web-%d", i+1), "--stacks", strconv.Itoa(stacks))
		}
		apps[i] = startFabricbridge(name, pin.app, instanceEnv, append(args, appArgs...)...)
	}
	app := apps[0] // the one profiled
	bridgeSide := append([]*servingProc{daemon}, apps...)
	if instances > 1 || stacks > 1 {
		b.Logf("%d instances of the application %v with %d stacks each, the veth with %d queue pairs", instances, instanceEnv, stacks, queues)
	}
	var sink, socatSink *servingProc
	socat, socatErr := exec.LookPath("socat")
	if bulkMB > 0 {
		sink = startFabricbridge("sink", pin.app, nil, append([]string{"app", "sink", "--name", "bulk", "--control", control, "--listen", fmt.Sprintf(":%d", sinkPort), "--every", "1h"}, appArgs...)...)
		if socatErr == nil {
			// The issue's own kernel sink: socat into /dev/null, a process
			// forked per connection.
			socatSink = startCommand(b, bridgeNS, "socat sink", nil, servers, socat, "-u", fmt.Sprintf("TCP-LISTEN:%d,reuseaddr,fork", socatSinkPort), "OPEN:/dev/null")
		}
	}
	hostPort := func(port int) string { return net.JoinHostPort(addr.String(), strconv.Itoa(port)) }
	dial := func(ctx context.Context, network, a string) (c net.Conn, err error) {
		err = outside.Do(func() (err error) {
			c, err = (&net.Dialer{Timeout: time.Second}).DialContext(ctx, network, a)
			return err
		})
		return c, err
	}
	get := func(port int) func() error {
		return func() error {
			tr := &http.Transport{DisableKeepAlives: true, DialContext: dial}
			resp, err := (&http.Client{Transport: tr, Timeout: time.Second}).Get("http://" + hostPort(port) + "/")
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
	accepts := func(port int) func() error {
		return func() error {
			c, err := dial(context.Background(), "tcp", hostPort(port))
			if err == nil {
				c.Close()
			}
			return err
		}
	}
	waitServing(b, get(kernelPort), kernel)
	waitServing(b, get(appPort), bridgeSide...)
	if instances > 1 {
		waitServing(b, func() error {
			s, err := scrapeIn(bridgeNS, metricsAddr)
			if err != nil {
				return err
			}
			if in := metrics.Find(s, "fabricbridge_spread_instances", metrics.L("app", "web")...); len(in) != 1 || in[0].Value != float64(instances) {
				return fmt.Errorf("the daemon spreads web over %v instances, want %d", in, instances)
			}
			return nil
		}, bridgeSide...)
	}
	if sink != nil {
		waitServing(b, accepts(kernelSinkPort), kernel)
		waitServing(b, accepts(sinkPort), sink, daemon)
	}
	if socatSink != nil {
		waitServing(b, accepts(socatSinkPort), socatSink)
	}
	profiled := profileDir == ""
	profileRound := envInt("FB_BENCH_PROFILE_ROUND", 0)

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
	// sample reads the counters; the metrics scrape, which costs the
	// daemon CPU, comes before the clocks in the sample that opens a run
	// and after them in the one that closes it, so it is never charged.
	sample := func(opening bool, owners ...*servingProc) serveCounters {
		var c serveCounters
		var err error
		if opening {
			c.ringFull = ringFull()
		}
		if c.machine, err = machineTicks(); err != nil {
			b.Fatal(err)
		}
		for i, p := range owners {
			t, err := p.cpuTicks()
			if err != nil {
				b.Fatal(err)
			}
			c.owned += t
			if i == 0 {
				c.lead = t
			}
		}
		if c.segsIn, c.segsOut, c.retrans, err = clientTCP(outside); err != nil {
			b.Fatal(err)
		}
		if c.why, err = clientTCPExt(outside); err != nil {
			b.Fatal(err)
		}
		if !opening {
			c.ringFull = ringFull()
		}
		return c
	}
	// runClient runs args in the outside namespace on the client CPUs and
	// returns what it wrote, with the counters over its run.
	//
	// linger waits after the client's exit before the closing sample, for
	// a server that finishes its part after the client is gone (socat's
	// sink, whose child must be reaped for its parent's time to hold it).
	runClient := func(linger time.Duration, owners []*servingProc, env []string, args ...string) (string, serveCounters) {
		cmd := exec.Command("ip", append([]string{"netns", "exec", outside.Name}, args...)...)
		cmd.Env = append(os.Environ(), env...)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		before := sample(true, owners...)
		start := time.Now()
		err := startPinned(cmd, pin.client)
		if err == nil {
			err = cmd.Wait()
		}
		wall := time.Since(start)
		if err != nil {
			b.Fatalf("%s: %v\n%s", args[0], err, out.String())
		}
		time.Sleep(linger)
		delta := sample(false, owners...).since(before)
		delta.client, delta.wall = cmd.ProcessState.UserTime()+cmd.ProcessState.SystemTime(), wall
		return out.String(), delta
	}
	load := func(tool requestTool, cmdline string, owners ...*servingProc) requestResult {
		// wrk and ab need a descriptor per connection; Go gives children
		// the limit it found, often 1024.
		text, delta := runClient(0, owners, nil, "sh", "-c", "ulimit -n $(ulimit -Hn) && exec "+cmdline)
		r, err := tool.parse(text)
		if err != nil {
			b.Fatal(err)
		}
		r.charge(delta)
		return r
	}
	wrkRun := func(port, c int, owners ...*servingProc) requestResult {
		d := seconds
		if c > 100 {
			d = max(1, seconds/2)
		}
		return load(wrkTool, fmt.Sprintf("%s -t2 -c%d -d%ds --latency http://%s/", wrk, c, d, hostPort(port)), owners...)
	}
	abRun := func(port int, owners ...*servingProc) requestResult {
		// -r: a reset connection is a failed request to count, not the end
		// of the run.
		return load(abTool, fmt.Sprintf("%s -q -r -n %d -c %d http://%s/", ab, abRequests, abConns, hostPort(port)), owners...)
	}
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	// bulkRun moves bulkMB MiB on one connection: sent by this binary
	// (bulkSend) or downloaded by it (bulkGet), timed by the client from
	// its dial to the end; or sent by socat, as the issue measured it,
	// timed from its start to its exit.
	bulkRun := func(port int, how bulkClient, owners ...*servingProc) bulkResult {
		n := float64(int64(bulkMB) << 20)
		var (
			text  string
			delta serveCounters
			took  time.Duration
		)
		switch how {
		case viaSocat:
			text, delta = runClient(100*time.Millisecond, owners, nil, socat, "-u", fmt.Sprintf("FILE:/dev/zero,readbytes=%d", int64(n)), "TCP:"+hostPort(port))
			took = delta.wall
		default:
			env := []string{"FB_BENCH_BULK_SEND=" + hostPort(port), fmt.Sprintf("FB_BENCH_BULK_BYTES=%d", int64(n))}
			if how == viaGet {
				env = []string{fmt.Sprintf("FB_BENCH_BULK_GET=http://%s/bytes/%d", hostPort(port), int64(n))}
			}
			text, delta = runClient(0, owners, env, self)
			m := bulkDone.FindStringSubmatch(text)
			if m == nil {
				b.Fatalf("bulk client:\n%s", text)
			}
			moved, _ := strconv.ParseFloat(m[1], 64)
			ns, _ := strconv.ParseInt(m[2], 10, 64)
			if moved != n {
				b.Fatalf("bulk client moved %.0f bytes, want %.0f:\n%s", moved, n, text)
			}
			took = time.Duration(ns)
		}
		gb := n / 1e9
		return bulkResult{gbps: n * 8 / float64(took.Nanoseconds()), cpuPerGB: float64(delta.machine) * clockTick.Seconds() / gb,
			servingPerGB: float64(delta.owned) * clockTick.Seconds() / gb, clientPerGB: delta.client.Seconds() / gb,
			ringFull: delta.ringFull, retrans: delta.retrans, why: delta.why,
			segsIn: float64(delta.segsIn) / (n / (1 << 20)), segsOut: float64(delta.segsOut) / (n / (1 << 20))}
	}

	b.ResetTimer()
	for range b.N {
		for _, c := range conns {
			var kr, br []requestResult
			for i := range rounds {
				kr = append(kr, wrkRun(kernelPort, c, kernel))
				if !profiled && i == min(profileRound, rounds-1) {
					// The profiles' window: a bridge round of the first
					// connection count (FB_BENCH_PROFILE_ROUND, 0: the
					// first, whose connections are set up inside it).
					daemon.cmd.Process.Signal(syscall.SIGUSR1)
					app.cmd.Process.Signal(syscall.SIGUSR1)
					profiled = true
				}
				br = append(br, wrkRun(appPort, c, bridgeSide...))
				logLoadRound(b, fmt.Sprintf("c=%d", c), i, kr[i], br[i])
			}
			reportLoad(b, fmt.Sprintf("c=%d", c), fmt.Sprintf("c%d-", c), kr, br)
		}
		if sink != nil {
			// Into the sink (the client sends), then out of the HTTP
			// servers (the client downloads /bytes/N).
			profileBulk := !profiled
			profiled = true
			for _, d := range []struct {
				name, metric       string
				kernelPort, bridge int
				how                bulkClient
				kernel, app        *servingProc   // app: the one profiled
				owners             []*servingProc // the bridge side's processes
			}{
				{"bulk", "bulk-", kernelSinkPort, sinkPort, viaSend, kernel, sink, []*servingProc{daemon, sink}},
				{"bulk socat", "bulk-socat-", socatSinkPort, sinkPort, viaSocat, socatSink, sink, []*servingProc{daemon, sink}},
				{"download", "download-", kernelPort, appPort, viaGet, kernel, app, bridgeSide},
			} {
				if !bulkWanted(d.name) {
					continue
				}
				if d.kernel == nil {
					b.Logf("%s: skipped, socat is not installed (Debian: apt-get install socat)", d.name)
					continue
				}
				var kr, br []bulkResult
				for i := range rounds {
					kr = append(kr, bulkRun(d.kernelPort, d.how, d.kernel))
					if profileBulk && i == 0 {
						// The first bridge round of each direction.
						daemon.cmd.Process.Signal(syscall.SIGUSR1)
						d.app.cmd.Process.Signal(syscall.SIGUSR1)
					}
					br = append(br, bulkRun(d.bridge, d.how, d.owners...))
					for _, x := range []struct {
						who string
						r   bulkResult
					}{{"kernel", kr[i]}, {"bridge", br[i]}} {
						b.Logf("%s round %d %s: %.2f Gbit/s, CPU %.2f s/GB (serving %.2f, client %.2f), ring-full %d, client retransmits %d%v, client segments/MiB in %.1f out %.1f",
							d.name, i, x.who, x.r.gbps, x.r.cpuPerGB, x.r.servingPerGB, x.r.clientPerGB, x.r.ringFull, x.r.retrans, x.r.why, x.r.segsIn, x.r.segsOut)
					}
				}
				k, br1 := medianBulk(kr), medianBulk(br)
				b.Logf("%s %d MiB medians of %d: bridge/kernel Gbit/s %.2f/%.2f = %.2fx; CPU s/GB %.2f/%.2f = %.2fx (serving %.2f/%.2f, client %.2f/%.2f); ring-full %d/%d; retransmits %d/%d",
					d.name, bulkMB, rounds, br1.gbps, k.gbps, br1.gbps/k.gbps, br1.cpuPerGB, k.cpuPerGB, br1.cpuPerGB/k.cpuPerGB,
					br1.servingPerGB, k.servingPerGB, br1.clientPerGB, k.clientPerGB, br1.ringFull, k.ringFull, br1.retrans, k.retrans)
				b.ReportMetric(br1.gbps/k.gbps, d.metric+"rate-ratio")
				b.ReportMetric(br1.cpuPerGB/k.cpuPerGB, d.metric+"cpu-ratio")
				b.ReportMetric(float64(br1.ringFull), d.metric+"ring-full")
			}
		}
		if s, err := scrapeIn(bridgeNS, metricsAddr); err == nil {
			var joined, lost float64
			for _, x := range metrics.Find(s, "fabricbridge_queue_tx_joined_total") {
				joined += x.Value
			}
			for _, x := range metrics.Find(s, "fabricbridge_queue_tx_offload_lost_total") {
				lost += x.Value
			}
			b.Logf("segmentation offload so far: %.0f packets sent joined, %.0f lost", joined, lost)
		}
		if abErr != nil {
			b.Logf("no new-connection comparison: %v", abErr)
			logPeakMemory(b, append([]*servingProc{kernel, sink}, bridgeSide...)...)
			continue
		}
		// ab last: a run it cannot finish fails the benchmark, and the
		// figures above are logged by then.
		var kr, br []requestResult
		label := fmt.Sprintf("ab n=%d c=%d", abRequests, abConns)
		for i := range rounds {
			kr = append(kr, abRun(kernelPort, kernel))
			if !profiled {
				// Neither wrk nor a transfer ran: ab's first bridge round
				// is the profiles' window.
				daemon.cmd.Process.Signal(syscall.SIGUSR1)
				app.cmd.Process.Signal(syscall.SIGUSR1)
				profiled = true
			}
			br = append(br, abRun(appPort, bridgeSide...))
			logLoadRound(b, label, i, kr[i], br[i])
		}
		reportLoad(b, label, "ab-", kr, br)
		logPeakMemory(b, append([]*servingProc{kernel, sink}, bridgeSide...)...)
	}
}

// logPeakMemory logs each serving process's peak resident memory so far
// (VmHWM). The kernel server's socket buffers and connection state are
// kernel memory, which this leaves out; the application's are on its heap.
func logPeakMemory(b *testing.B, procs ...*servingProc) {
	var parts []string
	for _, p := range procs {
		if p == nil {
			continue
		}
		kb, err := p.peakRSS()
		if err != nil {
			b.Logf("peak memory of %s: %v", p.name, err)
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %d MB", p.name, kb>>10))
	}
	b.Logf("peak resident memory so far: %s (the kernel's socket memory not counted)", strings.Join(parts, ", "))
}

func logLoadRound(b *testing.B, label string, round int, kernel, bridge requestResult) {
	for _, x := range []struct {
		who string
		r   requestResult
	}{{"kernel", kernel}, {"bridge", bridge}} {
		daemon := ""
		if x.who == "bridge" {
			daemon = fmt.Sprintf(" (daemon %v)", x.r.lead)
		}
		b.Logf("%s round %d %s: %.0f req/s, CPU/req machine %v serving %v%s, p50 %v p99 %v, ring-full %d, client retransmits %d%v, client segments/req in %.2f out %.2f %s",
			label, round, x.who, x.r.rate, x.r.machineCPU, x.r.owned, daemon, x.r.p50, x.r.p99, x.r.ringFull, x.r.retrans, x.r.why, x.r.segsIn, x.r.segsOut, x.r.errors)
	}
}

// reportLoad logs the medians of the rounds and reports their ratios,
// bridge over kernel, as metrics named tag+what.
func reportLoad(b *testing.B, label, tag string, kr, br []requestResult) {
	k, br1 := medianResult(kr), medianResult(br)
	b.Logf("%s medians of %d: bridge/kernel req/s %.0f/%.0f = %.2fx; CPU/req machine %v/%v = %.2fx; serving %v/%v = %.2fx; p50 %v/%v = %.2fx; p99 %v/%v = %.2fx; ring-full %d/%d; retransmits %d/%d; client segments/req in %.2f/%.2f out %.2f/%.2f",
		label, len(kr), br1.rate, k.rate, br1.rate/k.rate, br1.machineCPU, k.machineCPU, ratio(br1.machineCPU, k.machineCPU),
		br1.owned, k.owned, ratio(br1.owned, k.owned), br1.p50, k.p50, ratio(br1.p50, k.p50), br1.p99, k.p99, ratio(br1.p99, k.p99),
		br1.ringFull, k.ringFull, br1.retrans, k.retrans, br1.segsIn, k.segsIn, br1.segsOut, k.segsOut)
	b.ReportMetric(br1.rate/k.rate, tag+"rate-ratio")
	b.ReportMetric(ratio(br1.machineCPU, k.machineCPU), tag+"cpu-ratio")
	b.ReportMetric(ratio(br1.p99, k.p99), tag+"p99-ratio")
	b.ReportMetric(float64(br1.ringFull), tag+"ring-full")
}

// medianOf is the median of f over rs.
func medianOf[T any](rs []T, f func(T) float64) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	slices.Sort(v)
	return v[len(v)/2]
}

// medianResult takes each field's median on its own.
func medianResult(rs []requestResult) requestResult {
	return requestResult{
		rate:       medianOf(rs, func(r requestResult) float64 { return r.rate }),
		p50:        time.Duration(medianOf(rs, func(r requestResult) float64 { return float64(r.p50) })),
		p99:        time.Duration(medianOf(rs, func(r requestResult) float64 { return float64(r.p99) })),
		machineCPU: time.Duration(medianOf(rs, func(r requestResult) float64 { return float64(r.machineCPU) })),
		owned:      time.Duration(medianOf(rs, func(r requestResult) float64 { return float64(r.owned) })),
		ringFull:   uint64(medianOf(rs, func(r requestResult) float64 { return float64(r.ringFull) })),
		retrans:    uint64(medianOf(rs, func(r requestResult) float64 { return float64(r.retrans) })),
		segsIn:     medianOf(rs, func(r requestResult) float64 { return r.segsIn }),
		segsOut:    medianOf(rs, func(r requestResult) float64 { return r.segsOut }),
	}
}

// medianBulk takes each field's median on its own.
func medianBulk(rs []bulkResult) bulkResult {
	return bulkResult{
		gbps:         medianOf(rs, func(r bulkResult) float64 { return r.gbps }),
		cpuPerGB:     medianOf(rs, func(r bulkResult) float64 { return r.cpuPerGB }),
		servingPerGB: medianOf(rs, func(r bulkResult) float64 { return r.servingPerGB }),
		clientPerGB:  medianOf(rs, func(r bulkResult) float64 { return r.clientPerGB }),
		ringFull:     uint64(medianOf(rs, func(r bulkResult) float64 { return float64(r.ringFull) })),
		retrans:      uint64(medianOf(rs, func(r bulkResult) float64 { return float64(r.retrans) })),
	}
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// bulkWanted reports whether FB_BENCH_BULK (a list of "bulk", "bulk socat"
// and "download"; empty: all) names the transfer.
func bulkWanted(name string) bool {
	list := os.Getenv("FB_BENCH_BULK")
	return list == "" || slices.Contains(strings.Split(list, ","), name)
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
