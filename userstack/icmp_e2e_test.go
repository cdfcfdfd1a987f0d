package userstack

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// icmpCounts are the ICMP errors the application's stack has taken in.
type icmpCounts struct{ unreach4, unreach6, tooBig6 uint64 }

func icmpReceived(s *Stack) icmpCounts {
	st := s.ns.Stats().ICMP
	return icmpCounts{
		unreach4: st.V4.PacketsReceived.DstUnreachable.Value(),
		unreach6: st.V6.PacketsReceived.DstUnreachable.Value(),
		tooBig6:  st.V6.PacketsReceived.PacketTooBig.Value(),
	}
}

// TestEndToEndICMPErrors sends ICMP errors from real kernels outside
// through the real bridge (XDP steers an error to the stream of the flow
// it quotes) into a local application's stack, and checks that the
// application sees what a kernel socket would: connection refused on a
// UDP socket and on a TCP dial, no route to host for an administratively
// prohibited dial, and path MTU discovery lowering a TCP connection's
// segments so that a bulk transfer over a narrower link completes.
// Each case also checks that the stack really received the ICMP error,
// since a RST (or fragmentation) could otherwise explain the outcome.
func TestEndToEndICMPErrors(t *testing.T) { runICMPErrors(t, false) }

// TestEndToEndICMPErrorsRemote is the same with the application in its
// own namespace over the remote transport: the errors travel from the
// bridge to the application inside GENEVE, like every other packet of its
// stream. Path MTU discovery applies there too, and is tested: the narrow
// hop is on the wire side, beyond the bridge, where only the router's
// error can tell the application's TCP about it. (The GENEVE hop between
// the application and the bridge is a different matter: its MTU is the
// underlay's, which the application's stack never sees; errors about it
// go to the application host's kernel, for the UDP socket that carries
// the stream. Its size is configured, not discovered; see README.)
func TestEndToEndICMPErrorsRemote(t *testing.T) { runICMPErrors(t, true) }

func runICMPErrors(t *testing.T, remote bool) {
	e := newE2E(t)
	s := e.open(remote)
	// The subtests draw dozens of errors to the bridge host's two
	// addresses within seconds, from the stack and from the bridge host's
	// kernel: the outside kernel's per-destination ICMP rate limit (one a
	// second after a burst of six) would drop some of them.
	if err := e.out.Do(func() error {
		for _, f := range []string{"/proc/sys/net/ipv4/icmp_ratelimit", "/proc/sys/net/ipv6/icmp/ratelimit"} {
			if err := os.WriteFile(f, []byte("0"), 0); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	t.Run("UDPPortUnreachable", func(t *testing.T) {
		for _, fam := range []struct {
			net     string
			outside netip.Addr
		}{{"udp4", e.outside4}, {"udp6", e.outside6}} {
			before := icmpReceived(s)
			// Nothing listens on the outside host: its kernel answers
			// with a port unreachable.
			c, err := s.Dial(testCtx(t, 10*time.Second), fam.net, netip.AddrPortFrom(fam.outside, 9).String())
			if err != nil {
				t.Fatal(err)
			}
			errc := make(chan error, 1)
			go func() {
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				_, err := c.Read(make([]byte, 100))
				errc <- err
			}()
			time.Sleep(20 * time.Millisecond) // the read waits first, as an application's would
			start := time.Now()
			if _, err := c.Write([]byte("anyone there?")); err != nil {
				t.Fatal(err)
			}
			err = <-errc
			took := time.Since(start)
			c.Close()
			if !errors.Is(err, syscall.ECONNREFUSED) {
				t.Fatalf("%s: read after port unreachable: %v (after %v), want connection refused", fam.net, err, took)
			}
			after := icmpReceived(s)
			if after.unreach4+after.unreach6 == before.unreach4+before.unreach6 {
				t.Fatalf("%s: the stack counted no destination unreachable (%+v)", fam.net, after)
			}
			t.Logf("%s: %v after %v", fam.net, err, took)
		}
	})

	t.Run("TCPDialRejected", func(t *testing.T) {
		// The outside host filters two ports with ICMP instead of the
		// kernel's RST.
		const refused, prohibited = 9001, 9002
		rules := fmt.Sprintf(`table inet fbicmp {
	chain input {
		type filter hook input priority 0;
		tcp dport %d reject with icmpx type port-unreachable
		tcp dport %d reject with icmpx type admin-prohibited
	}
}
`, refused, prohibited)
		file := filepath.Join(t.TempDir(), "rules.nft")
		if err := os.WriteFile(file, []byte(rules), 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := e.out.Exec(testCtx(t, 10*time.Second), "nft", "-f", file); err != nil {
			t.Fatalf("nft: %v\n%s", err, out)
		}
		for _, c := range []struct {
			to   netip.Addr
			port uint16
			want syscall.Errno
		}{
			{e.outside4, refused, syscall.ECONNREFUSED},
			{e.outside4, prohibited, syscall.EHOSTUNREACH}, // as Linux reports it
			{e.outside6, refused, syscall.ECONNREFUSED},
			// IPv6's other codes: TCPDialRejectedIPv6.
		} {
			before := icmpReceived(s)
			addr := netip.AddrPortFrom(c.to, c.port).String()
			start := time.Now()
			conn, err := s.Dial(testCtx(t, 10*time.Second), "tcp", addr)
			took := time.Since(start)
			if err == nil {
				conn.Close()
				t.Fatalf("dial %s succeeded through a reject rule", addr)
			}
			if !errors.Is(err, c.want) || took > 2*time.Second {
				t.Fatalf("dial %s: %v after %v, want %v at once", addr, err, took, c.want)
			}
			after := icmpReceived(s)
			if after.unreach4+after.unreach6 == before.unreach4+before.unreach6 {
				t.Fatalf("dial %s: %v, but the stack counted no destination unreachable (a RST?)", addr, err)
			}
			t.Logf("dial %s: %v after %v", addr, err, took)
		}
	})

	t.Run("TCPDialRejectedIPv6", func(t *testing.T) {
		// Every ICMPv6 destination unreachable code nft can send (all but
		// 2, beyond scope), one port each, answered by the outside host;
		// a UDP port answered with administratively prohibited too. The
		// bridge host's own kernel dials the same ports: the application
		// must see what it sees.
		const base = 9010
		codes := []struct {
			code uint8
			name string
		}{{0, "no-route"}, {1, "admin-prohibited"}, {3, "addr-unreachable"}, {4, "port-unreachable"}, {5, "policy-fail"}, {6, "reject-route"}}
		rules := "table ip6 fbicmp6 {\n\tchain input {\n\t\ttype filter hook input priority 0;\n"
		for _, c := range codes {
			rules += fmt.Sprintf("\t\ttcp dport %d reject with icmpv6 type %s\n", base+int(c.code), c.name)
		}
		rules += fmt.Sprintf("\t\tudp dport %d reject with icmpv6 type admin-prohibited\n\t}\n}\n", base+1)
		file := filepath.Join(t.TempDir(), "rules6.nft")
		if err := os.WriteFile(file, []byte(rules), 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := e.out.Exec(testCtx(t, 10*time.Second), "nft", "-f", file); err != nil {
			t.Fatalf("nft: %v\n%s", err, out)
		}
		for _, c := range codes {
			addr := netip.AddrPortFrom(e.outside6, base+uint16(c.code)).String()
			// The kernel's answer first.
			var kerr error
			kstart := time.Now()
			e.br.Do(func() error {
				d := net.Dialer{Timeout: 5 * time.Second}
				kc, err := d.Dial("tcp6", addr)
				if err == nil {
					kc.Close()
				}
				kerr = err
				return nil
			})
			ktook := time.Since(kstart)
			var kernelErrno syscall.Errno
			if !errors.As(kerr, &kernelErrno) {
				t.Fatalf("code %d (%s): the bridge host's kernel dialled %s: %v, not an errno", c.code, c.name, addr, kerr)
			}
			want, _ := unreach6Errno(c.code)
			if kernelErrno != want {
				t.Errorf("code %d (%s): the kernel says %v, icmpv6_err_convert as we have it %v", c.code, c.name, kernelErrno, want)
			}
			before := icmpReceived(s)
			start := time.Now()
			conn, err := s.Dial(testCtx(t, 10*time.Second), "tcp6", addr)
			took := time.Since(start)
			if err == nil {
				conn.Close()
				t.Fatalf("dial %s succeeded through a reject rule", addr)
			}
			if !errors.Is(err, kernelErrno) || took > 2*time.Second {
				t.Fatalf("code %d (%s): dial %s: %v after %v, want %v (as the kernel) at once", c.code, c.name, addr, err, took, kernelErrno)
			}
			if after := icmpReceived(s); after.unreach6 == before.unreach6 {
				t.Fatalf("code %d: dial %s: %v, but the stack counted no ICMPv6 destination unreachable", c.code, addr, err)
			}
			t.Logf("code %d (%s): dial %s: %v after %v; kernel: %v after %v", c.code, c.name, addr, err, took, kerr, ktook)
		}
		// A connected UDP socket: Linux reports administratively
		// prohibited (one of its "fatal" codes) on the next call.
		addr := netip.AddrPortFrom(e.outside6, base+1).String()
		u, err := s.Dial(testCtx(t, 10*time.Second), "udp6", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer u.Close()
		if _, err := u.Write([]byte("anyone there?")); err != nil {
			t.Fatal(err)
		}
		u.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = u.Read(make([]byte, 100))
		if !errors.Is(err, syscall.EACCES) {
			t.Fatalf("udp6 read after administratively prohibited: %v, want permission denied", err)
		}
		t.Logf("udp6 %s: %v", addr, err)
	})

	t.Run("UDPRejectedIPv4", func(t *testing.T) {
		// A connected IPv4 UDP socket answered with each ICMP destination
		// unreachable type nft can send. Linux reports the "fatal" ones
		// and not the others; the bridge host's own kernel says which.
		const base = 9030
		types := []struct {
			code uint8
			name string
		}{{0, "net-unreachable"}, {1, "host-unreachable"}, {2, "prot-unreachable"}, {9, "net-prohibited"}, {10, "host-prohibited"}, {13, "admin-prohibited"}}
		rules := "table ip fbicmp4 {\n\tchain input {\n\t\ttype filter hook input priority 0;\n"
		for _, c := range types {
			rules += fmt.Sprintf("\t\tudp dport %d reject with icmp type %s\n", base+int(c.code), c.name)
		}
		rules += "\t}\n}\n"
		file := filepath.Join(t.TempDir(), "rules4.nft")
		if err := os.WriteFile(file, []byte(rules), 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := e.out.Exec(testCtx(t, 10*time.Second), "nft", "-f", file); err != nil {
			t.Fatalf("nft: %v\n%s", err, out)
		}
		// exchange writes one datagram and reads: the error, or a timeout.
		exchange := func(c net.Conn) error {
			defer c.Close()
			if _, err := c.Write([]byte("anyone there?")); err != nil {
				return err
			}
			c.SetReadDeadline(time.Now().Add(700 * time.Millisecond))
			_, err := c.Read(make([]byte, 100))
			return err
		}
		timedOut := func(err error) bool {
			var ne net.Error
			return errors.As(err, &ne) && ne.Timeout()
		}
		for _, c := range types {
			addr := netip.AddrPortFrom(e.outside4, base+uint16(c.code)).String()
			var kerr error
			e.br.Do(func() error {
				kc, err := net.Dial("udp4", addr)
				if err == nil {
					err = exchange(kc)
				}
				kerr = err
				return nil
			})
			var kernelErrno syscall.Errno
			kernelReports := errors.As(kerr, &kernelErrno)
			if !kernelReports && !timedOut(kerr) {
				t.Fatalf("%s: the kernel's socket: %v", c.name, kerr)
			}
			if want, fatal := unreach4Errno(c.code); fatal != kernelReports || (fatal && want != kernelErrno) {
				t.Errorf("%s: the kernel says %v, icmp_err_convert as we have it %v (reported: %v)", c.name, kerr, want, fatal)
			}
			before := icmpReceived(s)
			u, err := s.Dial(testCtx(t, 10*time.Second), "udp4", addr)
			if err != nil {
				t.Fatal(err)
			}
			err = exchange(u)
			switch {
			case kernelReports && !errors.Is(err, kernelErrno):
				t.Errorf("%s: %v, want %v as the kernel", c.name, err, kernelErrno)
			case !kernelReports && !timedOut(err):
				t.Errorf("%s: %v, want nothing reported, as the kernel", c.name, err)
			}
			if after := icmpReceived(s); after.unreach4 == before.unreach4 {
				t.Errorf("%s: the stack counted no destination unreachable", c.name)
			}
			t.Logf("%s (code %d): %v; kernel: %v", c.name, c.code, err, kerr)
		}
	})

	t.Run("PathMTU", func(t *testing.T) {
		far, farLink := routedFarHost(t, e, 1280)
		for _, fam := range []struct {
			net string
			to  netip.Addr
		}{{"tcp4", farLink.B.Addr4.Addr()}, {"tcp6", farLink.B.Addr6.Addr()}} {
			var l net.Listener
			if err := far.Do(func() (err error) {
				l, err = net.Listen(fam.net, netip.AddrPortFrom(fam.to, 0).String())
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			go hashServer(l)
			before := icmpReceived(s)
			want := body(4 << 20)
			got, err := sendAndHash(testCtx(t, 60*time.Second), s, fam.net, l.Addr().String(), want)
			if err != nil {
				t.Fatalf("%s: %v", fam.net, err)
			}
			if sum := sha256.Sum256(want); !bytes.Equal(got, sum[:]) {
				t.Fatalf("%s: the far host received other bytes than were sent", fam.net)
			}
			after := icmpReceived(s)
			// The hop is narrower than both ends' MTUs and the stack sets
			// DF: only the router's error can have made this work.
			if fam.net == "tcp4" && after.unreach4 == before.unreach4 {
				t.Fatalf("tcp4: transfer done but no fragmentation needed reached the stack (%+v)", after)
			}
			if fam.net == "tcp6" && after.tooBig6 == before.tooBig6 {
				t.Fatalf("tcp6: transfer done but no packet too big reached the stack (%+v)", after)
			}
			t.Logf("%s: 4 MB byte-exact through a 1280-byte hop; ICMP before %+v after %+v", fam.net, before, after)
		}
	})
}

// routedFarHost adds a host behind the outside host, which routes between
// the wire and a link to it whose router end has the given MTU, and tells
// the bridge host's kernel (whose routes the bridge follows) the way there.
// The far host's own end keeps 1500 bytes, so it announces a 1460-byte
// MSS: the narrow hop is in the middle of the path, where only path MTU
// discovery finds it.
func routedFarHost(t *testing.T, e *e2e, mtu int) (*topology.NS, *topology.Veth) {
	t.Helper()
	far := topology.New(t)
	link := topology.Connect(t, e.out, far, topology.VethOptions{})
	narrow, err := e.out.Handle().LinkByIndex(link.A.Index)
	if err == nil {
		err = e.out.Handle().LinkSetMTU(narrow, mtu)
	}
	if err != nil {
		t.Fatalf("router's MTU toward the far host: %v", err)
	}
	if err := e.out.Do(func() error {
		for _, f := range []string{"/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"} {
			if err := os.WriteFile(f, []byte("1"), 0); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		ns      *topology.NS
		dst     netip.Prefix
		via     netip.Addr
		ifindex int
	}{
		{far, netip.PrefixFrom(e.local4, 32), link.A.Addr4.Addr(), link.B.Index},
		{far, netip.PrefixFrom(e.local6, 128), link.A.Addr6.Addr(), link.B.Index},
		{e.br, netip.PrefixFrom(link.B.Addr4.Addr(), 32), e.outside4, e.wire.B.Index},
		{e.br, netip.PrefixFrom(link.B.Addr6.Addr(), 128), e.outside6, e.wire.B.Index},
	} {
		route := &netlink.Route{
			LinkIndex: r.ifindex,
			Dst:       &net.IPNet{IP: r.dst.Addr().AsSlice(), Mask: net.CIDRMask(r.dst.Bits(), r.dst.Addr().BitLen())},
			Gw:        r.via.AsSlice(),
		}
		if err := r.ns.Handle().RouteAdd(route); err != nil {
			t.Fatalf("route to %v via %v: %v", r.dst, r.via, err)
		}
	}
	// Resolve the neighbours along the way (IPv6's first packets otherwise
	// wait on neighbour discovery on two hops, and a lost SYN costs the
	// test a second). The new link's IPv6 addresses are tentative until
	// duplicate address detection ends, which a loaded machine stretches:
	// 3 s was once too short in CI.
	// About one run in ten the first IPv6 echo goes unanswered while the
	// two later ones come back at once (seen 2026-11-27, kernel to kernel:
	// the bridge passes echoes and neighbour discovery to the host). The
	// path is up when an echo is answered.
	for _, dst := range []netip.Addr{link.B.Addr4.Addr(), link.B.Addr6.Addr()} {
		if n, err := e.br.Ping(dst, 3, 15*time.Second); n == 0 {
			t.Fatalf("the far host does not answer ping from the bridge host: %v", err)
		} else if err != nil {
			t.Logf("%v; the path is up", err)
		}
	}
	return far, link
}

// hashServer answers each connection with the SHA-256 of all it read.
func hashServer(l net.Listener) {
	serveConns(l, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(60 * time.Second))
		h := sha256.New()
		if _, err := io.Copy(h, c); err == nil {
			c.Write(h.Sum(nil))
		}
	})
}

// sendAndHash dials addr from the stack, sends data, closes its side and
// returns the hash the server answers with.
func sendAndHash(ctx context.Context, s *Stack, network, addr string, data []byte) ([]byte, error) {
	c, err := s.Dial(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if d, ok := ctx.Deadline(); ok {
		c.SetDeadline(d)
	}
	if _, err := c.Write(data); err != nil {
		return nil, fmt.Errorf("write: %w", err)
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return nil, err
	}
	sum := make([]byte, sha256.Size)
	if _, err := io.ReadFull(c, sum); err != nil {
		return nil, fmt.Errorf("reading the far host's hash: %w", err)
	}
	return sum, nil
}
