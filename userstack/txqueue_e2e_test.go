package userstack

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestStreamsTransmitOnQueuesThatExist runs the bridge on a wire with two
// receive queues in use and one transmit queue: the AF_XDP socket of queue
// 1 can receive but not transmit. The bridge names queue 1 in a warning;
// four applications, whose streams it would otherwise spread over both
// queues, each serve a download to the outside, and every download arrives
// whole.
func TestStreamsTransmitOnQueuesThatExist(t *testing.T) {
	e := newE2EWith(t, topology.VethOptions{Queues: 2}, func(wire *topology.Veth, _ *bridge.Config) error {
		var dev *features.Device
		if err := wire.B.NS.Do(func() (err error) { dev, err = features.OpenDevice(wire.B.Name); return err }); err != nil {
			return err
		}
		defer dev.Close()
		c, err := dev.Channels()
		if err != nil {
			return err
		}
		if c.RxQueues() != 2 || c.TxQueues() != 2 {
			return fmt.Errorf("%s has %d receive and %d transmit queues in use, not the 2 and 2 it was made with", wire.B.Name, c.RxQueues(), c.TxQueues())
		}
		c.Tx = 1
		return dev.SetChannels(c)
	})
	requireCopyPath(t, e)
	if n := len(e.b.Stats().Queues); n != 2 {
		t.Fatalf("the bridge serves %d queues, want both receive queues", n)
	}
	if log := e.log.String(); !strings.Contains(log, "receive but cannot transmit") || !strings.Contains(log, "queues=[1]") {
		t.Errorf("the bridge did not name queue 1 as one that cannot transmit; it logged:\n%s", log)
	}
	want := body(256 << 10)
	for i := range 4 {
		port := 80 + i
		l, err := e.open(false).Listen("tcp", fmt.Sprint(":", port))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		serveBody(t, l, want)
		downloadWhole(t, e, fmt.Sprint("application ", i), port, want)
	}
}
