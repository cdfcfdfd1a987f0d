package announce

// The proof against a real router: BIRD 2 in one namespace, two boxes in
// two others, each box an Announcer in a child process (GoBGP opens its
// sockets from whatever thread it likes, so a box gets a whole process in
// its namespace rather than a goroutine).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

const (
	childEnv  = "FB_ANNOUNCE_CHILD"
	routerASN = 65000
	boxASN    = 65001
	// The bounds the test holds the announcer to. BFD runs at 100 ms × 5
	// (500 ms: the machine running the tests may be busy) against BGP's
	// hold time of 9 s, so a frozen box withdrawn within freezeBound was
	// found by BFD, not by BGP.
	unreadyBound = 2 * time.Second
	freezeBound  = 1500 * time.Millisecond
	convergeWait = 30 * time.Second
)

var (
	service4 = netip.MustParseAddr("198.18.200.1")
	service6 = netip.MustParseAddr("2001:db8:200::1")
)

// childConfig is what a box's process is told through childEnv.
type childConfig struct {
	RouterID  netip.Addr
	Neighbors []Neighbor
	Addresses []netip.Addr
}

func TestMain(m *testing.M) {
	if cfg := os.Getenv(childEnv); cfg != "" {
		os.Exit(runChild(cfg))
	}
	os.Exit(m.Run())
}

// runChild is a box: it announces while it is "ready" and obeys one
// command a line on stdin, answering each on stdout once done.
func runChild(cfgJSON string) int {
	var cc childConfig
	if err := json.Unmarshal([]byte(cfgJSON), &cc); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	var mu sync.Mutex
	ready := true
	a, err := Start(context.Background(), Config{
		ASN: boxASN, RouterID: cc.RouterID, Neighbors: cc.Neighbors, Addresses: cc.Addresses,
		BFD:           &BFD{MinTx: 100 * time.Millisecond, MinRx: 100 * time.Millisecond, Multiplier: 5},
		CheckInterval: 50 * time.Millisecond,
		WithdrawDelay: 500 * time.Millisecond,
		Ready:         func() bool { mu.Lock(); defer mu.Unlock(); return ready },
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch cmd := in.Text(); cmd {
		case "ready", "unready":
			mu.Lock()
			ready = cmd == "ready"
			mu.Unlock()
			a.Recheck()
		case "stop":
			if err := a.Stop(context.Background()); err != nil {
				fmt.Fprintln(os.Stderr, "child: stop:", err)
				return 1
			}
			fmt.Println("done stop")
			return 0
		}
		fmt.Println("done", in.Text())
	}
	return 0
}

// box is a child process announcing from its namespace.
type box struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
	link  netip.Addr // its address on the link to the router: the next hop
}

func startBox(t *testing.T, name string, ns *topology.NS, v *topology.Veth) *box {
	t.Helper()
	cc := childConfig{
		RouterID:  v.B.Addr4.Addr(),
		Neighbors: []Neighbor{{Address: v.A.Addr4.Addr(), ASN: routerASN}, {Address: v.A.Addr6.Addr(), ASN: routerASN}},
		Addresses: []netip.Addr{service4, service6},
	}
	js, err := json.Marshal(cc)
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", ns.Name, self)
	cmd.Env = append(os.Environ(), childEnv+"="+string(js))
	cmd.SysProcAttr = dieWithTest()
	cmd.Stderr = &testWriter{t: t, prefix: name + ": "}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return &box{name: name, cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout), link: v.B.Addr4.Addr()}
}

// do sends a command and waits for the box to have carried it out.
func (b *box) do(t *testing.T, cmd string) {
	t.Helper()
	if _, err := fmt.Fprintln(b.stdin, cmd); err != nil {
		t.Fatalf("%s: %s: %v", b.name, cmd, err)
	}
	if !b.out.Scan() || b.out.Text() != "done "+cmd {
		t.Fatalf("%s: %s: answer %q, %v", b.name, cmd, b.out.Text(), b.out.Err())
	}
}

type testWriter struct {
	t      *testing.T
	prefix string
	mu     sync.Mutex
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.t.Log(w.prefix + line)
	}
	return len(p), nil
}

// router is BIRD in its namespace.
type router struct {
	ns   *topology.NS
	sock string
}

func requireBird(t *testing.T) string {
	t.Helper()
	bird, err := exec.LookPath("bird")
	if err != nil {
		if os.Getenv(testenv.RequireEnv) != "" || os.Getenv("CI") != "" {
			t.Fatal("bird is not installed (Debian bird2; ./test installs it)")
		}
		t.Skip("bird is not installed (Debian bird2)")
	}
	return bird
}

func startRouter(t *testing.T, bird string, ns *topology.NS, links map[string]*topology.Veth) *router {
	t.Helper()
	ctx := context.Background()
	// ECMP that hashes the whole 5-tuple, with a fixed seed, so the
	// spreading over boxes is the same from run to run.
	for _, s := range []string{
		"net.ipv4.fib_multipath_hash_policy=1", "net.ipv6.fib_multipath_hash_policy=1",
		"net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1",
	} {
		if _, err := ns.Exec(ctx, "sysctl", "-qw", s); err != nil {
			t.Fatal(err)
		}
	}
	// fib_multipath_hash_seed appeared in Linux 6.11.
	_, _ = ns.Exec(ctx, "sysctl", "-qw", "net.ipv4.fib_multipath_hash_seed=42")

	dir := t.TempDir()
	var conf strings.Builder
	fmt.Fprintf(&conf, `router id %v;
log stderr all;
protocol device { scan time 1; }
protocol kernel kernel4 { ipv4 { export all; import none; }; merge paths on; }
protocol kernel kernel6 { ipv6 { export all; import none; }; merge paths on; }
protocol bfd { interface "*" { min rx interval 100 ms; min tx interval 100 ms; idle tx interval 300 ms; multiplier 5; }; }
template bgp box { local as %d; hold time 9; connect retry time 1; bfd on; }
`, links["a"].A.Addr4.Addr(), routerASN)
	for _, name := range slices.Sorted(maps.Keys(links)) {
		v := links[name]
		fmt.Fprintf(&conf, "protocol bgp %s4 from box { neighbor %v as %d; ipv4 { import all; export none; }; }\n", name, v.B.Addr4.Addr(), boxASN)
		fmt.Fprintf(&conf, "protocol bgp %s6 from box { neighbor %v as %d; ipv6 { import all; export none; }; }\n", name, v.B.Addr6.Addr(), boxASN)
	}
	confPath := filepath.Join(dir, "bird.conf")
	if err := os.WriteFile(confPath, []byte(conf.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	r := &router{ns: ns, sock: filepath.Join(dir, "bird.ctl")}
	cmd := exec.Command("ip", "netns", "exec", ns.Name, bird, "-f", "-c", confPath, "-s", r.sock, "-P", filepath.Join(dir, "bird.pid"))
	cmd.SysProcAttr = dieWithTest()
	var logBuf lockedBuffer
	cmd.Stdout, cmd.Stderr = &logBuf, &logBuf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("bird's log:\n%s", logBuf.String())
		}
	})
	return r
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// nextHops returns the gateways of the router's kernel route to addr,
// sorted: the boxes its FIB spreads packets over.
func (r *router) nextHops(t *testing.T, addr netip.Addr) []netip.Addr {
	t.Helper()
	family, bits := netlink.FAMILY_V4, 32
	if addr.Is6() {
		family, bits = netlink.FAMILY_V6, 128
	}
	dst := netip.PrefixFrom(addr, bits)
	routes, err := r.ns.Handle().RouteListFiltered(family, &netlink.Route{Dst: prefixNet(dst)}, netlink.RT_FILTER_DST)
	if err != nil {
		t.Fatal(err)
	}
	var hops []netip.Addr
	for _, rt := range routes {
		if rt.Gw != nil {
			a, _ := netip.AddrFromSlice(rt.Gw)
			hops = append(hops, a.Unmap())
		}
		for _, nh := range rt.MultiPath {
			a, _ := netip.AddrFromSlice(nh.Gw)
			hops = append(hops, a.Unmap())
		}
	}
	slices.SortFunc(hops, netip.Addr.Compare)
	return hops
}

// established reports whether BIRD's session proto is up.
func (r *router) established(t *testing.T, proto string) bool {
	t.Helper()
	out, err := r.ns.Exec(context.Background(), "birdc", "-s", r.sock, "show", "protocols", proto)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(out), "Established")
}

// waitHops waits until the routes to both service addresses go through
// exactly want (by the boxes' IPv4 and IPv6 link addresses), and returns
// how long that took.
func waitHops(t *testing.T, r *router, within time.Duration, what string, want4, want6 []netip.Addr) time.Duration {
	t.Helper()
	slices.SortFunc(want4, netip.Addr.Compare)
	slices.SortFunc(want6, netip.Addr.Compare)
	start := time.Now()
	for {
		got4, got6 := r.nextHops(t, service4), r.nextHops(t, service6)
		if slices.Equal(got4, want4) && slices.Equal(got6, want6) {
			took := time.Since(start)
			t.Logf("%s: next hops %v %v after %v", what, got4, got6, took.Round(time.Millisecond))
			return took
		}
		if time.Since(start) > within {
			for _, q := range []string{"show protocols", "show route all"} {
				out, _ := r.ns.Exec(context.Background(), "birdc", "-s", r.sock, q)
				t.Logf("birdc %s:\n%s", q, out)
			}
			t.Fatalf("%s: after %v the next hops are %v and %v, want %v and %v", what, within, got4, got6, want4, want6)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestAnnounceToBird(t *testing.T) {
	testenv.RequirePrivileged(t)
	bird := requireBird(t)

	rns, ans, bns := topology.New(t), topology.New(t), topology.New(t)
	links := map[string]*topology.Veth{
		"a": topology.Connect(t, rns, ans, topology.VethOptions{}),
		"b": topology.Connect(t, rns, bns, topology.VethOptions{}),
	}
	r := startRouter(t, bird, rns, links)
	a := startBox(t, "a", ans, links["a"])
	b := startBox(t, "b", bns, links["b"])
	a6, b6 := links["a"].B.Addr6.Addr(), links["b"].B.Addr6.Addr()
	both4, both6 := []netip.Addr{a.link, b.link}, []netip.Addr{a6, b6}

	waitHops(t, r, convergeWait, "both boxes announce: ECMP over both", both4, both6)
	if !r.established(t, "a4") || !r.established(t, "b6") {
		t.Fatal("BGP sessions are not established")
	}

	a.do(t, "unready")
	waitHops(t, r, unreadyBound, "box a not ready: withdrawn", []netip.Addr{b.link}, []netip.Addr{b6})
	a.do(t, "ready")
	waitHops(t, r, unreadyBound, "box a ready again", both4, both6)

	// A frozen box keeps its TCP sessions open (the kernel still ACKs) but
	// sends nothing: only BFD can tell, long before the hold time.
	if err := b.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	took := waitHops(t, r, freezeBound, "box b frozen: BFD takes it out", []netip.Addr{a.link}, []netip.Addr{a6})
	if took >= 9*time.Second {
		t.Fatalf("withdrawn after %v, the hold time: BFD did not act", took)
	}
	_ = b.cmd.Process.Kill()

	// Stop withdraws with an UPDATE while the session is still up, and
	// the route is gone before Stop returns.
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		if _, err := fmt.Fprintln(a.stdin, "stop"); err != nil {
			t.Errorf("stop: %v", err)
			return
		}
		if !a.out.Scan() || a.out.Text() != "done stop" {
			t.Errorf("stop: answer %q", a.out.Text())
		}
	}()
	stopAt := time.Now()
	for {
		select {
		case <-stopped:
			t.Fatalf("Stop returned while the router still routes to box a: %v", r.nextHops(t, service4))
		default:
		}
		if len(r.nextHops(t, service4)) == 0 && len(r.nextHops(t, service6)) == 0 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !r.established(t, "a4") {
		t.Fatal("the route went with the session: Stop closed it without withdrawing first")
	}
	t.Logf("stop: withdrawn after %v, the session still up", time.Since(stopAt).Round(time.Millisecond))
	<-stopped
	if err := a.cmd.Wait(); err != nil {
		t.Fatalf("box a after stop: %v", err)
	}
}

// prefixNet converts for netlink, which speaks net.IPNet.
func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// dieWithTest has a child killed when the test process dies, even of a
// panic or a -timeout, when no Cleanup runs: `ip netns exec` execs its
// command, which keeps the signal. Linux sends it when the thread that
// forked exits; Go ends only threads locked by a goroutine that never
// unlocked them, and nothing here locks one.
func dieWithTest() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
