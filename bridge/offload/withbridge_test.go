package offload_test

import (
	"errors"
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestBesideTheBridge runs the engine next to the bridge on the same
// queue, as bridge.StartOffload does on an XDP path: its socket shares the bridge's UMEM and
// fill ring and goes into the bridge's program's IngestXSKMap. Trigger
// datagrams reach the ring whole and in order, and the kernel still
// answers ping (the bridge passes what no rule claims).
func TestBesideTheBridge(t *testing.T) {
	testenv.RequirePrivileged(t)
	br, out, v := topology.Pair(t, topology.VethOptions{})
	var b *bridge.Bridge
	if err := br.Do(func() (err error) {
		b, err = bridge.Open(bridge.Config{Interface: v.A.Name, FrameCount: 1024})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Path() == bridge.PathAFPacket {
		t.Skipf("the bridge runs on %s, without XDP", b.Mode())
	}
	tables, err := classifier.Compile(&classifier.RuleSet{Rules: []classifier.Rule{
		{ID: 1, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(9000), Action: classifier.ActionIngest, Stream: 10},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.SetTables(tables); err != nil {
		t.Fatal(err)
	}
	ring, err := ingest.Create(ingest.Config{Name: filepath.Join(t.TempDir(), "r.sock"), Buffers: 64, BufferSize: 64 << 10, BufferID: 10})
	if err != nil {
		t.Fatal(err)
	}
	var eng *bridge.Offload
	if err := br.Do(func() (err error) {
		eng, err = b.StartOffload(bridge.OffloadConfig{}, map[uint32]*ingest.Ring{10: ring})
		return err
	}); err != nil {
		ring.Close()
		t.Fatal(err)
	}
	defer ring.Close() // after the engine (deferred later, runs first)
	defer eng.Close()
	c, err := ingest.Open(ring.Name(), ingest.ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	var conn *net.UDPConn
	if err := out.Do(func() (err error) {
		conn, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(v.B.Addr4.Addr(), 5001)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	dst := netip.AddrPortFrom(v.A.Addr4.Addr(), 9000)
	var ref ingest.Reference
	var p [64]byte
	const n = 500
	got := uint64(0)
	for seq := range uint32(n) {
		if _, err := conn.WriteToUDPAddrPort(p[:ingest.PutTriggerPayload(p[:], seq, []uint16{uint16(seq)})], dst); err != nil {
			t.Fatal(err)
		}
		if seq%10 != 9 {
			continue
		}
		for deadline := time.Now().Add(5 * time.Second); got < uint64(seq+1); {
			buf, err := c.Next(50 * time.Millisecond)
			if errors.Is(err, ingest.ErrTimeout) {
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d records; engine %+v", got, seq+1, eng.Stats())
				}
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := ref.Process(&buf); err != nil {
				t.Fatal(err)
			}
			got += uint64(buf.Records)
			c.Release(&buf)
		}
	}
	if s := ref.Sources[0]; s.Records != n || s.SenderGaps != 0 || s.SenderBackwards != 0 || s.LastSeq != n-1 {
		t.Errorf("reference %+v", s)
	}
	if _, err := out.Ping(v.A.Addr4.Addr(), 2, 3*time.Second); err != nil {
		t.Errorf("ping through the bridge: %v", err)
	}
	if st := eng.Stats(); st.Appended != n || st.Malformed != 0 {
		t.Errorf("engine %+v", st)
	}
}
