package fabric

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/netns"
	"github.com/fabricbridge/fabricbridge/internal/testenv"
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
	if err != nil || !m.control || !m.hasCredit || m.credit != 0xdeadbeef || m.vni != 42 {
		t.Fatalf("credit: %+v %v", m, err)
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

// Two namespaces joined by a veth: a stream in each direction over GENEVE,
// with credits small enough that flow control must work, then packets
// with a wrong VNI, from a wrong source port and malformed, each refused
// and counted exactly.
func TestRemoteGeneveBetweenNamespaces(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := netns.Pair(t, netns.VethOptions{})
	for _, fam := range []string{"ipv4", "ipv6"} {
		t.Run(fam, func(t *testing.T) {
			v6 := fam == "ipv6"
			addrA, addrB := v.A.Addr4.Addr(), v.B.Addr4.Addr()
			if v6 {
				addrA, addrB = v.A.Addr6.Addr(), v.B.Addr6.Addr()
			}
			cfg := RemoteConfig{Depth: 128, High: 96, Low: 32}
			var ra, rb *Remote
			if err := a.Do(func() (err error) {
				ra, err = ListenRemote(netip.AddrPortFrom(addrA, GenevePort), cfg)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer ra.Close()
			if err := b.Do(func() (err error) {
				rb, err = ListenRemote(netip.AddrPortFrom(addrB, GenevePort), cfg)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer rb.Close()
			sa, err := ra.Register(7, rb.LocalAddr())
			if err != nil {
				t.Fatal(err)
			}
			sb, err := rb.Register(7, ra.LocalAddr())
			if err != nil {
				t.Fatal(err)
			}

			// B → A: many packets through a 128-deep queue.
			const total = 20000
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				in := mkBufs(64, 300)
				pk := make([][]byte, 64)
				for seq := 0; seq < total; seq += 64 {
					k := min(64, total-seq)
					for i := 0; i < k; i++ {
						pk[i] = ipPkt(in[i], v6, uint32(seq+i), 40+(seq+i)%250)
					}
					if n, err := sb.Send(pk[:k]); n != k || err != nil {
						t.Errorf("send: %d of %d: %v", n, k, err)
						return
					}
				}
			}()
			out := mkBufs(64, 2048)
			for got := 0; got < total; {
				n, err := sa.RecvTimeout(out, 5*time.Second)
				if err != nil {
					t.Fatalf("after %d packets: %v (counters %+v)", got, err, ra.Counters())
				}
				for i := 0; i < n; i++ {
					want := ipPkt(make([]byte, 300), v6, uint32(got), 40+got%250)
					if string(out[i]) != string(want) {
						t.Fatalf("packet %d differs", got)
					}
					got++
				}
			}
			wg.Wait()
			if c := ra.Counters(); c.Received != total || c.Overflow != 0 || c.WrongVNI+c.WrongSource+c.Malformed != 0 {
				t.Fatalf("receiver counters %+v", c)
			}
			if c := rb.Counters(); c.Credits == 0 || c.BadCredits != 0 {
				t.Fatalf("sender saw no valid credits: %+v", c)
			}
			if sb.Stalls() == 0 {
				t.Log("sender never had to wait for credit")
			}

			// A → B: the reverse direction works too.
			if _, err := sa.Send([][]byte{ipPkt(make([]byte, 64), v6, 99, 64)}); err != nil {
				t.Fatal(err)
			}
			if n, err := sb.RecvTimeout(out, 5*time.Second); n != 1 || err != nil || binary.BigEndian.Uint32(out[0][4:]) != 99 {
				t.Fatalf("reverse: n=%d err=%v", n, err)
			}

			// Refusals, each exactly counted.
			wrongVNI, err := rb.Register(9, ra.LocalAddr()) // A has no stream 9
			if err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 3; i++ {
				wrongVNI.Send([][]byte{ipPkt(make([]byte, 64), v6, 0, 64)})
			}
			if err := b.Do(func() error {
				return sendRawGeneve(addrB, ra.LocalAddr(), v6)
			}); err != nil {
				t.Fatal(err)
			}
			want := RemoteCounters{Received: total, WrongVNI: 3, WrongSource: 5, Malformed: 2}
			deadline := time.Now().Add(5 * time.Second)
			for {
				c := ra.Counters()
				c.Credits, c.BadCredits = 0, 0
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

// sendRawGeneve sends, from an unregistered port of src, five well-formed
// GENEVE packets of stream 7 (wrong source) and two malformed datagrams
// from that same port.
func sendRawGeneve(src netip.Addr, dst netip.AddrPort, v6 bool) error {
	fam := unix.AF_INET
	if v6 {
		fam = unix.AF_INET6
	}
	fd, err := unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, sockaddrOf(netip.AddrPortFrom(src, 0))); err != nil {
		return err
	}
	pkt := make([]byte, 8+40)
	proto := uint16(protoIPv4)
	if v6 {
		proto = protoIPv6
	}
	putGeneve(pkt, 7, proto, 0, false)
	ipPkt(pkt[8:], v6, 1, 40)
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
// per batch (loopback inside a fresh namespace).
func TestRemoteZeroAlloc(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns := netns.New(t)
	var r *Remote
	if err := ns.Do(func() error {
		lo, err := ns.Handle().LinkByName("lo")
		if err != nil {
			return err
		}
		if err := ns.Handle().LinkSetUp(lo); err != nil {
			return err
		}
		r, err = ListenRemote(netip.MustParseAddrPort("127.0.0.1:0"), RemoteConfig{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	s, err := r.Register(5, r.LocalAddr()) // talk to ourselves
	if err != nil {
		t.Fatal(err)
	}
	pk := make([][]byte, 16)
	for i := range pk {
		pk[i] = ipPkt(make([]byte, 64), false, uint32(i), 64)
	}
	out := mkBufs(64, 2048)
	allocs := testing.AllocsPerRun(50, func() {
		if n, err := s.Send(pk); n != 16 || err != nil {
			t.Fatal(n, err)
		}
		for got := 0; got < 16; {
			n, err := s.RecvTimeout(out, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			got += n
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per batch", allocs)
	}
	if c := r.Counters(); c.Received != 51*16 {
		t.Fatalf("received %d, want %d", c.Received, 51*16)
	}
}
