package features_test

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestChannels reads a veth's channels, sets fewer in use and reads them
// back, as `ethtool -l` and `ethtool -L` would, from a thread outside the
// namespace the device was opened in; loopback reports none.
func TestChannels(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, _, v := topology.Pair(t, topology.VethOptions{Queues: 2})
	var d, lo *features.Device
	if err := a.Do(func() (err error) {
		if d, err = features.OpenDevice(v.A.Name); err != nil {
			return err
		}
		lo, err = features.OpenDevice("lo")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	defer lo.Close()
	c, err := d.Channels()
	if err != nil || c.RxQueues() != 2 || c.MaxRx != 2 {
		t.Fatalf("veth with 2 queues: %+v, %v", c, err)
	}
	if err := d.SetChannels(features.Channels{Rx: 1, Tx: 1}); err != nil {
		t.Fatal(err)
	}
	if c, err := d.Channels(); err != nil || c.RxQueues() != 1 || c.Tx != 1 || c.MaxRx != 2 {
		t.Errorf("after setting 1: %+v, %v", c, err)
	}
	if _, err := lo.Channels(); !errors.Is(err, unix.EOPNOTSUPP) {
		t.Errorf("loopback's channels: %v, want EOPNOTSUPP", err)
	}
}
