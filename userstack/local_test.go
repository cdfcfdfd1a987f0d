package userstack

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// An application that calls its own address reaches itself without the
// bridge, over TCP (a megabyte each way, which the stack hands down as
// offload packets with partial checksums) and UDP, on IPv4 and IPv6.
func TestTrafficToItself(t *testing.T) {
	var onWire atomic.Int64
	tap := func(from *peer, pkt []byte) bool {
		if p, err := ippkt.Parse(pkt); err == nil {
			for _, a := range from.addrs {
				if p.Dst.Addr() == a {
					onWire.Add(1)
				}
			}
		}
		return true
	}
	_, pb := wirePairConfig(t, tap, LinkConfig{}, true)
	l, err := pb.s.Listen("tcp", ":7")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go serveConns(l, func(c net.Conn) { io.Copy(c, c) })
	pc, err := pb.s.ListenPacket("udp", ":9")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	sent := body(1 << 20)
	for _, a := range pb.addrs {
		c, err := pb.s.Dial(testCtx(t, 10*time.Second), "tcp", netip.AddrPortFrom(a, 7).String())
		if err != nil {
			t.Fatalf("dialling its own %v: %v", a, err)
		}
		c.SetDeadline(time.Now().Add(20 * time.Second))
		go c.Write(sent)
		got := make([]byte, len(sent))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatalf("echo from its own %v: %v", a, err)
		}
		if !bytes.Equal(got, sent) {
			t.Fatalf("echo from its own %v differs", a)
		}
		c.Close()

		u, err := pb.s.Dial(testCtx(t, 10*time.Second), "udp", netip.AddrPortFrom(a, 9).String())
		if err != nil {
			t.Fatalf("UDP to its own %v: %v", a, err)
		}
		if _, err := u.Write([]byte("to myself")); err != nil {
			t.Fatal(err)
		}
		pc.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 64)
		n, from, err := pc.ReadFrom(buf)
		if err != nil || string(buf[:n]) != "to myself" || from.(*net.UDPAddr).AddrPort().Addr() != a {
			t.Fatalf("datagram to its own %v: %q from %v, %v", a, buf[:n], from, err)
		}
		u.Close()
	}
	st := pb.s.LinkStats()
	t.Logf("looped back %d packets; %d reached the wire", st.TxLooped, onWire.Load())
	if n := onWire.Load(); n != 0 {
		t.Errorf("%d packets to the stack's own addresses left through the bridge", n)
	}
	// 2 × (1 MiB each way, in offload packets of up to 64 KB) at least.
	if st.TxLooped < 64 {
		t.Errorf("only %d packets looped back", st.TxLooped)
	}
	if st.TxDropped != 0 {
		t.Errorf("%d packets dropped on transmit", st.TxDropped)
	}
}

// A packet from the bridge that claims one of the stack's own addresses as
// its source is dropped before the stack: a SYN spoofed so would otherwise
// be answered, the answer looping back to the stack itself.
func TestSpoofOfOwnAddressDropped(t *testing.T) {
	_, pb := wirePairConfig(t, nil, LinkConfig{}, true)
	l, err := pb.s.Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for _, a := range pb.addrs {
		pb.deliver(ippkt.TCP(netip.AddrPortFrom(a, 40000), netip.AddrPortFrom(a, 80), 1000, 0, true, false, false, nil))
	}
	deadline := time.Now().Add(5 * time.Second)
	for pb.s.LinkStats().RxFromSelf < uint64(len(pb.addrs)) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // time for an answer, were there one
	st := pb.s.LinkStats()
	if st.RxFromSelf != uint64(len(pb.addrs)) {
		t.Errorf("%d spoofs counted, want %d", st.RxFromSelf, len(pb.addrs))
	}
	if st.TxLooped != 0 || st.TxPackets != 0 {
		t.Errorf("the stack answered a spoof: %d packets looped back, %d sent", st.TxLooped, st.TxPackets)
	}
}
