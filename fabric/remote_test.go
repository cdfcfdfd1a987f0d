package fabric

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"golang.org/x/sys/unix"
)

func TestGeneveParse(t *testing.T) {
	b := make([]byte, 8+20)
	putGeneve(b, 0xabcdef, protoIPv4, 0, false)
	b[8] = 0x45
	m, err := parseGeneve(b)
	if err != nil || m.vni != 0xabcdef || m.proto != protoIPv4 || m.control || len(m.payload) != 20 {
		t.Fatalf("round trip: %+v %v", m, err)
	}
	var c [creditMsgLen]byte
	putCredit(c[:], 42, 0xdeadbeef)
	m, err = parseGeneve(c[:])
	if err != nil || !m.control || !m.hasCredit || m.credit != 0xdeadbeef || m.vni != 42 || m.proto != 0x88B5 || m.goodbye {
		t.Fatalf("credit: %+v %v", m, err)
	}
	var bye [closeMsgLen]byte
	putGoodbye(bye[:], 43)
	m, err = parseGeneve(bye[:])
	if err != nil || !m.control || !m.goodbye || m.hasCredit || m.vni != 43 {
		t.Fatalf("goodbye: %+v %v", m, err)
	}
	bad := map[string][]byte{
		"short":            b[:7],
		"version 1":        append([]byte{0x40}, b[1:]...),
		"options past end": append([]byte{0x3f}, b[1:]...),
		"v6 type, v4 body": func() []byte { x := append([]byte(nil), b...); x[2], x[3] = 0x86, 0xdd; return x }(),
		"empty data":       b[:8],
		"not ip":           func() []byte { x := append([]byte(nil), b...); x[8] = 0x15; return x }(),
		"unknown critical": func() []byte {
			x := make([]byte, 8+4+20)
			putGeneve(x, 1, protoIPv4, 1, false)
			x[1] |= flagCritical
			x[8], x[9], x[10] = 0x01, 0x02, 0x80 // class 0x0102, critical type 0x80, length 0
			x[12] = 0x45
			return x
		}(),
		"option length past end": func() []byte {
			x := append([]byte(nil), c[:]...)
			x[11] = 5
			return x
		}(),
		"control, protocol 0": func() []byte {
			x := append([]byte(nil), c[:]...)
			x[2], x[3] = 0, 0
			return x
		}(),
		"control, protocol IPv4": func() []byte {
			x := append([]byte(nil), c[:]...)
			x[2], x[3] = 0x08, 0x00
			return x
		}(),
	}
	for name, pkt := range bad {
		if _, err := parseGeneve(pkt); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// Hysteresis: stop at high, resume only at or below low; credits outside
// [last, sent] are refused.
func TestCreditGate(t *testing.T) {
	g := creditGate{high: 8, low: 2}
	if a := g.allowance(); a != 8 {
		t.Fatalf("fresh allowance %d", a)
	}
	g.sent = 8
	if a := g.allowance(); a != 0 || !g.stopped {
		t.Fatalf("at high: %d stopped=%v", a, g.stopped)
	}
	if !g.update(3, 8) || g.allowance() != 0 {
		t.Fatal("resumed above low water")
	}
	if g.update(9, 8) {
		t.Fatal("credit beyond sent accepted")
	}
	if !g.update(6, 8) {
		t.Fatal("valid credit refused")
	}
	if g.update(5, 8) {
		t.Fatal("credit moving backwards accepted")
	}
	if a := g.allowance(); a != 6 || g.stopped {
		t.Fatalf("at low water: allowance %d stopped=%v, want 6", a, g.stopped)
	}
}

func ipPkt(buf []byte, v6 bool, seq uint32, size int) []byte {
	buf = buf[:size]
	buf[0] = 0x45
	if v6 {
		buf[0] = 0x60
	}
	binary.BigEndian.PutUint32(buf[4:], seq)
	return buf
}

// runSize gives packets in runs of six of one length, the next run's
// length drawn pseudo-randomly, so that Send sees runs to segment (GSO)
// and, about half the time, a shorter packet that ends a run.
func runSize(seq int) int { return 40 + ((seq/6)*37)%260 }

// remotes is two Remote endpoints in two namespaces joined by a veth.
type remotes struct {
	a, b   *topology.NS
	ra, rb *Remote
	addrA  netip.Addr // A's address, of the family under test
	addrB  netip.Addr
	v6     bool
	veth   *topology.Veth
}

func newRemotes(t testing.TB, v6 bool, cfgA, cfgB RemoteConfig) *remotes {
	t.Helper()
	a, b, v := topology.Pair(t, topology.VethOptions{})
	x := &remotes{a: a, b: b, v6: v6, veth: v, addrA: v.A.Addr4.Addr(), addrB: v.B.Addr4.Addr()}
	if v6 {
		x.addrA, x.addrB = v.A.Addr6.Addr(), v.B.Addr6.Addr()
	}
	if err := a.Do(func() (err error) {
		x.ra, err = ListenRemote(netip.AddrPortFrom(x.addrA, GenevePort), cfgA)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.ra.Close() })
	if err := b.Do(func() (err error) {
		x.rb, err = ListenRemote(netip.AddrPortFrom(x.addrB, GenevePort), cfgB)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.rb.Close() })
	return x
}

// pair registers stream vni on both endpoints, each pointing at the other.
func (x *remotes) pair(t testing.TB, vni uint32) (sa, sb *RemoteStream) {
	t.Helper()
	sa, err := x.ra.Register(vni, x.rb.LocalAddr())
	if err != nil {
		t.Fatal(err)
	}
	sb, err = x.rb.Register(vni, x.ra.LocalAddr())
	if err != nil {
		t.Fatal(err)
	}
	return sa, sb
}

// sendSeq sends packets [from, to) of the runSize pattern (or of a fixed
// size if size > 0) in batches of 64.
func sendSeq(s *RemoteStream, v6 bool, from, to, size int) error {
	in := mkBufs(64, 1500)
	pk := make([][]byte, 64)
	for seq := from; seq < to; seq += 64 {
		k := min(64, to-seq)
		for i := 0; i < k; i++ {
			l := size
			if l == 0 {
				l = runSize(seq + i)
			}
			pk[i] = ipPkt(in[i], v6, uint32(seq+i), l)
		}
		if n, err := s.Send(pk[:k]); n != k || err != nil {
			return fmt.Errorf("send at %d: %d of %d: %v", seq, n, k, err)
		}
	}
	return nil
}

// recvSeq receives packets [from, to) and checks each byte.
func recvSeq(t *testing.T, s *RemoteStream, r *Remote, v6 bool, from, to, size int) {
	t.Helper()
	out := mkBufs(64, 2048)
	want := make([]byte, 1500)
	for got := from; got < to; {
		n, err := s.RecvTimeout(out, 5*time.Second)
		if err != nil {
			t.Fatalf("after %d packets: %v (counters %+v)", got-from, err, r.Counters())
		}
		for i := 0; i < n; i++ {
			l := size
			if l == 0 {
				l = runSize(got)
			}
			if string(out[i]) != string(ipPkt(want, v6, uint32(got), l)) {
				t.Fatalf("packet %d differs (len %d, want %d)", got, len(out[i]), l)
			}
			got++
		}
	}
}

// Two namespaces joined by a veth: a stream in each direction over GENEVE,
// with credits small enough that flow control must work, with and without
// UDP GSO on the sender and GRO on the receiver (every combination: the
// offload paths and the fallbacks must carry the same packets); then
// packets with a wrong VNI, from a wrong source port and malformed, each
// refused and counted exactly.
func TestRemoteGeneveBetweenNamespaces(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, fam := range []string{"ipv4", "ipv6"} {
		for _, off := range []struct {
			name     string
			gso, gro bool
		}{{"gso+gro", true, true}, {"plain", false, false}, {"gso", true, false}, {"gro", false, true}} {
			t.Run(fam+"/"+off.name, func(t *testing.T) {
				v6 := fam == "ipv6"
				cfg := RemoteConfig{Depth: 128, High: 96, Low: 32}
				cfgA, cfgB := cfg, cfg
				cfgA.NoGRO, cfgB.NoGSO = !off.gro, !off.gso
				x := newRemotes(t, v6, cfgA, cfgB)
				gso, _ := x.rb.Offload()
				_, gro := x.ra.Offload()
				if gso != off.gso || gro != off.gro {
					t.Fatalf("offload gso=%v gro=%v, configured %v %v (does this kernel lack UDP GSO/GRO?)", gso, gro, off.gso, off.gro)
				}
				sa, sb := x.pair(t, 7)

				// B → A: many packets through a 128-deep queue.
				const total = 20000
				errc := make(chan error, 1)
				go func() { errc <- sendSeq(sb, v6, 0, total, 0) }()
				recvSeq(t, sa, x.ra, v6, 0, total, 0)
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				// The loop counts a packet just after queueing it.
				waitCounters(t, x.ra, func(c RemoteCounters) bool { return c.Received == total })
				ca, cb := x.ra.Counters(), x.rb.Counters()
				if ca.Received != total || ca.Overflow != 0 || ca.WrongVNI+ca.WrongSource+ca.Malformed+ca.Dead != 0 {
					t.Fatalf("receiver counters %+v", ca)
				}
				if cb.Credits == 0 || cb.BadCredits != 0 {
					t.Fatalf("sender saw no valid credits: %+v", cb)
				}
				if gso != (cb.SentSegmented > 0) {
					t.Fatalf("gso=%v but %d super-datagrams sent", gso, cb.SentSegmented)
				}
				if !gro && ca.ReceivedCoalesced != 0 {
					t.Fatalf("GRO off but %d coalesced datagrams", ca.ReceivedCoalesced)
				}
				if gso && gro && ca.ReceivedCoalesced == 0 {
					t.Fatal("GSO sender and GRO receiver, but nothing arrived coalesced")
				}
				t.Logf("sent %d GSO super-datagrams, received %d GRO ones, %d credit stalls", cb.SentSegmented, ca.ReceivedCoalesced, sb.Stalls())

				// Packets too big for one datagram on the 1500-byte path:
				// GSO must fall back to single (fragmented) datagrams.
				go func() { errc <- sendSeq(sb, v6, total, total+300, 1480) }()
				recvSeq(t, sa, x.ra, v6, total, total+300, 1480)
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				if gso && sb.gsoLimit >= geneveHdrLen+1480 {
					t.Fatalf("GSO limit %d after oversize segments", sb.gsoLimit)
				}

				// A → B: the reverse direction works too.
				out := mkBufs(4, 2048)
				if _, err := sa.Send([][]byte{ipPkt(make([]byte, 64), v6, 99, 64)}); err != nil {
					t.Fatal(err)
				}
				if n, err := sb.RecvTimeout(out, 5*time.Second); n != 1 || err != nil || binary.BigEndian.Uint32(out[0][4:]) != 99 {
					t.Fatalf("reverse: n=%d err=%v", n, err)
				}

				// Refusals, each exactly counted.
				if err := x.b.Do(func() error {
					return sendRawGeneve(x.addrB, x.ra.LocalAddr(), v6)
				}); err != nil {
					t.Fatal(err)
				}
				want := RemoteCounters{Received: total + 300, WrongVNI: 3, WrongSource: 5, Malformed: 2}
				deadline := time.Now().Add(5 * time.Second)
				for {
					c := x.ra.Counters()
					c.Credits, c.BadCredits, c.ReceivedCoalesced, c.SentSegmented = 0, 0, 0, 0
					if c == want {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("counters %+v, want %+v", c, want)
					}
					time.Sleep(5 * time.Millisecond)
				}
				if n, _ := sa.RecvTimeout(out, 20*time.Millisecond); n != 0 {
					t.Fatalf("%d refused packets reached the stream", n)
				}
			})
		}
	}
}

// waitCounters waits up to 5 s for the endpoint's counters to satisfy ok.
func waitCounters(t *testing.T, r *Remote, ok func(RemoteCounters) bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !ok(r.Counters()); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("counters %+v", r.Counters())
		}
	}
}

// rawSocket is a plain UDP socket bound to src (port 0: any), made in the
// calling thread's namespace.
func rawSocket(src netip.Addr, v6 bool) (int, error) {
	fam := unix.AF_INET
	if v6 {
		fam = unix.AF_INET6
	}
	fd, err := unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Bind(fd, sockaddrOf(netip.AddrPortFrom(src, 0))); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func dataPkt(vni uint32, v6 bool, seq uint32) []byte {
	pkt := make([]byte, 8+40)
	proto := uint16(protoIPv4)
	if v6 {
		proto = protoIPv6
	}
	putGeneve(pkt, vni, proto, 0, false)
	ipPkt(pkt[8:], v6, seq, 40)
	return pkt
}

// sendRawGeneve sends, from an unregistered port of src, three packets of
// stream 9 (no such stream), five well-formed GENEVE packets of stream 7
// (wrong source) and two malformed datagrams.
func sendRawGeneve(src netip.Addr, dst netip.AddrPort, v6 bool) error {
	fd, err := rawSocket(src, v6)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for i := 0; i < 3; i++ {
		if err := unix.Sendto(fd, dataPkt(9, v6, 0), 0, sockaddrOf(dst)); err != nil {
			return err
		}
	}
	pkt := dataPkt(7, v6, 1)
	for i := 0; i < 5; i++ {
		if err := unix.Sendto(fd, pkt, 0, sockaddrOf(dst)); err != nil {
			return err
		}
	}
	for _, junk := range [][]byte{{1, 2, 3}, append([]byte{0xc0}, pkt[1:]...)} {
		if err := unix.Sendto(fd, junk, 0, sockaddrOf(dst)); err != nil {
			return fmt.Errorf("junk: %w", err)
		}
	}
	return nil
}

// The send and receive paths of the remote transport allocate nothing
// per batch, with and without offloads.
func TestRemoteZeroAlloc(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, plain := range []bool{false, true} {
		t.Run(fmt.Sprintf("plain=%v", plain), func(t *testing.T) {
			x := newRemotes(t, false, RemoteConfig{NoGSO: plain, NoGRO: plain}, RemoteConfig{NoGSO: plain, NoGRO: plain})
			sa, sb := x.pair(t, 5)
			pk := make([][]byte, 16)
			for i := range pk {
				pk[i] = ipPkt(make([]byte, 64), false, uint32(i), 64)
			}
			out := mkBufs(64, 2048)
			allocs := testing.AllocsPerRun(50, func() {
				if n, err := sb.Send(pk); n != 16 || err != nil {
					t.Fatal(n, err)
				}
				for got := 0; got < 16; {
					n, err := sa.RecvTimeout(out, 5*time.Second)
					if err != nil {
						t.Fatal(err)
					}
					got += n
				}
			})
			if allocs != 0 {
				t.Fatalf("%v allocations per batch", allocs)
			}
			waitCounters(t, x.ra, func(c RemoteCounters) bool { return c.Received == 51*16 })
		})
	}
}

// A peer that closes its stream says goodbye: the other end delivers what
// was queued, then reports ErrPeerGone and is Broken; its Send fails.
func TestRemoteGoodbye(t *testing.T) {
	testenv.RequirePrivileged(t)
	x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{})
	sa, sb := x.pair(t, 3)
	if err := sendSeq(sb, false, 0, 3, 64); err != nil {
		t.Fatal(err)
	}
	sb.Close()
	recvSeq(t, sa, x.ra, false, 0, 3, 64)
	if _, err := sa.RecvTimeout(mkBufs(1, 2048), 5*time.Second); !errors.Is(err, ErrPeerGone) || !errors.Is(err, ErrBroken) {
		t.Fatalf("after goodbye: %v, want broken, peer gone", err)
	}
	if sa.Health() != Broken {
		t.Fatalf("health %v", sa.Health())
	}
	if _, err := sa.Send([][]byte{ipPkt(make([]byte, 64), false, 0, 64)}); !errors.Is(err, ErrPeerGone) {
		t.Fatalf("send to a gone peer: %v", err)
	}
	if _, err := sb.Send([][]byte{ipPkt(make([]byte, 64), false, 0, 64)}); !errors.Is(err, ErrClosed) {
		t.Fatalf("send on a closed stream: %v", err)
	}
	if _, err := sb.TryRecv(mkBufs(1, 2048)); !errors.Is(err, ErrClosed) {
		t.Fatalf("recv on a closed stream: %v", err)
	}
	// The VNI is free again on B.
	if _, err := x.rb.Register(3, x.ra.LocalAddr()); err != nil {
		t.Fatal(err)
	}
}

// A peer that falls silent (its socket open, so no ICMP) breaks the
// stream after PeerTimeout, not before; a live idle peer never does,
// because both ends send keepalives.
func TestRemotePeerTimeout(t *testing.T) {
	testenv.RequirePrivileged(t)
	cfg := RemoteConfig{PeerTimeout: 300 * time.Millisecond, CreditInterval: 5 * time.Millisecond}
	x := newRemotes(t, false, cfg, cfg)
	live, liveB := x.pair(t, 1) // both ends live, idle
	var silent *RemoteStream
	var fd int
	if err := x.b.Do(func() (err error) {
		fd, err = rawSocket(x.addrB, false)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	sa, _ := unix.Getsockname(fd)
	silent, err := x.ra.Register(2, addrPortOf(sa))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := unix.Sendto(fd, dataPkt(2, false, 0), 0, sockaddrOf(x.ra.LocalAddr())); err != nil {
		t.Fatal(err)
	}
	out := mkBufs(4, 2048)
	if n, err := silent.RecvTimeout(out, 5*time.Second); n != 1 || err != nil {
		t.Fatalf("first packet: %d %v", n, err)
	}
	_, err = silent.RecvTimeout(out, 2*time.Second)
	took := time.Since(start)
	if !errors.Is(err, ErrPeerGone) {
		t.Fatalf("silent peer: %v after %v, want ErrPeerGone", err, took)
	}
	if took < cfg.PeerTimeout {
		t.Fatalf("broken after %v, before the %v timeout", took, cfg.PeerTimeout)
	}
	time.Sleep(2 * cfg.PeerTimeout) // the idle live pair outlives several timeouts
	if live.Err() != nil || liveB.Err() != nil {
		t.Fatalf("idle live stream broke: %v / %v", live.Err(), liveB.Err())
	}
}

// A peer whose socket is gone (a crashed process) is detected from the
// ICMP port unreachable that the next packet to it draws, long before
// PeerTimeout. A stream that never heard from its peer ignores ICMP (the
// peer may not have started yet).
func TestRemotePortUnreachable(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) {
			cfg := RemoteConfig{PeerTimeout: 20 * time.Second}
			x := newRemotes(t, v6, cfg, cfg)
			var fd, fd2 int
			if err := x.b.Do(func() (err error) {
				if fd, err = rawSocket(x.addrB, v6); err != nil {
					return err
				}
				fd2, err = rawSocket(x.addrB, v6)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			sa, _ := unix.Getsockname(fd)
			s, err := x.ra.Register(4, addrPortOf(sa))
			if err != nil {
				t.Fatal(err)
			}
			sa2, _ := unix.Getsockname(fd2)
			neverHeard, err := x.ra.Register(5, addrPortOf(sa2))
			if err != nil {
				t.Fatal(err)
			}
			unix.Close(fd2) // never spoke, now gone
			if err := unix.Sendto(fd, dataPkt(4, v6, 0), 0, sockaddrOf(x.ra.LocalAddr())); err != nil {
				t.Fatal(err)
			}
			out := mkBufs(4, 2048)
			if n, err := s.RecvTimeout(out, 5*time.Second); n != 1 || err != nil {
				t.Fatalf("first packet: %d %v", n, err)
			}
			unix.Close(fd) // the "process" dies
			pk := [][]byte{ipPkt(make([]byte, 64), v6, 0, 64)}
			start := time.Now()
			for s.Err() == nil && time.Since(start) < 5*time.Second {
				if _, err := neverHeard.Send(pk); err != nil {
					t.Fatalf("stream that never heard its peer: %v", err)
				}
				s.Send(pk)
				time.Sleep(time.Millisecond)
			}
			if !errors.Is(s.Err(), ErrPeerGone) {
				t.Fatalf("after %v: %v, want ErrPeerGone", time.Since(start), s.Err())
			}
			t.Logf("broken %v after the peer's socket closed: %v", time.Since(start).Round(time.Microsecond), s.Err())
			if c := x.ra.Counters(); c.Unreachable == 0 {
				t.Fatalf("counters %+v", c)
			}
			if neverHeard.Err() != nil {
				t.Fatalf("ICMP broke a stream that never heard its peer: %v", neverHeard.Err())
			}
		})
	}
}

// Closing streams and endpoints releases every descriptor, and Close
// unblocks a Recv and a Send waiting for credit.
func TestRemoteCloseReleasesDescriptors(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, _, v := topology.Pair(t, topology.VethOptions{})
	before := openFDs(t)
	var r, peer *Remote
	if err := a.Do(func() (err error) {
		if r, err = ListenRemote(netip.AddrPortFrom(v.A.Addr4.Addr(), 0), RemoteConfig{Depth: 16, High: 8, Low: 2}); err != nil {
			return err
		}
		peer, err = ListenRemote(netip.AddrPortFrom(v.A.Addr4.Addr(), 0), RemoteConfig{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var ss []*RemoteStream
	for vni := uint32(1); vni <= 6; vni++ {
		s, err := r.Register(vni, peer.LocalAddr()) // peer has no such streams: no credit ever
		if err != nil {
			t.Fatal(err)
		}
		ss = append(ss, s)
	}
	ss[5].Close() // one closed on its own
	recvDone, sendDone := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := ss[0].Recv(mkBufs(1, 2048))
		recvDone <- err
	}()
	go func() {
		pk := make([][]byte, 20)
		for i := range pk {
			pk[i] = ipPkt(make([]byte, 64), false, uint32(i), 64)
		}
		_, err := ss[1].Send(pk) // 20 > High: waits for credit forever
		sendDone <- err
	}()
	time.Sleep(20 * time.Millisecond)
	if ss[1].Stalls() == 0 {
		t.Fatal("sender is not waiting for credit")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]chan error{"Recv": recvDone, "Send": sendDone} {
		select {
		case err := <-c:
			if !errors.Is(err, ErrClosed) {
				t.Fatalf("%s after Close: %v", name, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("Close did not unblock %s", name)
		}
	}
	ss[2].Close() // after the endpoint: harmless
	if err := peer.Close(); err != nil {
		t.Fatal(err)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("%d descriptors before, %d after", before, after)
	}
}
