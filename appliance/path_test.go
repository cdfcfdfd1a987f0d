package appliance

import (
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/bridge"
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
