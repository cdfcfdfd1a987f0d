package xsk_test

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge/xsk"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

const port = 7000

// setup attaches the classifier to the bridge end of a veth, with a UDP
// listener on port that steers to stream 1.
func setup(t *testing.T, queues int) (*ebpf.Program, *topology.NS, *topology.NS, *topology.Veth) {
	testenv.RequirePrivileged(t)
	br, out, v := topology.Pair(t, topology.VethOptions{Queues: queues})
	prog, err := ebpf.Load()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	tab, err := classifier.Compile(&classifier.RuleSet{Listeners: []classifier.Listener{
		{ID: 1, Protocol: classifier.ProtoUDP, Port: port, Stream: 1},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := prog.Update(tab); err != nil {
		t.Fatal(err)
	}
	if err := br.Do(func() error { _, err := prog.Attach(v.A.Index, ebpf.ModeNative); return err }); err != nil {
		t.Fatal(err)
	}
	return prog, br, out, v
}

func open(t *testing.T, ns *topology.NS, u *xsk.Umem, cfg xsk.SocketConfig) (*xsk.Socket, error) {
	var s *xsk.Socket
	err := ns.Do(func() (err error) { s, err = u.Open(cfg); return err })
	return s, err
}

func newUmem(t *testing.T, frames int) *xsk.Umem {
	u, err := xsk.NewUmem(xsk.UmemConfig{FrameCount: frames})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { u.Close() })
	return u
}

func sendUDP(t *testing.T, ns *topology.NS, to netip.AddrPort, payloads [][]byte) {
	t.Helper()
	if err := ns.Do(func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
		if err != nil {
			return err
		}
		defer c.Close()
		for _, p := range payloads {
			if _, err := c.Write(p); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// receive takes n frames from s, checks their metadata says stream 1, hands
// back their UDP payloads and returns the frames to the fill ring.
func receive(t *testing.T, u *xsk.Umem, s *xsk.Socket, n int) [][]byte {
	return receiveAny(t, u, []*xsk.Socket{s}, n)
}

// receiveAny is receive from whichever of socks the frames arrive on.
func receiveAny(t *testing.T, u *xsk.Umem, socks []*xsk.Socket, n int) [][]byte {
	t.Helper()
	var got [][]byte
	descs := make([]xsk.Desc, xsk.MaxBatch)
	addrs := make([]uint64, xsk.MaxBatch)
	deadline := time.Now().Add(5 * time.Second)
	for i := 0; len(got) < n && time.Now().Before(deadline); i++ {
		s := socks[i%len(socks)]
		k := s.RX.Receive(descs)
		if k == 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		for i, d := range descs[:k] {
			m := classifier.UnmarshalMeta(u.Meta(d.Addr, classifier.MetaSize))
			if m.StreamID != 1 || m.Verdict != classifier.VerdictSteer {
				t.Errorf("frame with metadata %+v", m)
			}
			frame := u.Bytes(d.Addr, int(d.Len))
			p, err := ippkt.Parse(frame[m.L3Offset:])
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, append([]byte(nil), p.Payload...))
			addrs[i] = d.Addr
		}
		if f := s.Fill.Fill(addrs[:k]); f != k {
			t.Fatalf("fill ring took %d of %d returned frames", f, k)
		}
	}
	if len(got) != n {
		t.Fatalf("received %d of %d frames", len(got), n)
	}
	return got
}

func payloads(n int, tag string) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = []byte(fmt.Sprintf("%s %d", tag, i))
	}
	return out
}

func fill(t *testing.T, u *xsk.Umem, s *xsk.Socket, n int) {
	addrs := make([]uint64, n)
	if k := u.Alloc(addrs); k != n {
		t.Fatalf("allocated %d of %d", k, n)
	}
	if k := s.Fill.Fill(addrs); k != n {
		t.Fatalf("filled %d of %d", k, n)
	}
}

// TestReceiveTransmitAccount binds a copy-mode socket behind the real XDP
// classifier: the outside kernel's datagrams arrive with their metadata,
// frames sent through the TX ring reach the outside kernel's socket, and
// afterwards every frame is accounted for exactly once.
func TestReceiveTransmitAccount(t *testing.T) {
	prog, br, out, v := setup(t, 1)
	u := newUmem(t, 512)
	s, err := open(t, br, u, xsk.SocketConfig{Ifindex: v.A.Index, Queue: 0, Bind: xsk.BindCopy, RxSize: 256, TxSize: 256, FillSize: 256, CompletionSize: 256})
	if err != nil {
		t.Fatal(err)
	}
	if s.ZeroCopy() {
		t.Fatal("copy bind reports zero copy")
	}
	if err := prog.XSKMap().Put(uint32(0), uint32(s.FD())); err != nil {
		t.Fatal(err)
	}
	fill(t, u, s, 256)

	local := netip.AddrPortFrom(v.A.Addr4.Addr(), port)
	want := payloads(600, "rx") // more than the fill ring: frames must cycle
	for i := 0; i < len(want); i += 100 {
		sendUDP(t, out, local, want[i:i+100])
		got := receive(t, u, s, 100)
		for j := range got {
			if !bytes.Equal(got[j], want[i+j]) {
				t.Fatalf("datagram %d arrived as %q", i+j, got[j])
			}
		}
	}

	// TX: frames built here leave through the TX ring to a kernel socket
	// outside.
	var outConn *net.UDPConn
	if err := out.Do(func() (err error) {
		outConn, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(v.B.Addr4.Addr(), port+1)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer outConn.Close()
	txWant := payloads(200, "tx")
	frames := make([]uint64, len(txWant))
	if n := u.Alloc(frames); n != len(frames) {
		t.Fatalf("allocated %d TX frames", n)
	}
	descs := make([]xsk.Desc, len(frames))
	for i, p := range txWant {
		f := ippkt.Ether(v.B.MAC, v.A.MAC, ippkt.UDP(local, netip.AddrPortFrom(v.B.Addr4.Addr(), port+1), p))
		copy(u.Frame(frames[i]), f)
		descs[i] = xsk.Desc{Addr: frames[i], Len: uint32(len(f))}
	}
	sent, done := 0, 0
	reaped := make([]uint64, xsk.MaxBatch)
	deadline := time.Now().Add(5 * time.Second)
	for done < len(frames) && time.Now().Before(deadline) {
		if sent < len(descs) {
			sent += s.TX.Send(descs[sent:min(sent+xsk.MaxBatch, len(descs))])
		}
		if err := s.Kick(); err != nil {
			t.Fatal(err)
		}
		n := s.Completion.Reap(reaped)
		if err := u.Free(reaped[:n]); err != nil {
			t.Fatal(err)
		}
		done += n
	}
	if done != len(frames) {
		t.Fatalf("%d of %d TX frames completed", done, len(frames))
	}
	buf := make([]byte, 2048)
	for i := range txWant {
		outConn.SetReadDeadline(time.Now().Add(2 * time.Second))
		n, err := outConn.Read(buf)
		if err != nil {
			t.Fatalf("outside socket got %d of %d datagrams: %v", i, len(txWant), err)
		}
		if !bytes.Equal(buf[:n], txWant[i]) {
			t.Fatalf("datagram %d arrived as %q", i, buf[:n])
		}
	}

	a := u.Account()
	if err := a.Err(); err != nil {
		t.Fatal(err)
	}
	if a.Fill != 256 || a.Free != 256 {
		t.Fatalf("accounting %+v, want 256 in the fill ring and 256 free", a)
	}
	st, err := s.Statistics()
	if err != nil {
		t.Fatal(err)
	}
	if st.RxDropped+st.RxRingFull+st.RxInvalidDescs+st.TxInvalidDescs != 0 {
		t.Fatalf("kernel counted losses: %+v", st)
	}
}

// TestSharedUmem: a second socket on the same queue shares the queue's fill
// and completion rings and receives through them; a socket on another queue
// gets its own pair.
func TestSharedUmem(t *testing.T) {
	prog, br, out, v := setup(t, 2)
	u := newUmem(t, 256)
	cfg := xsk.SocketConfig{Ifindex: v.A.Index, Queue: 0, Bind: xsk.BindCopy, RxSize: 64, TxSize: 64, FillSize: 64, CompletionSize: 64}
	first, err := open(t, br, u, cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.TxSize = -1
	second, err := open(t, br, u, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if second.Fill != first.Fill || second.Completion != first.Completion || second.TX != nil {
		t.Fatal("a second socket on the queue does not share its rings")
	}
	cfg.Queue = 1
	other, err := open(t, br, u, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if other.Fill == first.Fill {
		t.Fatal("a socket on another queue shares queue 0's fill ring")
	}
	// The second socket, not the first, is in the map for queue 0: frames
	// of the shared fill ring land in its RX ring. Which queue the outside
	// flow hashes to is the kernel's choice, so queue 1 is served too.
	if err := prog.XSKMap().Put(uint32(0), uint32(second.FD())); err != nil {
		t.Fatal(err)
	}
	if err := prog.XSKMap().Put(uint32(1), uint32(other.FD())); err != nil {
		t.Fatal(err)
	}
	fill(t, u, first, 64)
	fill(t, u, other, 64)
	want := payloads(150, "shared")
	local := netip.AddrPortFrom(v.A.Addr4.Addr(), port)
	for i := 0; i < len(want); i += 50 {
		sendUDP(t, out, local, want[i:i+50])
		got := receiveAny(t, u, []*xsk.Socket{second, other}, 50)
		for j := range got {
			if !bytes.Equal(got[j], want[i+j]) {
				t.Fatalf("datagram %d arrived as %q", i+j, got[j])
			}
		}
	}
	if a := u.Account(); a.Err() != nil || a.Fill != 128 || a.Free != 128 {
		t.Fatalf("accounting %+v: %v", a, a.Err())
	}
	if first.RX.Receive(make([]xsk.Desc, 1)) != 0 {
		t.Fatal("the first socket received although it is not in the map")
	}
}

// TestZeroCopyRefusedOnVeth: veth has no zero-copy support, so insisting on
// it fails with an error instead of silently copying.
func TestZeroCopyRefusedOnVeth(t *testing.T) {
	_, br, _, v := setup(t, 1)
	u := newUmem(t, 64)
	_, err := open(t, br, u, xsk.SocketConfig{Ifindex: v.A.Index, Queue: 0, Bind: xsk.BindZeroCopy, RxSize: 32, TxSize: 32, FillSize: 32, CompletionSize: 32})
	if err == nil {
		t.Fatal("zero-copy bind on veth succeeded")
	}
	t.Logf("refused as expected: %v", err)
	u2 := newUmem(t, 64)
	s, err := open(t, br, u2, xsk.SocketConfig{Ifindex: v.A.Index, Queue: 0, Bind: xsk.BindAny, RxSize: 32, TxSize: 32, FillSize: 32, CompletionSize: 32})
	if err != nil {
		t.Fatalf("bind with the kernel's choice on a fresh UMEM: %v", err)
	}
	if s.ZeroCopy() {
		t.Fatal("veth granted zero copy")
	}
}
