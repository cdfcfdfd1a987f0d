package announce

// The proof against a real router: BIRD 2 in one namespace, two boxes in
// two others, each box an Announcer in a child process (GoBGP opens its
// sockets from whatever thread it likes, so a box gets a whole process in
// its namespace rather than a goroutine).

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/birdtest"
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
	cmd.SysProcAttr = birdtest.DieWithTest()
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

func TestAnnounceToBird(t *testing.T) {
	testenv.RequirePrivileged(t)
	bird := birdtest.Require(t)

	rns, ans, bns := topology.New(t), topology.New(t), topology.New(t)
	la := topology.Connect(t, rns, ans, topology.VethOptions{})
	lb := topology.Connect(t, rns, bns, topology.VethOptions{})
	r := birdtest.Start(t, bird, rns, birdtest.Config{
		RouterID: la.A.Addr4.Addr(), ASN: routerASN,
		Peers: []birdtest.Peer{
			{Name: "a", Addr4: la.B.Addr4.Addr(), Addr6: la.B.Addr6.Addr(), ASN: boxASN},
			{Name: "b", Addr4: lb.B.Addr4.Addr(), Addr6: lb.B.Addr6.Addr(), ASN: boxASN},
		},
		BFDInterval: 100 * time.Millisecond, BFDMultiplier: 5,
	})
	a := startBox(t, "a", ans, la)
	b := startBox(t, "b", bns, lb)
	a6, b6 := la.B.Addr6.Addr(), lb.B.Addr6.Addr()
	hops := func(v4, v6 []netip.Addr) map[netip.Addr][]netip.Addr {
		return map[netip.Addr][]netip.Addr{service4: v4, service6: v6}
	}
	both := hops([]netip.Addr{a.link, b.link}, []netip.Addr{a6, b6})

	r.WaitHops(t, convergeWait, "both boxes announce: ECMP over both", both)
	if !r.Established(t, "a4") || !r.Established(t, "b6") {
		t.Fatal("BGP sessions are not established")
	}

	a.do(t, "unready")
	r.WaitHops(t, unreadyBound, "box a not ready: withdrawn", hops([]netip.Addr{b.link}, []netip.Addr{b6}))
	a.do(t, "ready")
	r.WaitHops(t, unreadyBound, "box a ready again", both)

	// A frozen box keeps its TCP sessions open (the kernel still ACKs) but
	// sends nothing: only BFD can tell, long before the hold time.
	if err := b.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	r.WaitHops(t, freezeBound, "box b frozen: BFD takes it out", hops([]netip.Addr{a.link}, []netip.Addr{a6}))
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
	for len(r.NextHops(t, service4)) != 0 || len(r.NextHops(t, service6)) != 0 {
		select {
		case <-stopped:
			t.Fatalf("Stop returned while the router still routes to box a: %v", r.NextHops(t, service4))
		default:
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !r.Established(t, "a4") {
		t.Fatal("the route went with the session: Stop closed it without withdrawing first")
	}
	t.Logf("stop: withdrawn after %v, the session still up", time.Since(stopAt).Round(time.Millisecond))
	<-stopped
	if err := a.cmd.Wait(); err != nil {
		t.Fatalf("box a after stop: %v", err)
	}
}
