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
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// sinkServer reads each connection to its end, then answers one byte so
// the sender knows everything arrived.
func sinkServer(l net.Listener) {
	serveConns(l, func(c net.Conn) {
		io.Copy(io.Discard, c)
		c.Write([]byte{1})
	})
}

// rrServer answers every byte with one byte.
func rrServer(l net.Listener) {
	serveConns(l, func(c net.Conn) {
		b := make([]byte, 1)
		for {
			if _, err := io.ReadFull(c, b); err != nil {
				return
			}
			if l := benchLog.Load(); l != nil {
				l.add(ptServerRead, monoNow())
			}
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	})
}

// goodput sends n bytes to addr and returns bit/s, timed until the server
// has read the last byte.
func goodput(addr string, n int) (float64, error) {
	c, err := net.Dial("tcp", addr)
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

// roundTrips times count 1-byte request/responses to addr and returns the
// sorted durations.
func roundTrips(addr string, count int) ([]time.Duration, error) {
	c, err := net.Dial("tcp", addr)
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

// connsPerSecond opens and closes connections to addr, one at a time, for d.
func connsPerSecond(addr string, d time.Duration) (float64, error) {
	n := 0
	start := time.Now()
	for time.Since(start) < d {
		c, err := net.Dial("tcp", addr)
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

// clientEnv makes the test binary the benchmark's outside client: a
// process of its own in the outside namespace, as the client would be a
// host of its own. In the benchmark's process it would share the Go
// scheduler with the bridge's loops, whose threads keep their Ps while they
// sleep in system calls; the client's wake-ups then wait for the runtime to
// take a P back (measured: ~100 µs per round trip), a cost that belongs to
// the benchmark, not to the path under test.
const clientEnv = "FB_USERSTACK_BENCH_CLIENT"

// runClient serves commands, one a line on standard input, each answered
// with one line: "goodput ADDR BYTES" → bit/s and the CPU time the client
// spent (ns, user and system: the sending kernel's work), "rr ADDR COUNT" → the
// sorted round trips in ns, "rrt ADDR COUNT" → each round trip's start and
// end on the system's monotonic clock (see monoNow), "cps ADDR MS" →
// connections/s; "error ..." when it fails.
func runClient() {
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		var op, addr string
		var n int
		if _, err := fmt.Sscan(sc.Text(), &op, &addr, &n); err != nil {
			fmt.Println("error", err)
			continue
		}
		var out string
		var err error
		switch op {
		case "goodput":
			var v float64
			cpu := selfCPU()
			v, err = goodput(addr, n)
			out = fmt.Sprint(v, " ", int64(selfCPU()-cpu))
		case "rr":
			var ds []time.Duration
			ds, err = roundTrips(addr, n)
			var sb strings.Builder
			for _, d := range ds {
				fmt.Fprint(&sb, int64(d), " ")
			}
			out = sb.String()
		case "rrt":
			var spans [][2]int64
			spans, err = timedRoundTrips(addr, n)
			var sb strings.Builder
			for _, sp := range spans {
				fmt.Fprint(&sb, sp[0], " ", sp[1], " ")
			}
			out = sb.String()
		case "cps":
			var v float64
			v, err = connsPerSecond(addr, time.Duration(n)*time.Millisecond)
			out = fmt.Sprint(v)
		default:
			err = fmt.Errorf("unknown command %q", op)
		}
		if err != nil {
			fmt.Println("error", err)
			continue
		}
		fmt.Println(out)
	}
}

// benchClient is the handle on the client process.
type benchClient struct {
	in  io.Writer
	out *bufio.Scanner
}

// startClient runs the client process in the outside namespace.
func startClient(b *testing.B, e *e2e) *benchClient {
	cmd := exec.Command("ip", "netns", "exec", e.out.Name, os.Args[0])
	cmd.Env = append(os.Environ(), clientEnv+"=1")
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
	sc.Buffer(nil, 1<<20)
	return &benchClient{in: stdin, out: sc}
}

func (c *benchClient) do(cmd string) (string, error) {
	if _, err := fmt.Fprintln(c.in, cmd); err != nil {
		return "", err
	}
	if !c.out.Scan() {
		return "", fmt.Errorf("client process: %v", c.out.Err())
	}
	line := c.out.Text()
	if msg, ok := strings.CutPrefix(line, "error "); ok {
		return "", fmt.Errorf("client: %s: %s", cmd, msg)
	}
	return line, nil
}

func (c *benchClient) goodput(addr string, n int) (bps float64, cpu time.Duration, err error) {
	line, err := c.do(fmt.Sprint("goodput ", addr, " ", n))
	if err != nil {
		return 0, 0, err
	}
	_, err = fmt.Sscan(line, &bps, &cpu)
	return bps, cpu, err
}

// selfCPU is the CPU time (user and system) this process has used.
func selfCPU() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// procCPU is the CPU time of another process, at clock-tick resolution.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	var u, k int64
	fmt.Sscan(f[11], &u)
	fmt.Sscan(f[12], &k)
	return time.Duration(u+k) * 10 * time.Millisecond // USER_HZ is 100 on Linux
}

// measuredGoodput is one goodput run with the CPU it cost: the client's
// (the sending kernel) and the bridge host's (this process: the bridge,
// the userstack or the kernel's receiving socket, and the application
// process when there is one).
func measuredGoodput(b *testing.B, c *benchClient, addr string, n int, helper int) (bps float64, cpuPerGB time.Duration) {
	self, child := selfCPU(), procCPU(helper)
	bps, clientCPU, err := c.goodput(addr, n)
	if err != nil {
		b.Fatal(err)
	}
	cpu := clientCPU + selfCPU() - self + procCPU(helper) - child
	return bps, time.Duration(float64(cpu) * float64(1<<30) / float64(n))
}

func (c *benchClient) roundTrips(addr string, count int) ([]time.Duration, error) {
	line, err := c.do(fmt.Sprint("rr ", addr, " ", count))
	if err != nil {
		return nil, err
	}
	var ds []time.Duration
	for _, f := range strings.Fields(line) {
		var ns int64
		if _, err := fmt.Sscan(f, &ns); err != nil {
			return nil, err
		}
		ds = append(ds, time.Duration(ns))
	}
	if len(ds) != count {
		return nil, fmt.Errorf("client: %d round trips, want %d", len(ds), count)
	}
	return ds, nil
}

func (c *benchClient) connsPerSecond(addr string, d time.Duration) (float64, error) {
	line, err := c.do(fmt.Sprint("cps ", addr, " ", d.Milliseconds()))
	if err != nil {
		return 0, err
	}
	var v float64
	_, err = fmt.Sscan(line, &v)
	return v, err
}

// benchSpin is FB_BENCH_SPIN (see BenchmarkEndToEnd); zero when unset.
func benchSpin() (time.Duration, error) {
	v := os.Getenv("FB_BENCH_SPIN")
	if v == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("FB_BENCH_SPIN=%q: want a duration such as 200us", v)
	}
	return d, nil
}

// helperEnv names the control socket when the test binary runs as the
// benchmark's application process; helperTraceEnv makes that process
// record its hops (see BenchmarkRoundTripHops).
const (
	helperEnv      = "FB_USERSTACK_HELPER_CONTROL"
	helperTraceEnv = "FB_USERSTACK_HELPER_TRACE"
)

// TestMain turns the test binary into one of the benchmark's processes:
// the outside client when clientEnv is set (see runClient), or the
// application when helperEnv is set: the application in a process of its
// own, as in production. That one serves a sink on port 5005 and echoes
// single bytes on 5006, says "ready", answers "events" on its standard
// input with the hops it recorded (one line of point and time pairs), and
// exits when its standard input closes.
func TestMain(m *testing.M) {
	if os.Getenv(clientEnv) != "" {
		runClient()
		return
	}
	if os.Getenv(handoffEnv) != "" {
		runHandoffEcho()
		return
	}
	path := os.Getenv(helperEnv)
	if path == "" {
		os.Exit(m.Run())
	}
	if os.Getenv(helperTraceEnv) != "" {
		traceInto(new(eventLog))
	}
	spin, err := benchSpin()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	s, err := Open(context.Background(), Options{App: "child", Control: path, Spin: spin})
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
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		var sb strings.Builder
		if l := benchLog.Load(); l != nil && sc.Text() == "events" {
			for _, ev := range l.take() {
				fmt.Fprint(&sb, ev.pt, " ", ev.t, " ")
			}
		}
		fmt.Println(sb.String())
	}
}

// handoffEnv makes the test binary the far end of handoffRoundTrip.
const handoffEnv = "FB_USERSTACK_HANDOFF"

// runHandoffEcho answers each byte read from descriptor 3 with a byte on
// descriptor 4, until 3 reaches its end.
func runHandoffEcho() {
	runtime.LockOSThread()
	var b [1]byte
	for {
		if n, err := unix.Read(3, b[:]); n != 1 || err != nil {
			return
		}
		unix.Write(4, b[:])
	}
}

// handoffRoundTrip is the median time for one byte to go from this
// process to another and back over two pipes, each side sleeping in a
// blocking read: two hand-offs between sleeping threads of different
// processes and nothing else. It prices the unit that a round trip's path
// is made of: the kernel's has two hand-offs (client to server and back),
// the bridge's four (client to bridge loop, to application, to bridge
// loop, to client; BenchmarkRoundTripHops shows each).
func handoffRoundTrip(b *testing.B, count int) time.Duration {
	var req, resp [2]int
	if err := unix.Pipe2(req[:], unix.O_CLOEXEC); err != nil {
		b.Fatal(err)
	}
	if err := unix.Pipe2(resp[:], unix.O_CLOEXEC); err != nil {
		unix.Close(req[0])
		unix.Close(req[1])
		b.Fatal(err)
	}
	childIn, childOut := os.NewFile(uintptr(req[0]), "handoff-req"), os.NewFile(uintptr(resp[1]), "handoff-resp")
	defer unix.Close(resp[0])
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), handoffEnv+"=1")
	cmd.ExtraFiles = []*os.File{childIn, childOut}
	err := cmd.Start()
	childIn.Close()
	childOut.Close()
	if err != nil {
		unix.Close(req[1])
		b.Fatal(err)
	}
	ended := false
	defer func() { // on a failure too: the echo's read ends, and so does it
		if !ended {
			unix.Close(req[1])
			cmd.Wait()
		}
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ds := make([]time.Duration, 0, count)
	var buf [1]byte
	for i := range count + 100 {
		start := monoNow()
		if _, err := unix.Write(req[1], buf[:]); err != nil {
			b.Fatal(err)
		}
		if n, err := unix.Read(resp[0], buf[:]); n != 1 {
			b.Fatalf("hand-off echo: read %d bytes: %v", n, err)
		}
		if i >= 100 { // warm-up
			ds = append(ds, time.Duration(monoNow()-start))
		}
	}
	ended = true
	unix.Close(req[1])
	if err := cmd.Wait(); err != nil {
		b.Fatalf("hand-off echo: %v", err)
	}
	slices.Sort(ds)
	return pct(ds, 0.5)
}

// helperProc is the application process.
type helperProc struct {
	pid int
	in  io.Writer
	out *bufio.Scanner
}

// startHelper runs the application process and waits until it serves.
func startHelper(b *testing.B, path string, trace bool) *helperProc {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"="+path)
	if trace {
		cmd.Env = append(cmd.Env, helperTraceEnv+"=1")
	}
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
	sc.Buffer(nil, 64<<20)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "ready" {
			return &helperProc{pid: cmd.Process.Pid, in: stdin, out: sc}
		}
	}
	b.Fatal("the application process did not start")
	return nil
}

// events fetches (and clears) the hops the process recorded.
func (h *helperProc) events() ([]event, error) {
	if _, err := fmt.Fprintln(h.in, "events"); err != nil {
		return nil, err
	}
	if !h.out.Scan() {
		return nil, fmt.Errorf("application process: %v", h.out.Err())
	}
	f := strings.Fields(h.out.Text())
	evs := make([]event, 0, len(f)/2)
	for i := 0; i+1 < len(f); i += 2 {
		var ev event
		if _, err := fmt.Sscan(f[i], &ev.pt); err != nil {
			return nil, err
		}
		if _, err := fmt.Sscan(f[i+1], &ev.t); err != nil {
			return nil, err
		}
		evs = append(evs, ev)
	}
	return evs, nil
}

// BenchmarkEndToEnd compares the kernel's TCP with the user-space stack on
// the same topology in the same run: the outside host's kernel talks to a
// server on the bridge host, either the kernel's own (a port no application
// claims: the XDP program passes it) or a userstack behind the bridge. Run
// it once: go test -run '^$' -bench BenchmarkEndToEnd -benchtime 1x ./userstack
//
// FB_BENCH_SPIN (a duration) has the bridge's loop and both applications'
// receive loops poll that long before they sleep, for a machine where each
// loop finds a core of its own (the kernel's path has no loops to spin).
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
	helper := startHelper(b, e.path, false).pid
	client := startClient(b, e)
	for b.Loop() {
		offloads(true)
		kernOn, kernOnCPU := measuredGoodput(b, client, at(5002), size, helper)
		offloads(false) // the userstack path needs full checksums anyway
		kernOff, kernOffCPU := measuredGoodput(b, client, at(5002), size, helper)
		user, userCPU := measuredGoodput(b, client, at(5001), size, helper)
		child, childCPU := measuredGoodput(b, client, at(5005), size, helper)
		crr, err := client.roundTrips(at(5006), 5000)
		if err != nil {
			b.Fatal(err)
		}
		krr, err := client.roundTrips(at(5004), 5000)
		if err != nil {
			b.Fatal(err)
		}
		urr, err := client.roundTrips(at(5003), 5000)
		if err != nil {
			b.Fatal(err)
		}
		handoff := handoffRoundTrip(b, 5000)
		kcps, err := client.connsPerSecond(at(5004), 2*time.Second)
		if err != nil {
			b.Fatal(err)
		}
		ucps, err := client.connsPerSecond(at(5003), 2*time.Second)
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
		b.Log(fmt.Sprintf("CPU per GB (client + bridge host): kernel offload on %v, off %v, userstack %v (%.2f× off), own process %v (%.2f× off)",
			kernOnCPU.Round(time.Millisecond), kernOffCPU.Round(time.Millisecond), userCPU.Round(time.Millisecond),
			float64(userCPU)/float64(kernOffCPU), childCPU.Round(time.Millisecond), float64(childCPU)/float64(kernOffCPU)))
		b.ReportMetric(kernOffCPU.Seconds(), "kernel-offload-off-CPU-s/GB")
		b.ReportMetric(userCPU.Seconds(), "userstack-CPU-s/GB")
		b.Log(fmt.Sprintf("1-byte RR: kernel p50 %v p99 %v, userstack p50 %v p99 %v", pct(krr, 0.5), pct(krr, 0.99), pct(urr, 0.5), pct(urr, 0.99)))
		b.Log(fmt.Sprintf("application in its own process: goodput %.0f Mbit/s (%.2f of off), RR p50 %v p99 %v (%.1f× kernel)",
			child/1e6, child/kernOff, pct(crr, 0.5), pct(crr, 0.99), float64(pct(crr, 0.5))/float64(pct(krr, 0.5))))
		b.ReportMetric(child/1e6, "own-process-userstack-Mbit/s")
		b.ReportMetric(float64(pct(crr, 0.5).Microseconds()), "own-process-rr-p50-µs")
		// The floor: the bridge's path with its two extra hand-offs and no
		// processing at all. Where it is above the goal's 1.2, only loops
		// that poll on cores of their own (no hand-offs) can reach it.
		floor := float64(pct(krr, 0.5)+handoff) / float64(pct(krr, 0.5))
		b.ReportMetric(float64(handoff.Microseconds()), "handoff-rtt-p50-µs")
		b.ReportMetric(floor, "rr-floor-ratio")
		b.Log(fmt.Sprintf("hand-offs: a pipe round trip between two processes (two hand-offs) takes %v (p50); the bridge's path has two more hand-offs than the kernel's, so even with no processing its RR p50 is at least %.2f× the kernel's here", handoff, floor))
		b.Log(fmt.Sprintf("connections/s: kernel %.0f, userstack %.0f", kcps, ucps))
		b.Logf("userstack link: %+v", s.LinkStats())
	}
}
