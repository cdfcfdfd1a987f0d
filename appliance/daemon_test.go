package appliance

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// syncBuffer is a log sink that tests read while the daemon writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// topo is a bridge namespace with the daemon's interface and an outside one.
type topo struct {
	bridge, outside *topology.NS
	v               *topology.Veth
	dir             string
	// iface is appended inside the interface's flow mapping, such as
	// ", path: afpacket".
	iface string
}

func newTopo(t testing.TB) *topo {
	testenv.RequirePrivileged(t)
	b, o, v := topology.Pair(t, topology.VethOptions{})
	// Complete checksums on the "wire", as a NIC would send them.
	if err := ethtool.DisableTxChecksum(o, v.B.Name); err != nil {
		t.Fatal(err)
	}
	return &topo{bridge: b, outside: o, v: v, dir: t.TempDir()}
}

// config renders a configuration for the topology; extra is appended,
// control (lines indented by two spaces) goes into the control section.
func (tp *topo) config(t testing.TB, extra string, control ...string) *config.Config {
	t.Helper()
	text := fmt.Sprintf(`interfaces: [{name: %s%s}]
addresses: [%s, "%s"]
metrics: {address: "127.0.0.1:0"}
log: {level: debug}
control:
  socket: %s
%s`, tp.v.A.Name, tp.iface, tp.v.A.Addr4.Addr(), tp.v.A.Addr6.Addr(), filepath.Join(tp.dir, "control.sock"), strings.Join(control, "")) + extra
	return loadConfigText(t, filepath.Join(tp.dir, "fabricbridge.yaml"), text)
}

// loadConfigText writes a configuration to path and loads it.
func loadConfigText(t testing.TB, path, text string) *config.Config {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (tp *topo) start(t *testing.T, c *config.Config, log io.Writer) *Daemon {
	t.Helper()
	var d *Daemon
	if err := tp.bridge.Do(func() (err error) {
		d, err = Start(c, Options{Log: log})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return d
}

// scrape reads /metrics from inside the bridge namespace.
func (tp *topo) scrape(t *testing.T, d *Daemon) []metrics.Sample {
	t.Helper()
	var conn net.Conn
	if err := tp.bridge.Do(func() (err error) {
		conn, err = net.Dial("tcp", d.MetricsAddr().String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{Dial: func(string, string) (net.Conn, error) { return conn, nil }}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("http://" + d.MetricsAddr().String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s, err := metrics.Parse(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func value(t *testing.T, s []metrics.Sample, name string, labels ...string) float64 {
	t.Helper()
	got := metrics.Find(s, name, metrics.L(labels...)...)
	if len(got) != 1 {
		t.Fatalf("%s%v: %d samples", name, labels, len(got))
	}
	return got[0].Value
}

// sendUDP sends n datagrams from the outside namespace to port on the bridge.
func (tp *topo) sendUDP(t *testing.T, port uint16, n int) {
	t.Helper()
	err := tp.outside.Do(func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(tp.v.A.Addr4.Addr(), port)))
		if err != nil {
			return err
		}
		defer c.Close()
		for range n {
			if _, err := c.Write([]byte("fabricbridge test")); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func xdpAttached(t *testing.T, tp *topo) bool {
	var on bool
	tp.bridge.Do(func() error {
		l, err := netlink.LinkByName(tp.v.A.Name)
		if err == nil && l.Attrs().Xdp != nil {
			on = l.Attrs().Xdp.Attached
		}
		return err
	})
	return on
}

func TestDaemonLifecycle(t *testing.T) {
	tp := newTopo(t)
	c := tp.config(t, `rules:
  - {id: 3, name: blocked, match: {protocol: udp, dst_port: 6666}, action: drop}
`)
	var log syncBuffer
	d := tp.start(t, c, &log)
	closed := false
	defer func() {
		if !closed {
			d.Close()
		}
	}()
	if !xdpAttached(t, tp) {
		t.Fatal("XDP not attached")
	}

	// A kernel socket behind the drop rule gets nothing.
	var sock *net.UDPConn
	if err := tp.bridge.Do(func() (err error) {
		sock, err = net.ListenUDP("udp", &net.UDPAddr{Port: 6666})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	tp.sendUDP(t, 6666, 20)
	if n := drain(sock, 200*time.Millisecond); n != 0 {
		t.Errorf("%d datagrams passed a drop rule", n)
	}
	s := tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_rule_packets_total", "id", "3", "name", "blocked"); v != 20 {
		t.Errorf("rule 3 counted %v, want 20", v)
	}
	mode := metrics.Find(s, "fabricbridge_attach_mode", metrics.L("interface", tp.v.A.Name)...)
	if len(mode) != 1 || mode[0].Value != 1 || mode[0].Label("mode") == "" {
		t.Errorf("attach mode: %+v", mode)
	}

	// Reload without the rule: the datagrams reach the kernel.
	next := tp.config(t, "")
	if err := d.Reload(next); err != nil {
		t.Fatal(err)
	}
	tp.sendUDP(t, 6666, 20)
	if n := drain(sock, 200*time.Millisecond); n != 20 {
		t.Errorf("after reload %d of 20 datagrams reached the kernel", n)
	}
	s = tp.scrape(t, d)
	if value(t, s, "fabricbridge_reloads_total", "result", "ok") != 1 || value(t, s, "fabricbridge_static_rules", "kind", "rule") != 0 {
		t.Errorf("reload not counted")
	}

	// A reload that changes a restart-only section keeps it, and says so.
	moved := *next
	moved.ReservedPorts = config.PortRange{Lo: 50000, Hi: 50099}
	if err := d.Reload(&moved); err != nil {
		t.Fatal(err)
	}
	if d.Config().ReservedPorts != next.ReservedPorts || !strings.Contains(log.String(), "sections=[reserved_ports]") {
		t.Errorf("restart-only change applied, or not logged:\n%s", log.String())
	}

	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	if xdpAttached(t, tp) {
		t.Error("XDP still attached after Close")
	}
	if _, err := os.Stat(c.Control.Socket + ".lock"); !os.IsNotExist(err) {
		t.Errorf("lock file left: %v", err)
	}
	var reserved string
	tp.bridge.Do(func() error {
		b, err := os.ReadFile(reservedPortsFile)
		reserved = strings.TrimSpace(string(b))
		return err
	})
	if reserved != "" {
		t.Errorf("reserved ports left: %q", reserved)
	}
	for _, want := range []string{"level=INFO msg=\"data path attached\"", "msg=reloaded", "msg=\"fabricbridge stopped\""} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, log.String())
		}
	}
}

func drain(c *net.UDPConn, quiet time.Duration) int {
	buf := make([]byte, 2048)
	n := 0
	for {
		c.SetReadDeadline(time.Now().Add(quiet))
		if _, err := c.Read(buf); err != nil {
			return n
		}
		n++
	}
}
