package bridge

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// rig is the test topology: the bridge on end A of a veth in namespace br,
// the outside kernel on end B in namespace out.
type rig struct {
	t       testing.TB
	br, out *topology.NS
	v       *topology.Veth
	b       *Bridge
	local4  netip.Addr // the bridge host's addresses, owned by stream 1
	local6  netip.Addr
	remote4 netip.Addr // the outside host's
	remote6 netip.Addr
}

// Ports of the standard tables: UDP 7000 and TCP 8080 go to stream 1,
// UDP 7100 to stream 2; UDP 7200 is nobody's (the kernel's).
const (
	udpPort1   = 7000
	tcpPort1   = 8080
	udpPort2   = 7100
	kernelPort = 7200
	remotePort = 7001
)

type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// paths are the two data paths the suite runs on: XDP (auto: on veth it
// ends at native copy) and the AF_PACKET fallback.
var paths = []struct {
	name string
	cfg  Config
}{
	{"xdp", Config{}},
	{"afpacket", Config{Path: PathAFPacket, Mode: ModeStrict}},
}

func forEachPath(t *testing.T, f func(t *testing.T, cfg Config)) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) { f(t, p.cfg) })
	}
}

func newRig(t testing.TB, cfg Config) *rig {
	return newRigWith(t, cfg, topology.VethOptions{})
}

// newRigWith is newRig on a veth made with opts.
func newRigWith(t testing.TB, cfg Config, opts topology.VethOptions) *rig {
	testenv.RequirePrivileged(t)
	br, out, v := topology.Pair(t, opts)
	r := &rig{t: t, br: br, out: out, v: v,
		local4: v.A.Addr4.Addr(), local6: v.A.Addr6.Addr(), remote4: v.B.Addr4.Addr(), remote6: v.B.Addr6.Addr()}
	// The outside kernel hands veth packets with checksums left to
	// offload (CHECKSUM_PARTIAL); a real wire carries full ones, and so must
	// the packets the streams get here.
	disableTxChecksumOffload(t, out, v.B.Name)
	cfg.Interface = v.A.Name
	if cfg.FrameCount == 0 {
		cfg.FrameCount = 1024
	}
	cfg.Logger = slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if err := br.Do(func() (err error) { r.b, err = Open(cfg); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.b.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return r
}

// eventually returns the bridge's stats once cond holds for them, or after
// two seconds whatever they are. Loops count a batch after they handed it
// on, so a packet can be at its destination a moment before it is counted.
func (r *rig) eventually(cond func(Stats) bool) Stats {
	s := r.b.Stats()
	for deadline := time.Now().Add(2 * time.Second); !cond(s) && time.Now().Before(deadline); s = r.b.Stats() {
		time.Sleep(time.Millisecond)
	}
	return s
}

// parseDelivered parses a packet an application read from a stream. When it
// does not parse, the failure shows the packet in hex next to the bridge's
// path and stats, so that a rare failure (a corrupt frame, a packet nobody
// sent) can be told apart afterwards from the log alone.
func (r *rig) parseDelivered(what string, pkt []byte) ippkt.Parsed {
	r.t.Helper()
	p, err := ippkt.Parse(pkt)
	if err != nil {
		r.t.Fatalf("%s: %v\n%s", what, err, r.describe(pkt))
	}
	return p
}

// describe is pkt in hex and the bridge's state, for failure messages.
func (r *rig) describe(pkt []byte) string {
	return fmt.Sprintf("%d bytes:\n%sbridge on path %v: %+v", len(pkt), hex.Dump(pkt), r.b.Path(), r.b.Stats())
}

// standardTables installs the listeners described at udpPort1.
func (r *rig) standardTables() {
	r.t.Helper()
	r.setTables(&classifier.RuleSet{Listeners: []classifier.Listener{
		{ID: 1, Protocol: classifier.ProtoUDP, Port: udpPort1, Stream: 1},
		{ID: 2, Protocol: classifier.ProtoTCP, Port: tcpPort1, Stream: 1},
		{ID: 3, Protocol: classifier.ProtoUDP, Port: udpPort2, Stream: 2},
	}})
}

func (r *rig) setTables(rs *classifier.RuleSet) {
	r.t.Helper()
	tab, err := classifier.Compile(rs)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.b.SetTables(tab); err != nil {
		r.t.Fatal(err)
	}
}

// ownership1 is what stream 1 owns.
func (r *rig) ownership1() classifier.Ownership {
	return classifier.Ownership{
		Addrs: []netip.Addr{r.local4, r.local6},
		Ports: []classifier.PortClaim{{Proto: classifier.ProtoUDP, Port: udpPort1}, {Proto: classifier.ProtoTCP, Port: tcpPort1}},
	}
}

// stream connects a new stream under id and returns its application end.
func (r *rig) stream(id uint32, own classifier.Ownership, cfg fabric.Config) *fabric.Stream {
	r.t.Helper()
	bs, app, err := fabric.NewPair(cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.b.AddStream(id, bs, own); err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() {
		r.b.RemoveStream(id)
		bs.Close()
		app.Close()
	})
	return app
}

// udpSocket opens an unconnected kernel UDP socket in ns. Unconnected, so
// that ICMP errors (the kernel seeing steered packets on the AF_PACKET path)
// do not turn later sends into errors.
func udpSocket(t testing.TB, ns *topology.NS, at netip.AddrPort) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	if err := ns.Do(func() (err error) {
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(at))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func sendTo(t testing.TB, c *net.UDPConn, to netip.AddrPort, payloads [][]byte) {
	t.Helper()
	for _, p := range payloads {
		if _, err := c.WriteToUDPAddrPort(p, to); err != nil {
			t.Fatal(err)
		}
	}
}

// recvN reads n packets from an application's stream end.
func recvN(t *testing.T, app *fabric.Stream, n int, wait time.Duration) [][]byte {
	t.Helper()
	var got [][]byte
	bufs := make([][]byte, 64)
	deadline := time.Now().Add(wait)
	for len(got) < n {
		left := time.Until(deadline)
		if left <= 0 {
			break
		}
		for i := range bufs {
			bufs[i] = make([]byte, 2048)
		}
		k, err := app.RecvTimeout(bufs[:min(len(bufs), n-len(got))], left)
		if err != nil && err != fabric.ErrTimeout {
			t.Fatal(err)
		}
		for _, b := range bufs[:k] {
			got = append(got, b)
		}
	}
	return got
}

// injector writes raw frames onto the outside end with an AF_PACKET socket.
func injector(t *testing.T, ns *topology.NS, ifindex int) func(frames ...[]byte) {
	t.Helper()
	var fd int
	if err := ns.Do(func() (err error) {
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifindex})
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return func(frames ...[]byte) {
		for _, f := range frames {
			if _, err := unix.Write(fd, f); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// capture records every frame the outside end receives.
type capture struct {
	fd int
}

func newCapture(t *testing.T, ns *topology.NS, ifindex int) *capture {
	t.Helper()
	return &capture{fd: ns.PacketSocket(t, ifindex)}
}

// until reads incoming frames until one satisfies stop or wait passes, and
// returns all of them.
func (c *capture) until(wait time.Duration, stop func([]byte) bool) (frames [][]byte, stopped bool) {
	deadline := time.Now().Add(wait)
	buf := make([]byte, 4096)
	for time.Now().Before(deadline) {
		n, from, err := unix.Recvfrom(c.fd, buf, 0)
		if err != nil {
			continue
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		f := append([]byte(nil), buf[:n]...)
		frames = append(frames, f)
		if stop(f) {
			return frames, true
		}
	}
	return frames, false
}

// disableTxChecksumOffload is `ethtool -K name tx off`.
func disableTxChecksumOffload(t testing.TB, ns *topology.NS, name string) {
	t.Helper()
	if err := ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ev := struct{ cmd, data uint32 }{unix.ETHTOOL_STXCSUM, 0}
		var ifr [40]byte
		copy(ifr[:15], name)
		*(*unsafe.Pointer)(unsafe.Pointer(&ifr[16])) = unsafe.Pointer(&ev)
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); e != 0 {
			return fmt.Errorf("ETHTOOL_STXCSUM on %s: %w", name, e)
		}
		runtime.KeepAlive(&ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// withVLAN inserts an 802.1Q (or, with tpid 0x88a8, 802.1ad) tag after the
// MAC addresses.
func withVLAN(frame []byte, tpid, vid uint16) []byte {
	out := append([]byte(nil), frame[:12]...)
	out = append(out, byte(tpid>>8), byte(tpid), byte(vid>>8), byte(vid))
	return append(out, frame[12:]...)
}

func containsBytes(frames [][]byte, b []byte) bool {
	for _, f := range frames {
		if bytes.Contains(f, b) {
			return true
		}
	}
	return false
}

// rxAllocs sends eight bursts of 48 datagrams to port, 5 ms apart (on the
// AF_PACKET path a retired block each), and then measures the allocations
// of q's receive pass over what waits: a warm-up and five measured passes,
// each polling until it handles a batch. It returns the allocations per
// pass and the frames handled.
func (r *rig) rxAllocs(t *testing.T, q *queue, port uint16, label string) (allocs float64, frames int) {
	t.Helper()
	c := udpSocket(t, r.out, netip.AddrPortFrom(r.remote4, 0))
	for range 8 {
		sendTo(t, c, netip.AddrPortFrom(r.local4, port), payloads(48, label))
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	var d dispatcher
	allocs = testing.AllocsPerRun(5, func() {
		for try := 0; try < 1000; try++ {
			if n := q.rxOnce(&d); n > 0 {
				frames += n
				return
			}
		}
	})
	return allocs, frames
}
