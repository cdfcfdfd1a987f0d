package bridge

import (
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
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
// ns, with frames UMEM frames a queue, logging at info, and closes it when
// the test ends.
func openAllQueues(t *testing.T, ns *topology.NS, name string, frames int) *Bridge {
	t.Helper()
	var b *Bridge
	if err := ns.Do(func() (err error) {
		b, err = Open(Config{Interface: name, FrameCount: frames, Logger: slog.New(slog.NewTextHandler(logWriter{t}, nil))})
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
	b := openAllQueues(t, ns, "fbplain0", 256)
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
	setVethChannels(t, v, 1)

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

	b := openAllQueues(t, br, v.A.Name, 256)
	if b.Path() != PathNativeCopy {
		t.Fatalf("path %v, want native-copy; tried %v", b.Path(), b.Tried())
	}
	if got := servedQueues(b); !slices.Equal(got, []int{0}) {
		t.Fatalf("serves queues %v, want [0]", got)
	}

	setVethChannels(t, v, 2)
	waitQueues(t, "the bridge", func() []int { return servedQueues(b) }, []int{0, 1})
	if b.Path() != PathNativeCopy || b.Stats().QueueErrors != 0 {
		t.Fatalf("path %v, queue errors %d", b.Path(), b.Stats().QueueErrors)
	}
}

// setVethChannels sets both ends of v to n receive and n transmit queues in
// use (`ethtool -L rx n tx n`). Native XDP on a veth wants at least as many
// queues in use on its end as its peer transmits on: it shrinks the peer
// first and grows it last.
func setVethChannels(t *testing.T, v *topology.Veth, n uint32) {
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

// waitQueues waits a few channel polls for queues() to report want, and
// fails the test naming who serves them if it does not.
func waitQueues(t *testing.T, who string, queues func() []int, want []int) {
	t.Helper()
	deadline := time.Now().Add(5 * channelPoll)
	for !slices.Equal(queues(), want) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if got := queues(); !slices.Equal(got, want) {
		t.Fatalf("after the channels changed %s serves queues %v, want %v", who, got, want)
	}
}

// TestIngestFollowsChannels: a bridge serving all queues of a veth with one
// in use runs the offload engine on queue 0; when the channels grow to two,
// the engine gains a socket and a loop on queue 1 too, and ingest
// datagrams from many flows, which the outside's flow hash spreads over
// both queues, all reach the ring, some of them through queue 1. Before,
// those landing on queue 1 found no ingest socket and went to the kernel.
func TestIngestFollowsChannels(t *testing.T) {
	testenv.RequirePrivileged(t)
	br, out, v := topology.Pair(t, topology.VethOptions{Queues: 2})
	setVethChannels(t, v, 1)
	// The engine's frames come from the bridge's fill ring: room for a
	// round of sends while a loop slowed by -race catches up.
	b := openAllQueues(t, br, v.A.Name, 1024)
	if b.Path() != PathNativeCopy {
		t.Fatalf("path %v, want native-copy; tried %v", b.Path(), b.Tried())
	}
	const buffer, port = 10, 9000
	tables, err := classifier.Compile(&classifier.RuleSet{Rules: []classifier.Rule{
		{ID: 1, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(port), Action: classifier.ActionIngest, Stream: buffer},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.SetTables(tables); err != nil {
		t.Fatal(err)
	}
	ring, err := ingest.Create(ingest.Config{Name: filepath.Join(t.TempDir(), "r.sock"), Buffers: 256, BufferSize: 64 << 10, Window: 2 * time.Millisecond, BufferID: buffer})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ring.Close() }) // after the engine's, which the test adds later
	var off *Offload
	if err := br.Do(func() (err error) {
		off, err = b.StartOffload(OffloadConfig{}, map[uint32]*ingest.Ring{buffer: ring})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { off.Close() })
	engineQueues := func() []int {
		var ids []int
		for _, q := range off.Stats().Queues {
			ids = append(ids, q.Queue)
		}
		return ids
	}
	if got := engineQueues(); !slices.Equal(got, []int{0}) {
		t.Fatalf("the engine serves queues %v, want [0]", got)
	}

	setVethChannels(t, v, 2)
	waitQueues(t, "the bridge", func() []int { return servedQueues(b) }, []int{0, 1})
	waitQueues(t, "the offload engine", engineQueues, []int{0, 1})
	vethRunXDPOnAllQueues(t, br, v.A.Name)

	rd := ingesttest.NewReader(t, ring.Name(), ingesttest.CheckTrigger)
	rd.Describe = func() string {
		cs, _ := b.prog.Counters()
		return fmt.Sprintf("engine %+v; bridge %+v; program %+v", off.Stats(), b.Stats(), cs)
	}
	// Senders made after the change: with 16 flows hashed over the two
	// transmit queues outside, which veth maps to the same receive queues
	// here, all landing on queue 0 has a chance of 2^-16.
	const flows, perSender, chunk = 16, 200, 5
	var senders []*ingesttest.Sender
	for i := range flows {
		senders = append(senders, ingesttest.NewSender(t, out, v.B.Addr4.Addr(), uint16(6000+i), netip.AddrPortFrom(v.A.Addr4.Addr(), port)))
	}
	ingesttest.SendPaced(t, rd, senders, perSender, chunk)
	rd.CloseComplete(t, flows, perSender)
	st := off.Stats()
	t.Logf("per queue: %+v", st.Queues)
	if st.Appended != flows*perSender || st.Malformed != 0 || st.Dropped != 0 || st.KernelDrops != 0 {
		t.Errorf("engine %+v, want %d appended", st, flows*perSender)
	}
	if q := st.Queues[1]; q.Queue != 1 || q.Appended == 0 {
		t.Errorf("queue 1 carried no ingest datagrams: %+v", st.Queues)
	}
	if n := b.Stats().QueueErrors; n != 0 {
		t.Errorf("queue errors %d", n)
	}
}

// vethRunXDPOnAllQueues takes interface name in ns down and up again. veth
// installs its XDP program on a receive queue only when the program is
// attached or the device opened, not when `ethtool -L` brings the queue
// into use: frames on such a queue skip the program and go to the kernel.
// A NIC driver sets up XDP on every channel it (re)creates; the bounce
// makes veth do the same. It leaves the XDP program, the AF_XDP sockets
// and the IPv4 addresses in place (IPv6 ones are lost).
func vethRunXDPOnAllQueues(t *testing.T, ns *topology.NS, name string) {
	t.Helper()
	l, err := ns.Handle().LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := ns.Handle().LinkSetDown(l); err != nil {
		t.Fatal(err)
	}
	if err := ns.Handle().LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
}
