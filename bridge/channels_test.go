package bridge

import (
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func servedQueues(b *Bridge) []int {
	var ids []int
	for _, q := range b.Stats().Queues {
		ids = append(ids, q.Queue)
	}
	return ids
}

// openAllQueues opens a bridge on every queue in use of interface name in
// ns, logging at info, and closes it when the test ends.
func openAllQueues(t *testing.T, ns *topology.NS, name string) *Bridge {
	t.Helper()
	var b *Bridge
	if err := ns.Do(func() (err error) {
		b, err = Open(Config{Interface: name, FrameCount: 256, Logger: slog.New(slog.NewTextHandler(logWriter{t}, nil))})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestAllQueuesPlainVeth: a veth made as `ip link add … type veth` makes
// it, with queues allocated for every CPU and one in use. Serving all
// queues binds the one in use and stays on XDP; counting the allocated
// ones bound queue 1, failed on every XDP path and ended on AF_PACKET.
func TestAllQueuesPlainVeth(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns := topology.New(t)
	attrs := netlink.NewLinkAttrs()
	attrs.Name = "fbplain0"
	veth := &netlink.Veth{LinkAttrs: attrs, PeerName: "fbplain1"} // no queue counts: the kernel's defaults
	if err := ns.Handle().LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	var allocated int
	for _, name := range []string{"fbplain0", "fbplain1"} {
		l, err := ns.Handle().LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.Handle().LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		allocated = l.Attrs().NumRxQueues
	}
	t.Logf("veth: %d receive queues allocated", allocated)
	b := openAllQueues(t, ns, "fbplain0")
	if b.Path() != PathNativeCopy {
		t.Errorf("path %v, want native-copy; tried %v", b.Path(), b.Tried())
	}
	if got := servedQueues(b); !slices.Equal(got, []int{0}) {
		t.Errorf("serves queues %v, want [0]", got)
	}
}

// TestAllQueuesFollowChannels: on a veth with two queues allocated and one
// in use (`ethtool -L rx 1 tx 1`), serving all queues binds queue 0 only
// and stays on XDP; when the channels grow back to two, the bridge binds
// queue 1 on the same path. A queue named in Config.Queues that is not in
// use is refused by name instead of walking down to AF_PACKET.
func TestAllQueuesFollowChannels(t *testing.T) {
	testenv.RequirePrivileged(t)
	br, _, v := topology.Pair(t, topology.VethOptions{Queues: 2})
	// Native XDP on a veth wants at least as many queues in use on its end
	// as its peer transmits on: shrink the peer first, grow it last.
	setChannels := func(n uint32) {
		t.Helper()
		ends := []topology.End{v.B, v.A}
		if n > 1 {
			ends = []topology.End{v.A, v.B}
		}
		for _, end := range ends {
			if err := end.NS.Do(func() error {
				d, err := features.OpenDevice(end.Name)
				if err != nil {
					return err
				}
				defer d.Close()
				return d.SetChannels(features.Channels{Rx: n, Tx: n})
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
	setChannels(1)

	err := br.Do(func() error {
		b, err := Open(Config{Interface: v.A.Name, Queues: []int{0, 1}, FrameCount: 256})
		if err == nil {
			b.Close()
		}
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "queue 1 of "+v.A.Name+" is not in use") {
		t.Errorf("queues [0 1] with one in use: %v", err)
	}

	b := openAllQueues(t, br, v.A.Name)
	if b.Path() != PathNativeCopy {
		t.Fatalf("path %v, want native-copy; tried %v", b.Path(), b.Tried())
	}
	if got := servedQueues(b); !slices.Equal(got, []int{0}) {
		t.Fatalf("serves queues %v, want [0]", got)
	}

	setChannels(2)
	deadline := time.Now().Add(5 * channelPoll)
	for !slices.Equal(servedQueues(b), []int{0, 1}) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if got := servedQueues(b); !slices.Equal(got, []int{0, 1}) {
		t.Fatalf("after the channels grew to 2 the bridge serves queues %v, want [0 1]", got)
	}
	if b.Path() != PathNativeCopy || b.Stats().QueueErrors != 0 {
		t.Fatalf("path %v, queue errors %d", b.Path(), b.Stats().QueueErrors)
	}
}
