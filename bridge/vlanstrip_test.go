package bridge

import (
	"testing"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// stripping reads the state of the VLAN stripping features of an interface.
func stripping(t *testing.T, ns *topology.NS, ifname string) map[string]bool {
	t.Helper()
	got := map[string]bool{}
	err := ns.Do(func() error {
		f, err := features.Open(ifname)
		if err != nil {
			return err
		}
		defer f.Close()
		for _, name := range vlanStripFeatures {
			s, err := f.Get(name)
			if err != nil {
				return err
			}
			got[name] = s.Active
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// A veth strips VLAN tags on receive like a NIC (the features are on and can
// be changed), though it has nothing to strip: enough to check the bridge
// turns them off only for VLAN rules on the XDP path, and back on at Close.
func TestVLANStrippingOffForVLANRules(t *testing.T) {
	vlanRule := &classifier.RuleSet{Rules: []classifier.Rule{
		{ID: 10, Priority: 1, VLAN: 100, Protocol: classifier.ProtoUDP, Action: classifier.ActionSteer, Stream: 1},
	}}
	allOn := func(t *testing.T, got map[string]bool, when string) {
		t.Helper()
		for name, on := range got {
			if !on {
				t.Errorf("%s: %s is off", when, name)
			}
		}
	}
	t.Run("xdp", func(t *testing.T) {
		r := newRig(t, Config{})
		allOn(t, stripping(t, r.br, r.v.A.Name), "before")
		r.standardTables()
		allOn(t, stripping(t, r.br, r.v.A.Name), "tables without VLAN rules")
		r.setTables(vlanRule)
		for name, on := range stripping(t, r.br, r.v.A.Name) {
			if on {
				t.Errorf("with a VLAN rule: %s is still on", name)
			}
		}
		if r.b.Stats().VLANRulesBlind {
			t.Error("VLANRulesBlind reported although stripping was turned off")
		}
		if err := r.b.Close(); err != nil {
			t.Fatal(err)
		}
		allOn(t, stripping(t, r.br, r.v.A.Name), "after Close")
	})
	t.Run("afpacket", func(t *testing.T) {
		r := newRig(t, Config{Path: PathAFPacket, Mode: ModeStrict})
		r.setTables(vlanRule)
		allOn(t, stripping(t, r.br, r.v.A.Name), "AF_PACKET path with a VLAN rule")
	})
}
