package appliance

import (
	"net"
	"slices"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/bridge/xsk"
)

// The configuration names the bridge's paths without importing the bridge;
// every name must mean the same path to both, in the same order.
func TestConfigPathsAreTheBridges(t *testing.T) {
	for p := config.PathAuto; p <= config.PathAFPacket; p++ {
		got, err := bridge.ParsePath(p.String())
		if err != nil {
			t.Fatalf("config path %q: %v", p, err)
		}
		if int(got) != int(p) {
			t.Errorf("config path %q is bridge path %d, want %d", p, got, p)
		}
	}
	if _, err := bridge.ParsePath(bridge.PathAFPacket.String()); err != nil || bridge.PathAFPacket != bridge.Path(config.PathAFPacket) {
		t.Errorf("the bridge has paths the configuration cannot name")
	}
}

// TestAttachFallbackIsLoud: when every XDP path fails (here another AF_XDP
// socket holds the interface's queue), the daemon runs on AF_PACKET and
// says so loudly: a warning naming the paths left and why, and
// fabricbridge_attach_fallback for each.
func TestAttachFallbackIsLoud(t *testing.T) {
	tp := newTopo(t)
	var holder *xsk.Umem
	if err := tp.bridge.Do(func() error {
		ifc, err := net.InterfaceByName(tp.v.A.Name)
		if err != nil {
			return err
		}
		if holder, err = xsk.NewUmem(xsk.UmemConfig{FrameCount: 256}); err != nil {
			return err
		}
		_, err = holder.Open(xsk.SocketConfig{Ifindex: ifc.Index, Queue: 0, Bind: xsk.BindCopy})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	var log syncBuffer
	d := tp.start(t, tp.config(t, ""), &log)
	defer d.Close()
	s := tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_attach_mode", "interface", tp.v.A.Name, "mode", "afpacket"); v != 1 {
		t.Fatalf("attach mode afpacket = %v", v)
	}
	fell := metrics.Find(s, "fabricbridge_attach_fallback", metrics.L("interface", tp.v.A.Name)...)
	var from []string
	for _, f := range fell {
		from = append(from, f.Label("from"))
		if f.Label("to") != "afpacket" || f.Label("reason") == "" {
			t.Errorf("fallback sample %+v", f)
		}
	}
	if !slices.Equal(from, []string{"native-zerocopy", "native-copy", "generic"}) {
		t.Errorf("fallbacks from %v", from)
	}
	if l := log.String(); !strings.Contains(l, `level=WARN msg="data path fell back to a slower path; expect much lower rates"`) ||
		!strings.Contains(l, "from=native-zerocopy to=afpacket") || !strings.Contains(l, "busy") {
		t.Errorf("no loud fallback in the log:\n%s", l)
	}
}
