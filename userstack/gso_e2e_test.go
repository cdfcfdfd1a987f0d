package userstack

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestSegmentOffloadFollowsTSO turns the bridge interface's TCP
// segmentation offload off and on under a running bridge: downloads arrive
// whole either way, segments are joined only while the device segments
// them, and no offload send is lost once the bridge has seen the change.
func TestSegmentOffloadFollowsTSO(t *testing.T) {
	e := newE2E(t)
	download, joined := offloadDownloads(t, e)
	var feats *features.Interface
	if err := e.br.Do(func() (err error) { feats, err = features.Open(e.wire.B.Name); return err }); err != nil {
		t.Fatal(err)
	}
	defer feats.Close()
	tso := []string{"tx-tcp-segmentation", "tx-tcp6-segmentation"}
	setTSO := func(on bool) {
		t.Helper()
		if err := feats.Set(tso, on); err != nil {
			t.Fatal(err)
		}
		// The bridge reads the features every second.
		time.Sleep(1500 * time.Millisecond)
	}
	t.Cleanup(func() { feats.Set(tso, true) })

	download("TSO on")
	on, lost := joined()
	if on == 0 || lost != 0 {
		t.Fatalf("TSO on: %d segments joined, %d lost; want some joined, none lost", on, lost)
	}
	setTSO(false)
	download("TSO off")
	off, lost := joined()
	if off != on || lost != 0 {
		t.Fatalf("TSO off: %d more segments joined, %d lost; want none of either", off-on, lost)
	}
	setTSO(true)
	download("TSO on again")
	again, lost := joined()
	if again == off || lost != 0 {
		t.Fatalf("TSO on again: %d more segments joined, %d lost; want some joined, none lost", again-off, lost)
	}
}

// TestSegmentOffloadOnTwoTxQueues runs a bridge on a wire that transmits
// on one of its two queues, then gives it the second (ethtool -L).
// Downloads arrive whole every time, and segments are joined on one
// queue. On two, the packet socket could put a connection's segments on
// another queue than the AF_XDP socket's: an unpinned loop joins nothing
// more, and a loop pinned to a CPU goes on joining but sends every packet
// through the packet socket, none through its AF_XDP ring. (The way back
// to one queue is refused by the kernel: the bridge's AF_XDP socket on
// queue 1 holds the channel.)
func TestSegmentOffloadOnTwoTxQueues(t *testing.T) {
	t.Run("unpinned", func(t *testing.T) { segmentOffloadOnTwoTxQueues(t, false) })
	t.Run("pinned", func(t *testing.T) { segmentOffloadOnTwoTxQueues(t, true) })
}

func segmentOffloadOnTwoTxQueues(t *testing.T, pin bool) {
	// Both ends are made with two queues and narrowed to one before the
	// bridge opens: a veth with XDP wants as many receive queues as its
	// peer transmits on, and the bridge then serves queue 0 alone.
	var dev *features.Device
	var first features.Channels
	narrow := func(end topology.End, keep *features.Channels, opened **features.Device) error {
		var d *features.Device
		if err := end.NS.Do(func() (err error) { d, err = features.OpenDevice(end.Name); return err }); err != nil {
			return err
		}
		c, err := d.Channels()
		if err != nil {
			d.Close()
			return err
		}
		if c.TxQueues() != 2 {
			d.Close()
			return fmt.Errorf("%s transmits on %d queues, not the 2 it was made with", end.Name, c.TxQueues())
		}
		c.Rx, c.Tx = 1, 1
		if err := d.SetChannels(c); err != nil {
			d.Close()
			return err
		}
		if opened == nil {
			return d.Close()
		}
		*keep, *opened = c, d
		t.Cleanup(func() { d.Close() })
		return nil
	}
	e := newE2EWith(t, topology.VethOptions{Queues: 2}, func(wire *topology.Veth, cfg *bridge.Config) error {
		if pin {
			var allowed unix.CPUSet
			if err := unix.SchedGetaffinity(0, &allowed); err != nil {
				return err
			}
			for c := 0; c < 1024 && cfg.CPUs == nil; c++ {
				if allowed.IsSet(c) {
					cfg.CPUs = []int{c}
				}
			}
		}
		if err := narrow(wire.A, nil, nil); err != nil {
			return err
		}
		return narrow(wire.B, &first, &dev)
	})
	download, _ := offloadDownloads(t, e)
	counts := func() (c bridge.QueueStats) {
		for _, q := range e.b.Stats().Queues {
			c.TxPackets += q.TxPackets
			c.TxJoined += q.TxJoined
			c.TxOffloadLost += q.TxOffloadLost
			c.TxPacketSocket += q.TxPacketSocket
		}
		return c
	}

	download("one transmit queue")
	one := counts()
	if one.TxJoined == 0 || one.TxOffloadLost != 0 {
		t.Fatalf("one transmit queue: %d segments joined, %d lost; want some joined, none lost", one.TxJoined, one.TxOffloadLost)
	}
	if one.TxPacketSocket >= one.TxPackets {
		t.Fatalf("one transmit queue: all %d packets went through the packet socket; want those that join alone", one.TxPackets)
	}
	second := first
	second.Tx = 2
	if err := dev.SetChannels(second); err != nil {
		t.Fatal(err)
	}
	// The bridge reads the queues every second.
	time.Sleep(1500 * time.Millisecond)
	before := counts()
	download("two transmit queues")
	two := counts()
	sent, joined, viaSocket := two.TxPackets-before.TxPackets, two.TxJoined-before.TxJoined, two.TxPacketSocket-before.TxPacketSocket
	if two.TxOffloadLost != 0 {
		t.Fatalf("two transmit queues: %d segments lost in offload sends", two.TxOffloadLost)
	}
	if !pin {
		if joined != 0 || viaSocket != 0 {
			t.Fatalf("two transmit queues, loop not pinned: %d segments joined and %d packets through the packet socket; want none", joined, viaSocket)
		}
		if !strings.Contains(e.log.String(), "segments are not joined") {
			t.Errorf("the bridge did not warn that an unpinned loop stops joining; it logged:\n%s", e.log.String())
		}
		return
	}
	if joined == 0 || viaSocket != sent {
		t.Fatalf("two transmit queues, loop pinned: %d segments joined, %d of %d packets through the packet socket; want some joined and every packet through it", joined, viaSocket, sent)
	}
	if !strings.Contains(e.log.String(), "tx_queues=2") {
		t.Errorf("the bridge did not log the second transmit queue; it logged:\n%s", e.log.String())
	}
}

// offloadDownloads serves a 2 MiB body on :80 from an application behind
// e's bridge, which must be on a copy path, and returns a download of it
// from the outside over both families, checked whole, and the segments the
// bridge has sent joined and lost so far.
func offloadDownloads(t *testing.T, e *e2e) (download func(what string), joined func() (n, lost uint64)) {
	t.Helper()
	requireCopyPath(t, e)
	l, err := e.open(false).Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	want := body(2 << 20)
	serveBody(t, l, want)
	download = func(what string) {
		t.Helper()
		downloadWhole(t, e, what, 80, want)
	}
	joined = func() (n, lost uint64) {
		for _, q := range e.b.Stats().Queues {
			n += q.TxJoined
			lost += q.TxOffloadLost
		}
		return n, lost
	}
	return download, joined
}

// downloadWhole fetches http://HOST:port/ from the outside for both of the
// bridge host's addresses and fails unless want arrives whole.
func downloadWhole(t *testing.T, e *e2e, what string, port int, want []byte) {
	t.Helper()
	for _, host := range []string{e.local4.String(), "[" + e.local6.String() + "]"} {
		url := fmt.Sprintf("http://%s:%d/", host, port)
		got, err := httpGet(testCtx(t, 30*time.Second), e.dialOutside, url)
		if err != nil {
			t.Fatalf("%s, %s: %v", what, url, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s, %s: %d bytes arrived, not the %d served", what, url, len(got), len(want))
		}
	}
}

// requireCopyPath fails the test unless e's bridge runs on a copy path
// (native-copy or generic), where frames leave through the kernel's skbs.
func requireCopyPath(t *testing.T, e *e2e) {
	t.Helper()
	if p := e.b.Stats().Path; p != bridge.PathNativeCopy.String() && p != bridge.PathGeneric.String() {
		t.Fatalf("path %s: the test needs a copy path", p)
	}
}
