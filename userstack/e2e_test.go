package userstack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// bridgePlane adapts the real bridge to control.Dataplane for these tests.
type bridgePlane struct {
	b *bridge.Bridge
}

func (p *bridgePlane) AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error {
	return p.b.AddStream(id, s, own)
}

// AddRemoteStream has the bridge serve the GENEVE stream itself; the server
// closes it when the lease ends, after RemoveStream.
func (p *bridgePlane) AddRemoteStream(id uint32, rs *fabric.RemoteStream, own classifier.Ownership) error {
	return p.b.AddStream(id, rs.Bridge(), own)
}

func (p *bridgePlane) SetOwnership(id uint32, own classifier.Ownership) error {
	return p.b.SetOwnership(id, own)
}
func (p *bridgePlane) RemoveStream(id uint32) error         { return p.b.RemoveStream(id) }
func (p *bridgePlane) SetTables(t *classifier.Tables) error { return p.b.SetTables(t) }

// e2e is the end-to-end topology: the outside host (the kernel's own TCP
// and UDP) and the bridge host joined by a veth, the bridge and the control
// server on the bridge host, and, for the remote transport, an application
// host joined to the bridge host by a second veth.
type e2e struct {
	t        testing.TB
	out, br  *topology.NS
	wire     *topology.Veth
	b        *bridge.Bridge
	srv      *control.Server
	cfg      control.Config // srv's, for a restart
	path     string         // control socket
	ctlAddr  string         // control TCP address (remote)
	appNS    *topology.NS   // remote application host
	secret   []byte
	local4   netip.Addr // the bridge host's addresses on the wire
	local6   netip.Addr
	outside4 netip.Addr
	outside6 netip.Addr
	log      *testenv.Output // what the bridge and the control server logged
	spin     time.Duration   // FB_BENCH_SPIN, for the bridge and the local stacks
}

var e2ePorts = classifier.PortRange{Lo: 42000, Hi: 42999}

func newE2E(t testing.TB) *e2e { return newE2EWith(t, topology.VethOptions{}, nil) }

// newE2EWith is newE2E on a wire made with opts; prepare, if not nil, runs
// on the wire before the bridge opens on it, and may set the bridge's
// configuration (its interface, logger and spin are the test's).
func newE2EWith(t testing.TB, opts topology.VethOptions, prepare func(*topology.Veth, *bridge.Config) error) *e2e {
	testenv.RequirePrivileged(t)
	out, br, wire := topology.Pair(t, opts)
	var brCfg bridge.Config
	if prepare != nil {
		if err := prepare(wire, &brCfg); err != nil {
			t.Fatal(err)
		}
	}
	e := &e2e{t: t, out: out, br: br, wire: wire, secret: []byte("e2e-shared-secret-0123"),
		local4: wire.B.Addr4.Addr(), local6: wire.B.Addr6.Addr(), outside4: wire.A.Addr4.Addr(), outside6: wire.A.Addr6.Addr()}
	// A real wire carries complete checksums; a veth leaves them to
	// offload unless told otherwise.
	if err := ethtool.DisableTxChecksum(out, wire.A.Name); err != nil {
		t.Fatal(err)
	}
	// The bridge host's kernel must not pick the applications' ports.
	if err := br.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_local_reserved_ports", fmt.Appendf(nil, "%d-%d", e2ePorts.Lo, e2ePorts.Hi), 0)
	}); err != nil {
		t.Fatal(err)
	}
	// The application host for the remote transport. Its link carries
	// GENEVE, 36 bytes more than the wire's packets.
	e.appNS = topology.New(t)
	appLink := topology.Connect(t, br, e.appNS, topology.VethOptions{MTU: 1600})
	e.log = &testenv.Output{}
	log := slog.New(slog.NewTextHandler(e.log, nil))
	var err error
	if e.spin, err = benchSpin(); err != nil {
		t.Fatal(err)
	}
	var remote *fabric.Remote
	var ctlL net.Listener
	if err := br.Do(func() (err error) {
		// The bridge's default UMEM, as in production: with 1024 frames (512
		// for RX) its fill ring ran dry in bulk transfers and the kernel
		// dropped 1-6% of the segments.
		brCfg.Interface, brCfg.Logger, brCfg.Spin = wire.B.Name, log, e.spin
		if e.b, err = bridge.Open(brCfg); err != nil {
			return err
		}
		if remote, err = fabric.ListenRemote(netip.AddrPortFrom(appLink.A.Addr4.Addr(), 0), fabric.RemoteConfig{}); err != nil {
			return err
		}
		ctlL, err = net.Listen("tcp", netip.AddrPortFrom(appLink.A.Addr4.Addr(), 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.b.Close() })
	t.Cleanup(func() { remote.Close() })
	e.cfg = control.Config{
		Dataplane: &bridgePlane{b: e.b},
		Addrs:     []netip.Addr{e.local4, e.local6},
		Ephemeral: e2ePorts,
		Stream:    fabric.Config{RxSlots: 1024, TxSlots: 1024},
		Secret:    e.secret,
		Remote:    remote,
		Logger:    log,
	}
	srv, err := control.NewServer(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.srv = srv
	e.path = filepath.Join(t.TempDir(), "control.sock")
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: e.path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	e.ctlAddr = ctlL.Addr().String()
	go srv.ServeLocal(ul)
	go srv.ServeRemote(ctlL)
	t.Cleanup(func() { srv.Close() })
	return e
}

// open starts the application's stack, locally or as a remote application
// in its own namespace.
func (e *e2e) open(remote bool) *Stack {
	e.t.Helper()
	ctx := testCtx(e.t, 10*time.Second)
	var s *Stack
	var err error
	if remote {
		err = e.appNS.Do(func() (err error) {
			s, err = Open(ctx, Options{App: "far", Remote: &RemoteOptions{Control: e.ctlAddr, Secret: e.secret}})
			return err
		})
	} else {
		s, err = Open(ctx, Options{App: "web", Control: e.path, Spin: e.spin})
	}
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { s.Close() })
	return s
}

// dialOutside dials from the outside host's kernel.
func (e *e2e) dialOutside(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := e.out.Do(func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

func (e *e2e) listenOutside(network, addr string) net.Listener {
	e.t.Helper()
	var l net.Listener
	if err := e.out.Do(func() (err error) { l, err = net.Listen(network, addr); return err }); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { l.Close() })
	return l
}

func (e *e2e) listenPacketOutside(network, addr string) net.PacketConn {
	e.t.Helper()
	var pc net.PacketConn
	if err := e.out.Do(func() (err error) { pc, err = net.ListenPacket(network, addr); return err }); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { pc.Close() })
	return pc
}

func TestEndToEndLocal(t *testing.T)  { runEndToEnd(t, false) }
func TestEndToEndRemote(t *testing.T) { runEndToEnd(t, true) }

// runEndToEnd is the end-to-end suite, with the application on the
// bridge host (shared memory) or on its own host (GENEVE).
func runEndToEnd(t *testing.T, remote bool) {
	e := newE2E(t)
	s := e.open(remote)
	addr4 := func(port int) string { return net.JoinHostPort(e.local4.String(), fmt.Sprint(port)) }

	t.Run("HTTP10MB", func(t *testing.T) {
		l, err := s.Listen("tcp", ":80")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		want := body(10 << 20)
		serveBody(t, l, want)
		for _, host := range []string{e.local4.String(), "[" + e.local6.String() + "]"} {
			got, err := httpGet(testCtx(t, 60*time.Second), e.dialOutside, "http://"+host+"/")
			if err != nil {
				t.Fatalf("%s: %v", host, err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: %d bytes arrived, not the %d served", host, len(got), len(want))
			}
		}
	})

	t.Run("OutboundDial", func(t *testing.T) {
		l := e.listenOutside("tcp", net.JoinHostPort(e.outside4.String(), "0"))
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "hello %s", r.RemoteAddr)
		})}
		go srv.Serve(l)
		defer srv.Close()
		got, err := httpGet(testCtx(t, 20*time.Second), s.Dial, "http://"+l.Addr().String()+"/")
		if err != nil {
			t.Fatal(err)
		}
		// The kernel server saw the bridge host's address and a reserved port.
		ap, err := netip.ParseAddrPort(strings.TrimPrefix(string(got), "hello "))
		if err != nil || ap.Addr() != e.local4 || !e2ePorts.Contains(ap.Port()) {
			t.Fatalf("server saw %q: want %v and a port of %v", got, e.local4, e2ePorts)
		}
	})

	t.Run("TwoHundredConnections", func(t *testing.T) {
		in, err := s.Listen("tcp", ":7")
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		go echo(in)
		outL := e.listenOutside("tcp", net.JoinHostPort(e.outside4.String(), "0"))
		go echo(outL)
		const n, size = 200, 16 << 10
		ctx := testCtx(t, 90*time.Second)
		var wg sync.WaitGroup
		var failed atomic.Int32
		for i := range n {
			wg.Go(func() {
				var c net.Conn
				var err error
				if i%2 == 0 {
					c, err = e.dialOutside(ctx, "tcp", addr4(7)) // kernel -> userstack
				} else {
					c, err = s.Dial(ctx, "tcp", outL.Addr().String()) // userstack -> kernel
				}
				if err == nil {
					err = exchange(c, i, size)
				}
				if err != nil && failed.Add(1) <= 3 {
					t.Errorf("connection %d: %v", i, err)
				}
			})
		}
		wg.Wait()
		if failed.Load() > 0 {
			t.Fatalf("%d of %d connections failed", failed.Load(), n)
		}
	})

	t.Run("UDPEcho", func(t *testing.T) {
		for _, fam := range []struct {
			net     string
			local   netip.Addr
			outside netip.Addr
		}{{"udp4", e.local4, e.outside4}, {"udp6", e.local6, e.outside6}} {
			// Kernel -> userstack.
			pc, err := s.ListenPacket(fam.net, ":0")
			if err != nil {
				t.Fatal(err)
			}
			go func() {
				buf := make([]byte, 2000)
				for {
					n, from, err := pc.ReadFrom(buf)
					if err != nil {
						return
					}
					pc.WriteTo(buf[:n], from)
				}
			}()
			port := pc.LocalAddr().(*net.UDPAddr).Port
			c, err := e.dialOutside(context.Background(), fam.net, netip.AddrPortFrom(fam.local, uint16(port)).String())
			if err != nil {
				t.Fatal(err)
			}
			if err := pingPong(c, fam.net+" kernel->userstack"); err != nil {
				t.Fatal(err)
			}
			c.Close()
			pc.Close()
			// Userstack -> kernel.
			kpc := e.listenPacketOutside(fam.net, netip.AddrPortFrom(fam.outside, 0).String())
			go func() {
				buf := make([]byte, 2000)
				for {
					n, from, err := kpc.ReadFrom(buf)
					if err != nil {
						return
					}
					kpc.WriteTo(buf[:n], from)
				}
			}()
			uc, err := s.Dial(testCtx(t, 10*time.Second), fam.net, kpc.LocalAddr().String())
			if err != nil {
				t.Fatal(err)
			}
			if err := pingPong(uc, fam.net+" userstack->kernel"); err != nil {
				t.Fatal(err)
			}
			uc.Close()
		}
	})

	t.Run("UnownedPortGetsKernelReset", func(t *testing.T) {
		_, err := e.dialOutside(testCtx(t, 10*time.Second), "tcp", addr4(12345))
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("SYN to a port nobody holds: %v, want connection refused (the kernel's RST)", err)
		}
		// Ports the application held and gave back are the kernel's again.
		l, err := s.Listen("tcp", ":12345")
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
		_, err = e.dialOutside(testCtx(t, 10*time.Second), "tcp", addr4(12345))
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("SYN to a released port: %v, want connection refused", err)
		}
	})

	st := e.b.Stats()
	for _, ss := range st.Streams {
		if ss.TxRejects.Total() != 0 {
			t.Errorf("stream %d: the bridge refused %+v of what the stack sent", ss.ID, ss.TxRejects)
		}
	}
	// The downloads above went out as offload packets where the path
	// copies (the veth segments TCP), and none was lost.
	var joined, lost uint64
	for _, q := range st.Queues {
		joined += q.TxJoined
		lost += q.TxOffloadLost
	}
	if copies := st.Path == bridge.PathNativeCopy.String() || st.Path == bridge.PathGeneric.String(); copies && joined == 0 {
		t.Errorf("path %s: no segment was sent joined", st.Path)
	}
	if lost != 0 {
		t.Errorf("%d segments lost in offload sends", lost)
	}
	t.Logf("path %s: %d segments sent joined", st.Path, joined)
}

// exchange writes size bytes tagged with i and expects them echoed.
func exchange(c net.Conn, i, size int) error {
	defer c.Close()
	c.SetDeadline(time.Now().Add(80 * time.Second))
	msg := body(size)
	msg[0], msg[1] = byte(i), byte(i>>8)
	errc := make(chan error, 1)
	go func() { _, err := c.Write(msg); errc <- err }()
	got := make([]byte, size)
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if err := <-errc; err != nil {
		return err
	}
	if !bytes.Equal(got, msg) {
		return errors.New("echo differs")
	}
	return nil
}

// pingPong sends datagrams over a connected socket and expects each back.
func pingPong(c net.Conn, what string) error {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 2000)
	for i := range 20 {
		msg := fmt.Appendf(nil, "%s %d %s", what, i, strings.Repeat("x", i*50))
		if _, err := c.Write(msg); err != nil {
			return fmt.Errorf("%s: write: %w", what, err)
		}
		n, err := c.Read(buf)
		if err != nil || !bytes.Equal(buf[:n], msg) {
			return fmt.Errorf("%s: datagram %d came back as %q, %v", what, i, buf[:n], err)
		}
	}
	return nil
}
