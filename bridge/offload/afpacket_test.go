package offload_test

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// afpTopo is the AF_PACKET topology: the bridge forced onto its AF_PACKET
// path on end A of a veth in namespace br, feeding a fed engine's ring for
// buffer 10 (UDP to ports 9000-9003); kernel senders on end B in out.
type afpTopo struct {
	t       *testing.T
	br, out *topology.NS
	v       *topology.Veth
	b       *bridge.Bridge
	off     *bridge.Offload
	ring    *ingest.Ring
}

const (
	afpBuffer = 10
	afpPort   = 9000
)

func newAFPTopo(t *testing.T, queues int) *afpTopo {
	testenv.RequirePrivileged(t)
	br, out, v := topology.Pair(t, topology.VethOptions{Queues: queues})
	tp := &afpTopo{t: t, br: br, out: out, v: v}
	if err := br.Do(func() (err error) {
		tp.b, err = bridge.Open(bridge.Config{Interface: v.A.Name, Path: bridge.PathAFPacket, Mode: bridge.ModeStrict, FrameCount: 256})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.b.Close() })
	if tp.b.Path() != bridge.PathAFPacket {
		t.Fatalf("the bridge runs on %s, want afpacket", tp.b.Mode())
	}
	tables, err := classifier.Compile(&classifier.RuleSet{Rules: []classifier.Rule{
		{ID: 1, Protocol: classifier.ProtoUDP, DstPorts: classifier.PortRange{Lo: afpPort, Hi: afpPort + 3}, Action: classifier.ActionIngest, Stream: afpBuffer},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tp.b.SetTables(tables); err != nil {
		t.Fatal(err)
	}
	tp.ring, err = ingest.Create(ingest.Config{Name: filepath.Join(t.TempDir(), "r.sock"), Buffers: 256, BufferSize: 64 << 10, Window: 2 * time.Millisecond, BufferID: afpBuffer})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.ring.Close() })
	if tp.off, err = tp.b.StartOffload(bridge.OffloadConfig{}, map[uint32]*ingest.Ring{afpBuffer: tp.ring}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.off.Close() }) // before the ring closes
	return tp
}

func (tp *afpTopo) describe() string {
	return fmt.Sprintf("engine %+v; ring %+v; bridge %+v", tp.off.Stats(), tp.ring.Stats(), tp.b.Stats().Queues)
}

func (tp *afpTopo) reader() *ingesttest.Reader {
	r := ingesttest.NewReader(tp.t, tp.ring.Name(), ingesttest.CheckTrigger)
	r.Describe = tp.describe
	return r
}

func (tp *afpTopo) sender(v6 bool, sport, dport uint16) *ingesttest.Sender {
	local, dst := tp.v.B.Addr4.Addr(), tp.v.A.Addr4.Addr()
	if v6 {
		local, dst = tp.v.B.Addr6.Addr(), tp.v.A.Addr6.Addr()
	}
	return ingesttest.NewSender(tp.t, tp.out, local, sport, netip.AddrPortFrom(dst, dport))
}

// TestAFPacketPath: with the bridge forced onto AF_PACKET, kernel senders
// on 16 source ports (IPv4 and IPv6), spread over the interface's two
// receive queues, reach the one ring complete, in order per source and
// byte-exact, through both queues' loops, with RX times on the ring's
// clock.
func TestAFPacketPath(t *testing.T) {
	tp := newAFPTopo(t, 2)
	rd := tp.reader()
	// Small bursts: the packet socket's ring is 8 blocks, each retired
	// after 1 ms however full, so a loop slowed down (by -race, say) for
	// 8 ms loses frames (counted as the bridge's KernelRxDrops).
	const flows, perSender, chunk = 16, 200, 4
	var senders []*ingesttest.Sender
	for i := range flows {
		senders = append(senders, tp.sender(i%4 == 3, uint16(6000+i), afpPort+uint16(i%4)))
	}
	start := ingest.Now()
	ingesttest.SendPaced(t, rd, senders, perSender, chunk)
	end := ingest.Now()
	rd.CloseComplete(t, flows, perSender)
	for i, s := range rd.Ref.Sources {
		// The packet socket's stamps, moved onto CLOCK_MONOTONIC; a
		// millisecond of slack for the two clocks' readings.
		if s.FirstRxNs+1e6 < start || s.LastRxNs > end+1e6 {
			t.Errorf("source %d stamped %d..%d ns after the first send, which ended after %d ns",
				i, int64(s.FirstRxNs-start), int64(s.LastRxNs-start), end-start)
		}
	}
	st := tp.off.Stats()
	if st.Appended != flows*perSender || st.Dropped != 0 || st.Malformed != 0 || st.NoRing != 0 || st.Refused != 0 {
		t.Errorf("engine %+v, want %d appended", st, flows*perSender)
	}
	busy := 0
	for _, q := range st.Queues {
		if q.Appended > 0 {
			busy++
		}
	}
	if busy < 2 {
		t.Fatalf("only %d of %d queues carried records: %+v", busy, len(st.Queues), st.Queues)
	}
	lat := rd.C.Stats().Latency
	t.Logf("%d buffers; latency p50 %v p99 %v", lat.Count, time.Duration(lat.Quantile(0.5)), time.Duration(lat.Quantile(0.99)))
}

// TestAFPacketMalformed: on the AF_PACKET path, bad UDP lengths, a
// truncated packet, hand-made fragments and the kernel's own fragments of
// a 3000-byte datagram never reach the ring; each is counted as refused,
// and whole datagrams around them arrive. A window closes on time with no
// further traffic (the engine's own loop closes it).
func TestAFPacketMalformed(t *testing.T) {
	tp := newAFPTopo(t, 1)
	rd := tp.reader()
	bad := ingesttest.MalformedFrames(ingesttest.Endpoints{
		Src4: tp.v.B.Addr4.Addr(), Dst4: tp.v.A.Addr4.Addr(), Src6: tp.v.B.Addr6.Addr(), Dst6: tp.v.A.Addr6.Addr(),
	}, 6001, afpPort)
	s := tp.sender(false, 5001, afpPort)
	var buf [1500]byte
	s.Send(ingesttest.TriggerPayload(buf[:], s.Port, 0))
	raw := tp.out.PacketSocket(t, tp.v.B.Index)
	for _, f := range bad {
		copy(f[0:6], tp.v.A.MAC)
		copy(f[6:12], tp.v.B.MAC)
		if err := unix.Sendto(raw, f, 0, &unix.SockaddrLinklayer{Ifindex: tp.v.B.Index}); err != nil {
			t.Fatal(err)
		}
	}
	big := make([]byte, 3000)
	ingest.PutTriggerPayload(big, 999, nil)
	if err := s.Send(big); err != nil {
		t.Fatal(err)
	}
	s.Send(ingesttest.TriggerPayload(buf[:], s.Port, 1))
	rd.WaitRecords(t, 2, 5*time.Second)
	wantRefused := uint64(len(bad) + 3)
	deadline := time.Now().Add(5 * time.Second)
	for tp.off.Stats().Refused < wantRefused && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // anything else that would arrive
	rd.Close()
	if rd.Err != nil || len(rd.Bad) > 0 {
		t.Fatal(rd.Err, rd.Bad)
	}
	if n := rd.Records.Load(); n != 2 || rd.Ref.Sources[0].LastSeq != 1 {
		t.Fatalf("%d records reached the ring (%+v), want the 2 whole datagrams", n, rd.Ref.Sources)
	}
	if st := tp.off.Stats(); st.Appended != 2 || st.Refused != wantRefused || st.Malformed != 0 {
		t.Errorf("engine %+v, want 2 appended and %d refused", st, wantRefused)
	}
}

// TestAFPacketShortPayloads: on the AF_PACKET path, as on the XDP path
// (TestShortPayloads), payloads of 0 to ingesttest.MaxShort bytes reach
// the consumer byte-exact — no header byte kept in front by the strip
// (classifier.Ingest leaves 14 bytes, as the program does), no Ethernet
// padding behind — from kernel senders over IPv4 and IPv6 and in
// hand-made IPv4 frames padded to 60 bytes.
func TestAFPacketShortPayloads(t *testing.T) {
	tp := newAFPTopo(t, 1)
	v4, v6 := tp.sender(false, 5101, afpPort), tp.sender(true, 5102, afpPort+1)
	frames := ingesttest.ShortFrames(ingesttest.Endpoints{Src4: tp.v.B.Addr4.Addr(), Dst4: tp.v.A.Addr4.Addr()}, 5103, afpPort+2)
	raw := tp.out.PacketSocket(t, tp.v.B.Index)
	const want = 3 * (ingesttest.MaxShort + 1)
	got := ingesttest.Collect(t, tp.ring.Name(), want, 5*time.Second, func() {
		ingesttest.SendShort(t, v4, v6, raw, frames, tp.v)
	})
	ingesttest.CheckShort(t, got, 5101, 5102, 5103)
	if st := tp.off.Stats(); st.Appended != want || st.Malformed != 0 || st.Refused != 0 {
		t.Errorf("engine %+v", st)
	}
}
