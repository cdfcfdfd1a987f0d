package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestMain lets tests run the command itself: with FB_TEST_MAIN=1 the test
// binary is fabricbridge.
func TestMain(m *testing.M) {
	if os.Getenv("FB_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// daemonProc is `fabricbridge run` in a namespace.
type daemonProc struct {
	cmd  *exec.Cmd
	out  *testenv.Output
	done chan error
}

func startDaemon(t *testing.T, ns *topology.NS, args ...string) *daemonProc {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := &daemonProc{out: &testenv.Output{}, done: make(chan error, 1)}
	p.cmd = exec.Command("ip", append([]string{"netns", "exec", ns.Name, self}, args...)...)
	p.cmd.Env = append(os.Environ(), "FB_TEST_MAIN=1")
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func (p *daemonProc) signal(t *testing.T, s syscall.Signal) {
	t.Helper()
	// ip netns exec execs the command, so the pid is the daemon's.
	if err := p.cmd.Process.Signal(s); err != nil {
		t.Fatal(err)
	}
}

func (p *daemonProc) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-p.done:
		p.done <- err
		return err
	case <-time.After(15 * time.Second):
		t.Fatalf("daemon did not exit:\n%s", p.out.String())
		return nil
	}
}

// scrapeIn reads metrics from addr inside ns.
func scrapeIn(ns *topology.NS, addr string) ([]metrics.Sample, error) {
	tr := &http.Transport{DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
		err = ns.Do(func() (err error) {
			c, err = (&net.Dialer{Timeout: time.Second}).DialContext(ctx, network, a)
			return err
		})
		return c, err
	}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 3 * time.Second}).Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return metrics.Parse(resp.Body)
}

// waitMetric polls until the sample exists and satisfies ok.
func waitMetric(t *testing.T, ns *topology.NS, addr string, p *daemonProc, ok func([]metrics.Sample) bool) []metrics.Sample {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		s, err := scrapeIn(ns, addr)
		if err == nil && ok(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics never satisfied the condition (last error %v):\n%s", err, p.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func rulePackets(s []metrics.Sample, id string) float64 {
	for _, x := range metrics.Find(s, "fabricbridge_rule_packets_total", metrics.L("id", id)...) {
		return x.Value
	}
	return 0
}

func sendUDP(t *testing.T, from *topology.NS, to netip.AddrPort, n int) {
	t.Helper()
	if err := from.Do(func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
		if err != nil {
			return err
		}
		defer c.Close()
		for range n {
			c.Write([]byte("x"))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func xdpOn(ns *topology.NS, ifname string) bool {
	on := false
	ns.Do(func() error {
		l, err := netlink.LinkByName(ifname)
		if err == nil && l.Attrs().Xdp != nil {
			on = l.Attrs().Xdp.Attached
		}
		return err
	})
	return on
}

// TestRunSignals runs the daemon binary: SIGHUP reloads the rules, SIGKILL
// leaves leftovers that do not block a restart, SIGTERM shuts down cleanly.
func TestRunSignals(t *testing.T) {
	testenv.RequirePrivileged(t)
	bridge, outside, v := topology.Pair(t, topology.VethOptions{})
	dir := t.TempDir()
	path := filepath.Join(dir, "fb.yaml")
	const metricsAddr = "127.0.0.1:9469" // inside the bridge namespace
	write := func(rules string) {
		cfg := fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\ncontrol: {socket: %s}\nmetrics: {address: %q}\n%s",
			v.A.Name, v.A.Addr4.Addr(), filepath.Join(dir, "control.sock"), metricsAddr, rules)
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	dst := netip.AddrPortFrom(v.A.Addr4.Addr(), 6666)
	write("rules:\n  - {id: 3, name: blocked, match: {protocol: udp, dst_port: 6666}, action: drop}\n")

	d := startDaemon(t, bridge, "run", "--config", path)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool { return len(s) > 0 })
	sendUDP(t, outside, dst, 10)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool { return rulePackets(s, "3") == 10 })

	// `fabricbridge stats --once` against the running daemon shows the rule.
	st := startDaemon(t, bridge, "stats", "--once", "--interval", "100ms", "--metrics", metricsAddr)
	if err := st.wait(t); err != nil {
		t.Fatalf("stats: %v\n%s", err, st.out.String())
	}
	if !regexp.MustCompile(`(?m)^ +3 blocked +10 +0 `).MatchString(st.out.String()) || !strings.Contains(st.out.String(), "interface "+v.A.Name+"  mode ") {
		t.Errorf("stats output:\n%s", st.out.String())
	}

	// SIGHUP with a broken file changes nothing; with a good one, the rule
	// goes.
	os.WriteFile(path, []byte("interfaces: [{name: x}]\nbogus: 1\n"), 0o644)
	d.signal(t, syscall.SIGHUP)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool {
		r := metrics.Find(s, "fabricbridge_reloads_total", metrics.L("result", "error")...)
		return len(r) == 1 && r[0].Value == 1
	})
	// The log arrives through a pipe, after the counter may already show.
	named := false
	for deadline := time.Now().Add(5 * time.Second); !named && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		named = strings.Contains(d.out.String(), "bogus: unknown field")
	}
	if !named {
		t.Errorf("the failed reload does not name the problem:\n%s", d.out.String())
	}
	// A second document is refused too, and counted by its reason.
	write("---\nlog: {level: debug}\n")
	d.signal(t, syscall.SIGHUP)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool {
		r := metrics.Find(s, "fabricbridge_config_refusals_total", metrics.L("reason", "documents")...)
		v := metrics.Find(s, "fabricbridge_config_refusals_total", metrics.L("reason", "value")...)
		return len(r) == 1 && r[0].Value == 1 && len(v) == 1 && v[0].Value == 1
	})
	write("")
	d.signal(t, syscall.SIGHUP)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool {
		r := metrics.Find(s, "fabricbridge_static_rules", metrics.L("kind", "rule")...)
		return len(r) == 1 && r[0].Value == 0
	})

	// SIGKILL: nothing is cleaned up by the daemon; a new one starts anyway.
	d.signal(t, syscall.SIGKILL)
	d.wait(t)
	for _, f := range []string{"control.sock", "admin.sock"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatalf("after SIGKILL %s should be left behind for the restart to clear: %v", f, err)
		}
	}
	write("rules:\n  - {id: 3, name: blocked, match: {protocol: udp, dst_port: 6666}, action: drop}\n")
	d = startDaemon(t, bridge, "run", "--config", path)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool { return len(s) > 0 })
	sendUDP(t, outside, dst, 5)
	waitMetric(t, bridge, metricsAddr, d, func(s []metrics.Sample) bool { return rulePackets(s, "3") == 5 })

	// SIGTERM: a clean exit that leaves nothing behind.
	d.signal(t, syscall.SIGTERM)
	if err := d.wait(t); err != nil {
		t.Errorf("exit after SIGTERM: %v\n%s", err, d.out.String())
	}
	if xdpOn(bridge, v.A.Name) {
		t.Error("XDP still attached after SIGTERM")
	}
	for _, f := range []string{"control.sock.lock", "control.sock", "admin.sock", "control.sock.ports"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !os.IsNotExist(err) {
			t.Errorf("%s left after SIGTERM: %v", f, err)
		}
	}
	var reserved []byte
	bridge.Do(func() (err error) {
		reserved, err = os.ReadFile("/proc/sys/net/ipv4/ip_local_reserved_ports")
		return err
	})
	if r := strings.TrimSpace(string(reserved)); r != "" {
		t.Errorf("reserved ports left after a crash and a clean stop: %q", r)
	}
	if !strings.Contains(d.out.String(), "fabricbridge stopped") {
		t.Errorf("no shutdown log:\n%s", d.out.String())
	}
}
