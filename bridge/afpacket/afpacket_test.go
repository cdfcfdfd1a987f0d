package afpacket_test

import (
	"bytes"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge/afpacket"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func tagged(frame []byte, tpid, vid uint16) []byte {
	out := append([]byte(nil), frame[:12]...)
	out = append(out, byte(tpid>>8), byte(tpid), byte(vid>>8), byte(vid))
	return append(out, frame[12:]...)
}

func newRx(t *testing.T, ns *topology.NS, cfg afpacket.RxConfig) *afpacket.Rx {
	t.Helper()
	var rx *afpacket.Rx
	if err := ns.Do(func() (err error) { rx, err = afpacket.NewRx(cfg); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rx.Close() })
	return rx
}

// pollUntil polls rx until n frames of ours (carrying marker) arrived or
// wait passed; it copies them.
func pollUntil(rx *afpacket.Rx, marker []byte, n int, wait time.Duration) (frames [][]byte, rebuilt []bool, stamps []int64) {
	for deadline := time.Now().Add(wait); len(frames) < n && time.Now().Before(deadline); {
		if rx.Poll(func(f []byte, r bool, ns int64) {
			if bytes.Contains(f, marker) {
				frames = append(frames, append([]byte(nil), f...))
				rebuilt = append(rebuilt, r)
				stamps = append(stamps, ns)
			}
		}) == 0 {
			rx.Wait(-1)
		}
	}
	return frames, rebuilt, stamps
}

// TestRxFramesAsOnTheWire: the RX ring hands over every frame as it was
// sent, the VLAN tag the kernel took off put back (802.1Q and 802.1ad),
// in order, and says which frames it rebuilt.
func TestRxFramesAsOnTheWire(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := topology.Pair(t, topology.VethOptions{})
	rx := newRx(t, a, afpacket.RxConfig{Ifindex: v.A.Index})
	inj := b.PacketSocket(t, v.B.Index)
	src, dst := netip.MustParseAddrPort("198.18.0.2:4000"), netip.MustParseAddrPort("198.18.0.1:5000")
	eth := func(s string) []byte { return ippkt.Ether(v.A.MAC, v.B.MAC, ippkt.UDP(src, dst, []byte("afp-"+s))) }
	want := [][]byte{
		eth("plain"),
		tagged(eth("dot1q"), 0x8100, 10),
		tagged(eth("dot1ad"), 0x88a8, 20),
		tagged(tagged(eth("qinq"), 0x8100, 30), 0x88a8, 40),
		eth("last"),
	}
	before := time.Now().UnixNano()
	for _, f := range want {
		if _, err := unix.Write(inj, f); err != nil {
			t.Fatal(err)
		}
	}
	got, rebuilt, stamps := pollUntil(rx, []byte("afp-"), len(want), 3*time.Second)
	after := time.Now().UnixNano()
	for i, ns := range stamps {
		if ns < before || ns > after || i > 0 && ns < stamps[i-1] {
			t.Fatalf("frame %d stamped %d ns after the first send (received by %d): stamps %v", i, ns-before, after-before, stamps)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("got %d of %d frames", len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("frame %d arrived as\n%x\nwant\n%x", i, got[i], want[i])
		}
	}
	if !slices.Equal(rebuilt, []bool{false, true, true, true, false}) {
		t.Fatalf("rebuilt flags %v", rebuilt)
	}
}

// TestRxIgnoresOwnAndCountsDrops: frames the host sends out of the
// interface are not received; when nobody polls, the kernel drops what the
// ring cannot hold and Drops counts it (running sum), and the ring works
// again afterwards.
func TestRxIgnoresOwnAndCountsDrops(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := topology.Pair(t, topology.VethOptions{})
	page := unix.Getpagesize()
	// A long retire timeout: with 1 ms, a slow writer (the race detector,
	// a loaded machine) let both blocks retire holding only the outside's
	// ICMP error and neighbour traffic, and every flood frame was dropped.
	rx := newRx(t, a, afpacket.RxConfig{Ifindex: v.A.Index, BlockSize: page, BlockCount: 2, RetireTimeoutMs: 100})
	own := a.PacketSocket(t, v.A.Index)
	inj := b.PacketSocket(t, v.B.Index)
	src, dst := netip.MustParseAddrPort("198.18.0.2:4000"), netip.MustParseAddrPort("198.18.0.1:5000")
	ownFrame := ippkt.Ether(v.B.MAC, v.A.MAC, ippkt.UDP(dst, src, []byte("afp-own")))
	if _, err := unix.Write(own, ownFrame); err != nil {
		t.Fatal(err)
	}
	// Two one-page blocks hold a few dozen small frames; send many more.
	const n = 400
	for i := range n {
		f := ippkt.Ether(v.A.MAC, v.B.MAC, ippkt.UDP(src, dst, fmt.Appendf(nil, "afp-flood %d", i)))
		if _, err := unix.Write(inj, f); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(150 * time.Millisecond) // past the retire timeout
	var got int
	for rx.Poll(func(f []byte, _ bool, _ int64) {
		if bytes.Equal(f, ownFrame) { // (the outside's ICMP error quotes it: that one is fine)
			t.Error("received a frame the host sent")
		}
		if bytes.Contains(f, []byte("afp-flood")) {
			got++
		}
	}) > 0 {
	}
	d1 := rx.Drops()
	if d1 == 0 || got == 0 || uint64(got)+d1 < n {
		t.Fatalf("received %d, dropped %d of %d", got, d1, n)
	}
	if d2 := rx.Drops(); d2 < d1 {
		t.Fatalf("drops went from %d to %d: not a running sum", d1, d2)
	}
	unix.Write(inj, ippkt.Ether(v.A.MAC, v.B.MAC, ippkt.UDP(src, dst, []byte("afp-after"))))
	if f, _, _ := pollUntil(rx, []byte("afp-after"), 1, 3*time.Second); len(f) != 1 {
		t.Fatal("the ring took nothing after the drops")
	}
}

// TestRxHeldUntilRelease: the frames of a polled block stay intact after f
// returns and while the kernel has more to write, until Release; then the
// kernel writes into the block again. The bridge copies a batch of frames
// into a stream after Poll returns; when Poll gave the block back itself,
// a full ring let the kernel overwrite that batch first.
func TestRxHeldUntilRelease(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := topology.Pair(t, topology.VethOptions{})
	page := unix.Getpagesize()
	rx := newRx(t, a, afpacket.RxConfig{Ifindex: v.A.Index, BlockSize: page, BlockCount: 2, RetireTimeoutMs: 1})
	inj := b.PacketSocket(t, v.B.Index)
	src, dst := netip.MustParseAddrPort("198.18.0.2:4000"), netip.MustParseAddrPort("198.18.0.1:5000")
	send := func(payload []byte) {
		t.Helper()
		if _, err := unix.Write(inj, ippkt.Ether(v.A.MAC, v.B.MAC, ippkt.UDP(src, dst, payload))); err != nil {
			t.Fatal(err)
		}
	}
	marker := []byte("afp-held")
	send(marker)
	// Poll until the block holding it is ours; keep the frame in place.
	var held, kept []byte
	for deadline := time.Now().Add(3 * time.Second); held == nil; {
		if time.Now().After(deadline) {
			t.Fatal("the frame never arrived")
		}
		if rx.Poll(func(f []byte, _ bool, _ int64) {
			if bytes.Contains(f, marker) {
				held, kept = f, append([]byte(nil), f...)
			}
		}) == 0 {
			rx.Wait(-1)
		}
	}
	// Fill the other block and more, with frames of another size: the
	// kernel fills it, then waits for ours.
	for i := range 300 {
		send(fmt.Appendf(nil, "afp-flood %d, longer than the held one", i))
	}
	time.Sleep(20 * time.Millisecond)
	if !bytes.Equal(held, kept) {
		t.Fatalf("the held frame changed before Release:\n%x\nwas\n%x", held, kept)
	}
	rx.Release()
	send([]byte("afp-after"))
	if f, _, _ := pollUntil(rx, []byte("afp-after"), 1, 3*time.Second); len(f) != 1 {
		t.Fatal("the ring took nothing after Release")
	}
}

// TestRxWaitWakes: Wait returns when the wake descriptor is signalled and
// consumes the signal.
func TestRxWaitWakes(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, _, v := topology.Pair(t, topology.VethOptions{})
	rx := newRx(t, a, afpacket.RxConfig{Ifindex: v.A.Index})
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	for range 10 {
		for rx.Poll(func([]byte, bool, int64) {}) > 0 { // whatever the kernel sent
		}
		done := make(chan struct{})
		go func() { rx.Wait(efd); close(done) }()
		unix.Write(efd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			t.Fatal("Wait did not wake")
		}
		var b [8]byte
		if _, err := unix.Read(efd, b[:]); err != nil { // the owner drains it, not Wait
			t.Fatalf("the wake signal was consumed by Wait: %v", err)
		}
	}
}

// TestTxSendsInRingOrder: frames queued in the TX ring leave in order, byte
// for byte, with one Flush per batch; slots come back free after the kernel
// sent them, so the ring wraps.
func TestTxSendsInRingOrder(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := topology.Pair(t, topology.VethOptions{})
	var tx *afpacket.Tx
	if err := a.Do(func() (err error) {
		tx, err = afpacket.NewTx(afpacket.TxConfig{Ifindex: v.A.Index, FrameCount: 16})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer tx.Close()
	capt := b.PacketSocket(t, v.B.Index)
	src, dst := netip.MustParseAddrPort("198.18.0.1:5000"), netip.MustParseAddrPort("198.18.0.2:4000")
	var want [][]byte
	for round := range 5 { // 5 × 10 frames through 16 slots
		free := 0
		for deadline := time.Now().Add(time.Second); free < 10 && time.Now().Before(deadline); {
			free = tx.Free(10)
		}
		if free < 10 {
			t.Fatalf("round %d: only %d slots free", round, free)
		}
		for i := range 10 {
			f := ippkt.Ether(v.B.MAC, v.A.MAC, ippkt.UDP(src, dst, fmt.Appendf(nil, "afp-tx %d.%d", round, i)))
			copy(tx.Buf(0), f)
			tx.Queue(len(f))
			want = append(want, f)
		}
		if err := tx.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 4096)
	var got [][]byte
	for deadline := time.Now().Add(3 * time.Second); len(got) < len(want) && time.Now().Before(deadline); {
		n, from, err := unix.Recvfrom(capt, buf, 0)
		if err != nil {
			continue
		}
		// Skip the outside kernel's own frames (ICMP errors quoting ours).
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		if bytes.Contains(buf[:n], []byte("afp-tx")) {
			got = append(got, append([]byte(nil), buf[:n]...))
		}
	}
	if len(got) != len(want) {
		t.Fatalf("outside got %d of %d frames", len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("frame %d arrived as %q, want %q", i, got[i], want[i])
		}
	}
	if tx.MaxFrame() != 2048-48 {
		t.Fatalf("MaxFrame %d", tx.MaxFrame())
	}
}

// TestDisableMerging: GRO turned on on an interface is turned off, reported,
// and turned on again by Restore; a feature already off stays untouched.
func TestDisableMerging(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, _, v := topology.Pair(t, topology.VethOptions{})
	if err := a.Do(func() error {
		setup, err := afpacket.DisableMerging(v.A.Name)
		if err != nil {
			return err
		}
		if err := setup.SetFeature("rx-gro", true); err != nil {
			return err
		}
		setup.Restore() // nothing was turned off: GRO stays on
		o, err := afpacket.DisableMerging(v.A.Name)
		if err != nil {
			return err
		}
		if ch := o.Changed(); !slices.Equal(ch, []string{"rx-gro"}) {
			return fmt.Errorf("changed %v, want [rx-gro]", ch)
		}
		for _, name := range afpacket.MergingOffloads {
			if on, err := o.Active(name); err == nil && on {
				return fmt.Errorf("%s still on", name)
			}
		}
		if err := o.Restore(); err != nil {
			return err
		}
		check, err := afpacket.DisableMerging(v.A.Name)
		if err != nil {
			return err
		}
		defer check.Restore()
		if ch := check.Changed(); !slices.Equal(ch, []string{"rx-gro"}) {
			return fmt.Errorf("after Restore: %v turned off again, want [rx-gro]", ch)
		}
		if _, err := afpacket.DisableMerging("fbnosuchif0"); err == nil {
			return fmt.Errorf("no error for a missing interface")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
