package appliance

import (
	"io"
	"log/slog"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/ebpf"
)

// The file's flow_capacity sizes the bridge's XDP flow table; left out, the
// table has the loader's default size.
func TestBridgeConfigFlowCapacity(t *testing.T) {
	for _, tc := range []struct {
		iface string
		want  int
	}{
		{"", ebpf.DefaultFlowCapacity},
		{", flow_capacity: 1048576", 1 << 20},
	} {
		c, err := config.Parse("t.yaml", []byte("interfaces: [{name: eth1"+tc.iface+"}]\naddresses: [198.18.0.1]\n"))
		if err != nil {
			t.Fatal(err)
		}
		bc, err := bridgeConfig(c.Interfaces[0], slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		if bc.FlowCapacity != tc.want {
			t.Errorf("%q: bridge flow capacity %d, want %d", tc.iface, bc.FlowCapacity, tc.want)
		}
	}
}
