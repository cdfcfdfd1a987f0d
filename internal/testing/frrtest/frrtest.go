// Package frrtest runs FRR (zebra and bgpd from Debian's frr) as the
// upstream router of a test topology, with the configuration that
// docs/scale-out.md gives for FRR: BGP sessions to the boxes through a peer
// group and ECMP into the router namespace's kernel FIB.
package frrtest

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/birdtest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// Dir is where Debian installs FRR's daemons.
const Dir = "/usr/lib/frr"

// Router is FRR running in a namespace.
type Router struct {
	birdtest.FIB
	dir string // sockets, pid files and configuration
	log *testenv.Output
}

// Require skips tb unless FRR is installed (fails it where privileged tests
// are required or in CI: ./test installs Debian's frr).
func Require(tb testing.TB) {
	tb.Helper()
	var missing []string
	for _, d := range []string{"zebra", "bgpd"} {
		if _, err := os.Stat(filepath.Join(Dir, d)); err != nil {
			missing = append(missing, d)
		}
	}
	if _, err := exec.LookPath("vtysh"); err != nil {
		missing = append(missing, "vtysh")
	}
	if _, err := user.Lookup("frr"); err != nil {
		missing = append(missing, "user frr")
	}
	if len(missing) == 0 {
		return
	}
	if os.Getenv(testenv.RequireEnv) != "" || os.Getenv("CI") != "" {
		tb.Fatalf("FRR is not installed (Debian frr; ./test installs it): missing %v", missing)
	}
	tb.Skipf("FRR is not installed (Debian frr): missing %v", missing)
}

// Config writes the FRR configuration docs/scale-out.md gives for a
// router in front of the boxes: one peer group per address family, the
// router passive, multipath, nothing exported to the boxes, and BGP
// keepalive 1 s and hold time 3 s. It returns the parts for zebra and bgpd.
//
// There is no BFD: FRR 8.4's bfdd, driven by bgpd, makes a peer's session
// anew when the BGP session comes up, and the box's GoBGP takes the old
// session's last word (Down or AdminDown) for a failure and resets BGP,
// again and again (seen in TestAnnounceToFRR with bfdd peers configured
// statically too). cfg.BFDInterval is therefore ignored; the short hold
// time stands in for it.
func Config(cfg birdtest.Config) (zebra, bgpd string) {
	zebra = "! Routes as plain multipath routes, not kernel nexthop objects,\n" +
		"! so the FIB reads the same as BIRD's.\nno zebra nexthop kernel enable\n"
	var b strings.Builder
	fmt.Fprintf(&b, "router bgp %d\n bgp router-id %v\n no bgp ebgp-requires-policy\n no bgp default ipv4-unicast\n", cfg.ASN, cfg.RouterID)
	// The boxes share one AS (docs/scale-out.md), so the groups take the
	// first peer's.
	var asn uint32
	if len(cfg.Peers) > 0 {
		asn = cfg.Peers[0].ASN
	}
	for _, g := range []string{"BOXES4", "BOXES6"} {
		fmt.Fprintf(&b, " neighbor %s peer-group\n neighbor %s remote-as %d\n neighbor %s timers 1 3\n neighbor %s passive\n", g, g, asn, g, g)
	}
	for _, p := range cfg.Peers {
		if p.Addr4.IsValid() {
			fmt.Fprintf(&b, " neighbor %v peer-group BOXES4\n", p.Addr4)
		}
		if p.Addr6.IsValid() {
			fmt.Fprintf(&b, " neighbor %v peer-group BOXES6\n", p.Addr6)
		}
	}
	for _, af := range []struct{ name, group string }{{"ipv4", "BOXES4"}, {"ipv6", "BOXES6"}} {
		fmt.Fprintf(&b, " address-family %s unicast\n  maximum-paths 16\n  neighbor %s activate\n  neighbor %s route-map NOTHING out\n exit-address-family\n",
			af.name, af.group, af.group)
	}
	b.WriteString("exit\nroute-map NOTHING deny 10\nexit\n")
	return zebra, b.String()
}

// Start runs zebra and bgpd in ns with cfg (birdtest.Config: the
// same router as BIRD's, peers named by address only). They are killed by
// tb's cleanup, or with the test process if that dies first; their log is
// shown if the test failed.
func Start(tb testing.TB, ns *topology.NS, cfg birdtest.Config) *Router {
	tb.Helper()
	birdtest.RouterKernel(tb, ns)
	frr, err := user.Lookup("frr")
	if err != nil {
		tb.Fatal(err)
	}
	uid, _ := strconv.Atoi(frr.Uid)
	gid, _ := strconv.Atoi(frr.Gid)
	// The daemons drop to user frr (which is in the vty group they insist
	// on) and must still write their sockets and pid files here.
	dir, err := os.MkdirTemp("", "frrtest-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chown(dir, uid, gid); err != nil {
		tb.Fatal(err)
	}
	r := &Router{FIB: birdtest.FIB{NS: ns}, dir: dir, log: &testenv.Output{}}
	r.Explain = func(tb testing.TB) string {
		return "show bgp summary:\n" + r.Vtysh(tb, "show bgp summary") +
			"\nshow ip route bgp:\n" + r.Vtysh(tb, "show ip route bgp")
	}
	zebra, bgpd := Config(cfg)
	confs := map[string]string{"zebra": zebra, "bgpd": bgpd}
	var cmds []*exec.Cmd
	tb.Cleanup(func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
		if tb.Failed() {
			tb.Logf("FRR's log:\n%s", r.log.String())
		}
	})
	for _, d := range []string{"zebra", "bgpd"} {
		conf := filepath.Join(dir, d+".conf")
		if err := os.WriteFile(conf, []byte(confs[d]), 0o644); err != nil {
			tb.Fatal(err)
		}
		args := []string{"netns", "exec", ns.Name, filepath.Join(Dir, d),
			"-u", "frr", "-g", "frr", "-f", conf, "-i", filepath.Join(dir, d+".pid"),
			"-z", filepath.Join(dir, "zserv.api"), "--vty_socket", dir, "-P", "0", "--log", "stdout"}
		cmd := exec.Command("ip", args...)
		cmd.SysProcAttr = birdtest.DieWithTest()
		cmd.Stdout, cmd.Stderr = r.log, r.log
		if err := cmd.Start(); err != nil {
			tb.Fatal(err)
		}
		cmds = append(cmds, cmd)
		// bgpd connects to zebra's socket, and each daemon's vty
		// socket tells vtysh it is up.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if _, err := os.Stat(filepath.Join(dir, d+".vty")); err == nil {
				break
			}
			if time.Now().After(deadline) {
				tb.Fatalf("%s made no vty socket in 10s:\n%s", d, r.log.String())
			}
		}
	}
	return r
}

// Vtysh runs one vtysh command against the router's daemons.
func (r *Router) Vtysh(tb testing.TB, command string) string {
	tb.Helper()
	out, err := r.NS.Exec(context.Background(), "vtysh", "--vty_socket", r.dir, "-c", command)
	if err != nil {
		tb.Fatal(err)
	}
	return string(out)
}

// Established reports whether the BGP session with peer is up.
func (r *Router) Established(tb testing.TB, peer netip.Addr) bool {
	tb.Helper()
	var st map[string]struct {
		State string `json:"bgpState"`
	}
	out := r.Vtysh(tb, "show bgp neighbors "+peer.String()+" json")
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		tb.Fatalf("show bgp neighbors %v: %v: %s", peer, err, out)
	}
	return st[peer.String()].State == "Established"
}
