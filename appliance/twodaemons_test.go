package appliance

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// twoDaemonConfig writes the configuration of a daemon named name on end
// of a veth: its control socket is name.sock in dir, beside the others'.
func twoDaemonConfig(t *testing.T, dir, name string, end topology.End, ports, metrics string) *config.Config {
	t.Helper()
	text := fmt.Sprintf(`interfaces: [{name: %s}]
addresses: [%s]
reserved_ports: %s
metrics: {address: "%s"}
control: {socket: %s}
`, end.Name, end.Addr4.Addr(), ports, metrics, filepath.Join(dir, name+".sock"))
	return loadConfigText(t, filepath.Join(dir, name+".yaml"), text)
}

// TestTwoDaemonsOneNamespace: two daemons on two interfaces of one
// namespace. The second is refused a reserved-ports range that overlaps
// the first's, with both ranges and the first daemon named, and a metrics
// address the first serves, with the address to set instead; with ranges
// of their own both run, each with its own admin socket, and when one
// stops the other's range stays reserved.
func TestTwoDaemonsOneNamespace(t *testing.T) {
	tp := newTopo(t)
	v2 := topology.Connect(t, tp.bridge, tp.outside, topology.VethOptions{})
	if err := ethtool.DisableTxChecksum(tp.outside, v2.B.Name); err != nil {
		t.Fatal(err)
	}
	reserved := func() string {
		var s string
		tp.bridge.Do(func() error {
			b, err := os.ReadFile(reservedPortsFile)
			s = strings.TrimSpace(string(b))
			return err
		})
		return s
	}
	start := func(c *config.Config) (*Daemon, error) {
		var d *Daemon
		err := tp.bridge.Do(func() (err error) {
			d, err = Start(c, Options{Log: &syncBuffer{}})
			return err
		})
		return d, err
	}
	var metricsA string
	tp.bridge.Do(func() error {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err == nil {
			metricsA = ln.Addr().String()
			ln.Close()
		}
		return err
	})

	a, err := start(twoDaemonConfig(t, tp.dir, "a", tp.v.A, "50000-50099", metricsA))
	if err != nil {
		t.Fatal(err)
	}
	aClosed := false
	defer func() {
		if !aClosed {
			a.Close()
		}
	}()

	clash := twoDaemonConfig(t, tp.dir, "b", v2.A, "50050-50149", "127.0.0.1:0")
	if d, err := start(clash); err == nil {
		d.Close()
		t.Fatal("a second daemon took a range overlapping the first's")
	} else {
		t.Log(err)
		want := fmt.Sprintf("reserved_ports: 50050-50149 overlaps 50000-50099, the range of the fabricbridge daemon with control socket %s (pid %d)",
			filepath.Join(tp.dir, "a.sock"), os.Getpid())
		if msg := err.Error(); !strings.Contains(msg, clash.File) || !strings.Contains(msg, want) || !strings.Contains(msg, "set, for example, reserved_ports: 50100-50199") {
			t.Errorf("overlap refused with %q, want the file and %q", msg, want)
		}
	}

	busy := twoDaemonConfig(t, tp.dir, "b", v2.A, "50100-50199", metricsA)
	if d, err := start(busy); err == nil {
		d.Close()
		t.Fatal("a second daemon started on the first's metrics address")
	} else if t.Log(err); !strings.Contains(err.Error(), "metrics.address: "+metricsA+" is in use by the fabricbridge daemon with control socket "+filepath.Join(tp.dir, "a.sock")) ||
		!strings.Contains(err.Error(), "set metrics: {address: \"127.0.0.1:") {
		t.Errorf("metrics address clash: %q", err)
	}
	if got := reserved(); got != "50000-50099" {
		t.Fatalf("refused daemons changed the reserved ports: %q", got)
	}

	b, err := start(twoDaemonConfig(t, tp.dir, "b", v2.A, "50100-50199", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if got := reserved(); got != "50000-50199" {
		t.Errorf("both running: reserved %q, want 50000-50199", got)
	}
	for _, admin := range []string{"a.admin.sock", "b.admin.sock"} {
		if _, err := os.Stat(filepath.Join(tp.dir, admin)); err != nil {
			t.Errorf("admin socket: %v", err)
		}
	}

	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	aClosed = true
	if got := reserved(); got != "50100-50199" {
		t.Errorf("after the first stopped: reserved %q, want the second's 50100-50199", got)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if got := reserved(); got != "" {
		t.Errorf("after both stopped: reserved %q", got)
	}
}
