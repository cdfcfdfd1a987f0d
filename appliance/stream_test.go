package appliance

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// TestStreamThroughDaemon registers an application over the control socket
// and checks that the daemon's bridge delivers its UDP datagrams into its
// stream, across a reload, and sends what it writes into the stream out to
// the kernel of the outside host.
func TestStreamThroughDaemon(t *testing.T) {
	tp := newTopo(t)
	d := tp.start(t, tp.config(t, "rules:\n  - {id: 3, match: {protocol: udp, dst_port: 6666}, action: drop}\n"), io.Discard)
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := control.DialLocal(ctx, d.Config().Control.Socket, "raw")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	reg, stream, err := c.RegisterLocal(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	local := tp.v.A.Addr4.Addr()
	if _, err := c.Listen(ctx, "udp", local, 5000); err != nil {
		t.Fatal(err)
	}

	var out *net.UDPConn
	if err := tp.outside.Do(func() (err error) {
		out, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(tp.v.B.Addr4.Addr(), 0)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	to := net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, 5000))
	outAddr := out.LocalAddr().(*net.UDPAddr).AddrPort()

	expect := func(round string) {
		t.Helper()
		for i := range 5 {
			if _, err := out.WriteToUDP([]byte(fmt.Sprintf("%s %d", round, i)), to); err != nil {
				t.Fatal(err)
			}
		}
		bufs := make([][]byte, 8)
		for i := range bufs {
			bufs[i] = make([]byte, stream.MaxPayload())
		}
		got := 0
		deadline := time.Now().Add(5 * time.Second)
		for got < 5 && time.Now().Before(deadline) {
			n, err := stream.RecvTimeout(bufs, time.Second)
			if err != nil && err != fabric.ErrTimeout {
				t.Fatal(err)
			}
			for _, b := range bufs[:n] {
				p, err := ippkt.Parse(b)
				// Checksums are not asserted: veth leaves them partial (offload).
				if err != nil || p.Dst != netip.AddrPortFrom(local, 5000) || p.Src != outAddr || string(p.Payload) != fmt.Sprintf("%s %d", round, got) {
					t.Fatalf("%s: packet %d: %+v, %v", round, got, p, err)
				}
				got++
			}
		}
		if got != 5 {
			t.Fatalf("%s: %d of 5 datagrams reached the stream", round, got)
		}
	}
	expect("before")
	if err := d.Reload(tp.config(t, "")); err != nil {
		t.Fatal(err)
	}
	expect("after-reload")

	// The application answers through its stream; the bridge verifies and
	// sends it, the outside kernel accepts it.
	reply := ippkt.UDP(netip.AddrPortFrom(local, 5000), outAddr, []byte("pong"))
	if _, err := stream.Send([][]byte{reply}); err != nil {
		t.Fatal(err)
	}
	out.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 64)
	n, from, err := out.ReadFromUDP(buf)
	if err != nil || string(buf[:n]) != "pong" || from.AddrPort() != netip.AddrPortFrom(local, 5000) {
		t.Fatalf("reply: %q from %v, %v", buf[:n], from, err)
	}
	// A spoofed source port never leaves, and is counted.
	stream.Send([][]byte{ippkt.UDP(netip.AddrPortFrom(local, 5001), outAddr, []byte("spoof"))})
	out.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, _, err := out.ReadFromUDP(buf); err == nil {
		t.Errorf("spoofed packet arrived: %q", buf[:n])
	}
	s := tp.scrape(t, d)
	stream1 := fmt.Sprint(reg.Stream)
	if v := value(t, s, "fabricbridge_stream_rx_packets_total", "stream", stream1, "app", "raw"); v != 10 {
		t.Errorf("stream rx %v, want 10", v)
	}
	if v := value(t, s, "fabricbridge_stream_tx_rejects_total", "stream", stream1, "reason", "source_port"); v != 1 {
		t.Errorf("source-port rejects %v, want 1", v)
	}
	if v := value(t, s, "fabricbridge_stream_health", "stream", stream1, "state", "normal"); v != 1 {
		t.Errorf("stream not healthy")
	}
}
