package appliance

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// TestMTUDropUDP: after the served interface's MTU (and its peer's) goes
// from 1500 to 1400 and then to 1280, an application's UDP datagrams
// larger than the new MTU, over IPv4 and IPv6, reach a kernel peer whole,
// as a kernel socket's would: once the daemon has pushed the MTU, the
// application's stack fragments them (the sender fragments: IPv6 routers
// never do); before, the bridge fragments what the stack sent at the old
// MTU. None is refused on transmit for its size (tx_rejects{reason="mtu"}),
// which the application would never hear of: before the bridge fragmented,
// about 30 datagrams were lost so in the second after each lowering. One
// over the largest UDP datagram fails at once with EMSGSIZE.
func TestMTUDropUDP(t *testing.T) {
	tp := newTopo(t)
	log := &testenv.Output{}
	d := tp.start(t, tp.config(t, ""), log)
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := userstack.Open(ctx, userstack.Options{App: "udp-mtu", Control: d.Config().Control.Socket})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	pc, err := st.ListenPacket("udp", ":9000")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()

	peers := map[string]*net.UDPConn{}
	for family, a := range map[string]netip.Addr{"udp4": tp.v.B.Addr4.Addr(), "udp6": tp.v.B.Addr6.Addr()} {
		if err := tp.outside.Do(func() (err error) {
			peers[family], err = net.ListenUDP(family, net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, 9001)))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer peers[family].Close()
	}
	seq := uint64(0)
	// datagram is size bytes numbered by its first 8, the rest a pattern
	// of the number, so that a reassembly that mixed or cut fragments
	// shows.
	datagram := func(size int) []byte {
		seq++
		b := make([]byte, size)
		binary.BigEndian.PutUint64(b, seq)
		for i := 8; i < size; i++ {
			b[i] = byte(seq*31 + uint64(i)*7)
		}
		return b
	}
	// exchange sends one datagram of size to the kernel peer of family
	// and reports whether the peer got it whole within wait.
	exchange := func(family string, size int, wait time.Duration) bool {
		t.Helper()
		peer := peers[family]
		to := peer.LocalAddr().(*net.UDPAddr)
		want := datagram(size)
		if _, err := pc.WriteTo(want, to); err != nil {
			t.Fatalf("%s: sending %d bytes: %v", family, size, err)
		}
		buf := make([]byte, 65536)
		peer.SetReadDeadline(time.Now().Add(wait))
		for {
			n, _, err := peer.ReadFromUDP(buf)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return false
			}
			if err != nil {
				t.Fatalf("%s: %v", family, err)
			}
			if n >= 8 && binary.BigEndian.Uint64(buf) != seq {
				continue // an earlier one, late
			}
			if !bytes.Equal(buf[:n], want) {
				t.Fatalf("%s: a datagram of %d bytes arrived as %d bytes, or changed", family, size, n)
			}
			return true
		}
	}
	mtuRejects := func() float64 {
		var n float64
		for _, s := range metrics.Find(tp.scrape(t, d), "fabricbridge_stream_tx_rejects_total", metrics.L("reason", "mtu")...) {
			n += s.Value
		}
		return n
	}
	sizes := []int{1300, 1452, 4000, 9000, 65000}
	for _, family := range []string{"udp4", "udp6"} {
		for _, size := range sizes {
			if !exchange(family, size, 2*time.Second) {
				t.Fatalf("%s: a datagram of %d bytes did not arrive at MTU 1500", family, size)
			}
		}
	}

	// The bridge hears of a new MTU at once (a netlink notification), the
	// application within about a second (the daemon's health tick): what
	// it sends in between, at the old MTU, the bridge fragments. Twice, so
	// that at least one lowering leaves time to send in between.
	inWindow := 0
	for _, mtu := range []int{1400, 1280} {
		setLinkMTU(t, tp.bridge, tp.v.A.Name, mtu)
		setLinkMTU(t, tp.outside, tp.v.B.Name, mtu)
		for deadline := time.Now().Add(5 * time.Second); !logged(log, "interface MTU changed", mtu); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the bridge never saw MTU %d:\n%s", mtu, log.String())
			}
		}
		for i := 0; ; i++ {
			told := logged(log, "applications told the interface's new MTU", mtu)
			family, size := []string{"udp4", "udp6"}[i%2], sizes[i/2%len(sizes)]
			if !exchange(family, size, 2*time.Second) {
				t.Errorf("%s: a datagram of %d bytes sent after the MTU went down to %d (the application %s) did not arrive",
					family, size, mtu, map[bool]string{false: "not told yet", true: "told"}[told])
			}
			if told {
				break
			}
			inWindow++
		}
	}
	if inWindow == 0 {
		t.Fatal("the daemon told the application of both new MTUs before a datagram was sent: nothing sent at the old MTU")
	}
	for _, family := range []string{"udp4", "udp6"} {
		for _, size := range sizes {
			if !exchange(family, size, 2*time.Second) {
				t.Errorf("%s: a datagram of %d bytes did not arrive at MTU 1280", family, size)
			}
		}
	}
	if n := mtuRejects(); n != 0 {
		t.Errorf("%v packets refused for their size (tx_rejects{reason=\"mtu\"}), unknown to the application", n)
	}
	t.Logf("%d datagrams sent after the bridge saw a lower MTU and before the application was told", inWindow)

	// Over the largest datagram UDP carries, the application hears of it
	// at once, as from a kernel socket.
	if _, err := pc.WriteTo(make([]byte, 65536), peers["udp4"].LocalAddr()); !errors.Is(err, syscall.EMSGSIZE) {
		t.Errorf("sending 65536 bytes: %v, want EMSGSIZE", err)
	}
}

// logged reports whether the daemon's log has a line with msg and the MTU
// to.
func logged(log *testenv.Output, msg string, to int) bool {
	for _, l := range strings.Split(log.String(), "\n") {
		if strings.Contains(l, msg) && strings.Contains(l, fmt.Sprintf("to=%d", to)) {
			return true
		}
	}
	return false
}

func setLinkMTU(t *testing.T, ns *topology.NS, name string, mtu int) {
	t.Helper()
	if err := ns.Do(func() error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		return netlink.LinkSetMTU(l, mtu)
	}); err != nil {
		t.Fatal(err)
	}
}
