package features_test

import (
	"errors"
	"testing"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestGetSet turns features of a veth off and on again and reads them back,
// as `ethtool -K` and `ethtool -k` would.
func TestGetSet(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, _, v := topology.Pair(t, topology.VethOptions{})
	var f *features.Interface
	if err := a.Do(func() (err error) { f, err = features.Open(v.A.Name); return err }); err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	names := []string{"rx-vlan-hw-parse", "tx-checksum-ip-generic"}
	for _, name := range names {
		s, err := f.Get(name)
		if err != nil {
			t.Fatal(err)
		}
		if !s.Active || !s.Changeable {
			t.Fatalf("%s of a new veth: %+v, want on and changeable", name, s)
		}
	}
	for _, on := range []bool{false, true} {
		if err := f.Set(names, on); err != nil {
			t.Fatal(err)
		}
		for _, name := range names {
			if s, err := f.Get(name); err != nil || s.Active != on {
				t.Errorf("%s after Set(%v): %+v, %v", name, on, s, err)
			}
		}
	}
	// A fixed feature cannot be turned on, and Set says so.
	if s, err := f.Get("rx-vlan-filter"); err != nil || s.Changeable || s.Active {
		t.Fatalf("rx-vlan-filter of a veth: %+v, %v; want off and fixed", s, err)
	}
	if err := f.Set([]string{"rx-vlan-filter"}, true); err == nil {
		t.Error("turning a fixed feature on succeeded")
	}
	if _, err := f.Get("no-such-feature"); err == nil {
		t.Error("an unknown feature has a state")
	}
	if err := a.Do(func() error { _, err := features.Open("fbnosuchif0"); return err }); err == nil || errors.Is(err, features.ErrNoFeatures) {
		t.Errorf("opening a missing interface: %v", err)
	}
}
