package ebpf

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestAttachedToVeth attaches the program to a veth end and sends real
// traffic from the kernel in the peer namespace: UDP and TCP are counted
// under the rule or listener that claims them, a drop rule drops, and ping
// and ARP (which no rule claims) keep working.
func TestAttachedToVeth(t *testing.T) {
	for _, mode := range []Mode{ModeNative, ModeGeneric} {
		t.Run(mode.String(), func(t *testing.T) { testAttachedToVeth(t, mode) })
	}
}

func testAttachedToVeth(t *testing.T, mode Mode) {
	p := newPair(t)
	bridge, outside, v := topology.Pair(t, topology.VethOptions{})
	local4, local6 := v.A.Addr4.Addr(), v.A.Addr6.Addr()

	const (
		idPass     = 11
		idListener = 12
		idDrop     = 13
	)
	rs := &classifier.RuleSet{
		Listeners: []classifier.Listener{
			{ID: idListener, Protocol: classifier.ProtoTCP, Addr: local4, Port: 8080, Stream: 1},
		},
		Rules: []classifier.Rule{
			{ID: idPass, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(5000), Action: classifier.ActionPass},
			{ID: idDrop, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(5001), Action: classifier.ActionDrop},
		},
	}
	if err := p.install(rs); err != nil {
		t.Fatal(err)
	}
	var got Mode
	if err := bridge.Do(func() (err error) {
		got, err = p.prog.Attach(v.A.Index, mode)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if got != mode {
		t.Fatalf("attached in %v mode, asked for %v", got, mode)
	}
	if m, ok := p.prog.Mode(); !ok || m != mode {
		t.Fatalf("Mode() = %v, %v", m, ok)
	}

	// Ping over IPv4 needs ARP, over IPv6 neighbour discovery: both are
	// frames no rule claims, so the kernel must still get them.
	for _, dst := range []netip.Addr{local4, local6} {
		if n, err := outside.Ping(dst, 3, 5*time.Second); err != nil || n != 3 {
			t.Fatalf("ping %v through the program: %d of 3 replies, %v", dst, n, err)
		}
	}
	neighs, err := outside.Handle().NeighList(v.B.Index, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	resolved := false
	for _, n := range neighs {
		resolved = resolved || (n.IP.Equal(local4.AsSlice()) && n.HardwareAddr.String() == v.A.MAC.String())
	}
	if !resolved {
		t.Fatalf("ARP did not resolve %v to %v: %v", local4, v.A.MAC, neighs)
	}

	const datagrams = 20
	udpPass := listenUDP(t, bridge, netip.AddrPortFrom(local4, 5000))
	udpDrop := listenUDP(t, bridge, netip.AddrPortFrom(local4, 5001))
	sendUDP(t, outside, netip.AddrPortFrom(local4, 5000), datagrams)
	sendUDP(t, outside, netip.AddrPortFrom(local4, 5001), datagrams)
	if n := drain(udpPass, datagrams, 2*time.Second); n != datagrams {
		t.Errorf("pass rule: the kernel socket got %d of %d datagrams", n, datagrams)
	}
	if n := drain(udpDrop, datagrams, 300*time.Millisecond); n != 0 {
		t.Errorf("drop rule: the kernel socket got %d datagrams, want 0", n)
	}

	// The listener steers to a stream, but no AF_XDP socket is bound in this
	// test, so the redirect falls back to the kernel, which completes the
	// connection: counted under the listener and as a failed redirect.
	exchangeTCP(t, bridge, outside, netip.AddrPortFrom(local4, 8080))

	for _, c := range []struct {
		id   uint32
		min  uint64
		what string
	}{
		{idPass, datagrams, "udp pass rule"},
		{idDrop, datagrams, "udp drop rule"},
		{idListener, 3, "tcp listener (SYN, ACK, data at least)"},
	} {
		n, err := p.prog.RuleCounter(c.id)
		if err != nil {
			t.Fatal(err)
		}
		if n.Packets < c.min || (c.id != idListener && n.Packets != c.min) {
			t.Errorf("%s (id %d) counted %d packets, want %d", c.what, c.id, n.Packets, c.min)
		}
	}
	cs, err := p.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if cs.Verdicts[classifier.VerdictDrop].Packets != datagrams {
		t.Errorf("drop verdicts: %d, want %d", cs.Verdicts[classifier.VerdictDrop].Packets, datagrams)
	}
	if cs.Verdicts[classifier.VerdictSteer].Packets < 3 || cs.RedirectFailed != cs.Verdicts[classifier.VerdictSteer].Packets {
		t.Errorf("steer verdicts %d, failed redirects %d: every steered frame should have fallen back", cs.Verdicts[classifier.VerdictSteer].Packets, cs.RedirectFailed)
	}
	if cs.Verdicts[classifier.VerdictPass].Packets < datagrams+6 {
		t.Errorf("pass verdicts: %d, want at least the datagrams and pings", cs.Verdicts[classifier.VerdictPass].Packets)
	}

	if err := p.prog.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, ok := p.prog.Mode(); ok {
		t.Fatal("still attached after Detach")
	}
	var xdpLeft bool
	if err := bridge.Do(func() error {
		l, err := netlink.LinkByIndex(v.A.Index)
		if err != nil {
			return err
		}
		xdpLeft = l.Attrs().Xdp != nil && l.Attrs().Xdp.Attached
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if xdpLeft {
		t.Fatal("an XDP program is still attached to the interface after Detach")
	}
	before, _ := p.prog.RuleCounter(idDrop)
	sendUDP(t, outside, netip.AddrPortFrom(local4, 5001), 3)
	if n := drain(udpDrop, 3, 2*time.Second); n != 3 {
		t.Errorf("after Detach the kernel got %d of 3 datagrams", n)
	}
	if after, _ := p.prog.RuleCounter(idDrop); after != before {
		t.Errorf("the detached program still counts: %+v then %+v", before, after)
	}
}

func listenUDP(t *testing.T, ns *topology.NS, at netip.AddrPort) *net.UDPConn {
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

func sendUDP(t *testing.T, ns *topology.NS, to netip.AddrPort, n int) {
	t.Helper()
	if err := ns.Do(func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
		if err != nil {
			return err
		}
		defer c.Close()
		for i := range n {
			if _, err := c.Write([]byte(fmt.Sprintf("datagram %d", i))); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// drain reads up to want datagrams, waiting at most wait for each.
func drain(c *net.UDPConn, want int, wait time.Duration) int {
	buf := make([]byte, 2048)
	got := 0
	for got < want {
		c.SetReadDeadline(time.Now().Add(wait))
		if _, err := c.Read(buf); err != nil {
			break
		}
		got++
	}
	return got
}

// exchangeTCP connects from client to a kernel listener at addr in server
// and moves a message each way.
func exchangeTCP(t *testing.T, server, client *topology.NS, addr netip.AddrPort) {
	t.Helper()
	var ln net.Listener
	if err := server.Do(func() (err error) {
		ln, err = net.Listen("tcp", addr.String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 5)
		if _, err := io.ReadFull(c, buf); err != nil {
			served <- err
			return
		}
		_, err = c.Write([]byte("pong!"))
		served <- err
	}()
	if err := client.Do(func() error {
		d := net.Dialer{Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", addr.String())
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping!")); err != nil {
			return err
		}
		buf := make([]byte, 5)
		if _, err := io.ReadFull(c, buf); err != nil {
			return err
		}
		if string(buf) != "pong!" {
			return errors.New("wrong reply " + string(buf))
		}
		return nil
	}); err != nil {
		t.Fatalf("tcp through the program: %v", err)
	}
	if err := <-served; err != nil {
		t.Fatalf("tcp server: %v", err)
	}
}
