// Package birdtest runs BIRD 2 as the upstream router of a test topology:
// BGP sessions to the boxes, BFD, and ECMP into the router namespace's
// kernel FIB, which is where a test looks to see what the router would do.
package birdtest

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// Peer is a box the router peers with.
type Peer struct {
	// Name names BIRD's protocols: Name+"4" and Name+"6".
	Name string
	// Addr4 and Addr6 are the box's addresses on its link to the router;
	// either may be unset for a box with sessions of one version only.
	Addr4, Addr6 netip.Addr
	ASN          uint32
}

// Config is the router.
type Config struct {
	RouterID netip.Addr
	ASN      uint32
	Peers    []Peer
	// BFDInterval and BFDMultiplier set BFD on every session; an
	// interval of 0 turns BFD off.
	BFDInterval   time.Duration
	BFDMultiplier int
}

// Router is BIRD running in a namespace.
type Router struct {
	FIB
	sock string
	log  *testenv.Output
}

// FIB is a router namespace's kernel forwarding table: where a test looks
// to see what the router would do, whichever routing daemon fills it.
type FIB struct {
	NS *topology.NS
	// Explain is the routing daemon's view of its sessions and routes,
	// logged when WaitHops gives up.
	Explain func(tb testing.TB) string
}

// Require returns the path of bird, or skips tb (fails it where privileged
// tests are required or in CI: ./test installs Debian's bird2).
func Require(tb testing.TB) string {
	tb.Helper()
	bird, err := exec.LookPath("bird")
	if err == nil {
		_, err = exec.LookPath("birdc")
	}
	if err != nil {
		if os.Getenv(testenv.RequireEnv) != "" || os.Getenv("CI") != "" {
			tb.Fatal("bird is not installed (Debian bird2; ./test installs it)")
		}
		tb.Skip("bird is not installed (Debian bird2)")
	}
	return bird
}

// Start runs BIRD in ns with ECMP ("merge paths") into the kernel, and the
// kernel hashing the 5-tuple with a fixed seed. BIRD is killed by tb's
// cleanup, or with the test process if that dies first; its log is shown
// if the test failed.
func Start(tb testing.TB, bird string, ns *topology.NS, cfg Config) *Router {
	tb.Helper()
	RouterKernel(tb, ns)
	var conf strings.Builder
	fmt.Fprintf(&conf, "router id %v;\nlog stderr all;\nprotocol device { scan time 1; }\n", cfg.RouterID)
	conf.WriteString("protocol kernel kernel4 { ipv4 { export all; import none; }; merge paths on; }\n")
	conf.WriteString("protocol kernel kernel6 { ipv6 { export all; import none; }; merge paths on; }\n")
	bfd := ""
	if cfg.BFDInterval > 0 {
		ms := cfg.BFDInterval.Milliseconds()
		fmt.Fprintf(&conf, "protocol bfd { interface \"*\" { min rx interval %d ms; min tx interval %d ms; idle tx interval %d ms; multiplier %d; }; }\n",
			ms, ms, 3*ms, cfg.BFDMultiplier)
		bfd = " bfd on;"
	}
	// After an error (BFD down, a hold timer), BIRD waits its error wait
	// time (60 s at first, by default) before it takes the box's session
	// again; a box that restarts at once should be back in seconds.
	fmt.Fprintf(&conf, "template bgp box { local as %d; hold time 9; connect retry time 1; error wait time 1, 5;%s }\n", cfg.ASN, bfd)
	for _, p := range cfg.Peers {
		if p.Addr4.IsValid() {
			fmt.Fprintf(&conf, "protocol bgp %s4 from box { neighbor %v as %d; ipv4 { import all; export none; }; }\n", p.Name, p.Addr4, p.ASN)
		}
		if p.Addr6.IsValid() {
			fmt.Fprintf(&conf, "protocol bgp %s6 from box { neighbor %v as %d; ipv6 { import all; export none; }; }\n", p.Name, p.Addr6, p.ASN)
		}
	}
	dir := tb.TempDir()
	confPath := filepath.Join(dir, "bird.conf")
	if err := os.WriteFile(confPath, []byte(conf.String()), 0o644); err != nil {
		tb.Fatal(err)
	}
	r := &Router{FIB: FIB{NS: ns}, sock: filepath.Join(dir, "bird.ctl"), log: &testenv.Output{}}
	r.Explain = func(tb testing.TB) string {
		return "birdc show protocols:\n" + r.Birdc(tb, "show", "protocols") +
			"\nbirdc show route all:\n" + r.Birdc(tb, "show", "route", "all")
	}
	cmd := exec.Command("ip", "netns", "exec", ns.Name, bird, "-f", "-c", confPath, "-s", r.sock, "-P", filepath.Join(dir, "bird.pid"))
	cmd.SysProcAttr = DieWithTest()
	cmd.Stdout, cmd.Stderr = r.log, r.log
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if tb.Failed() {
			tb.Logf("bird's log:\n%s", r.log.String())
		}
	})
	// birdc needs the control socket, which BIRD makes once it has read
	// its configuration.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(r.sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("bird made no control socket in 10s:\n%s", r.log.String())
		}
	}
	return r
}

// RouterKernel makes ns forward, and spread a multipath route's flows by
// their 5-tuple, with a fixed seed where the kernel has one, as the
// deployment documentation asks of a router.
func RouterKernel(tb testing.TB, ns *topology.NS) {
	tb.Helper()
	ctx := context.Background()
	for _, s := range []string{
		"net.ipv4.fib_multipath_hash_policy=1", "net.ipv6.fib_multipath_hash_policy=1",
		"net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1",
	} {
		if _, err := ns.Exec(ctx, "sysctl", "-qw", s); err != nil {
			tb.Fatal(err)
		}
	}
	// fib_multipath_hash_seed appeared in Linux 6.11.
	_, _ = ns.Exec(ctx, "sysctl", "-qw", "net.ipv4.fib_multipath_hash_seed=42")
}

// DieWithTest has a child killed when the test process dies, even of a
// panic or a -timeout, when no Cleanup runs: `ip netns exec` execs its
// command, which keeps the signal. Linux sends it when the thread that
// forked exits; Go ends only threads locked by a goroutine that never
// unlocked them, and a test's own goroutine does not do that.
func DieWithTest() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// NextHops returns the gateways of the router's kernel route to addr,
// sorted: the boxes its FIB spreads packets over.
func (r *FIB) NextHops(tb testing.TB, addr netip.Addr) []netip.Addr {
	tb.Helper()
	family := netlink.FAMILY_V4
	if addr.Is6() {
		family = netlink.FAMILY_V6
	}
	dst := &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(addr.BitLen(), addr.BitLen())}
	routes, err := r.NS.Handle().RouteListFiltered(family, &netlink.Route{Dst: dst}, netlink.RT_FILTER_DST)
	if err != nil {
		tb.Fatal(err)
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

// Established reports whether BIRD's BGP session proto is up.
func (r *Router) Established(tb testing.TB, proto string) bool {
	tb.Helper()
	return strings.Contains(r.Birdc(tb, "show", "protocols", proto), "Established")
}

// Birdc runs a birdc command and returns its output.
func (r *Router) Birdc(tb testing.TB, args ...string) string {
	tb.Helper()
	out, err := r.NS.Exec(context.Background(), "birdc", append([]string{"-s", r.sock}, args...)...)
	if err != nil {
		tb.Fatal(err)
	}
	return string(out)
}

// WaitHops waits until the route to each address in want goes exactly
// through want's next hops, and returns how long that took. On timeout it
// fails tb with the routing daemon's view of its sessions and routes (Explain).
func (r *FIB) WaitHops(tb testing.TB, within time.Duration, what string, want map[netip.Addr][]netip.Addr) time.Duration {
	tb.Helper()
	for _, hops := range want {
		slices.SortFunc(hops, netip.Addr.Compare)
	}
	start := time.Now()
	for {
		got := map[netip.Addr][]netip.Addr{}
		same := true
		for dst, hops := range want {
			got[dst] = r.NextHops(tb, dst)
			same = same && slices.Equal(got[dst], hops)
		}
		if same {
			took := time.Since(start)
			tb.Logf("%s: next hops %v after %v", what, got, took.Round(time.Millisecond))
			return took
		}
		if time.Since(start) > within {
			if r.Explain != nil {
				tb.Log(r.Explain(tb))
			}
			tb.Fatalf("%s: after %v the next hops are %v, want %v", what, within, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
