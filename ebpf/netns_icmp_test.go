package ebpf

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestICMPErrorsFromKernel: the kernel in the peer namespace answers UDP to a
// closed port with ICMP and ICMPv6 port unreachable; the program, attached to
// the bridge's veth end, counts each error under the flow of the socket that
// sent the datagram (steered; with no AF_XDP socket bound the redirect falls
// back to the kernel, whose socket then reports the refusal).
func TestICMPErrorsFromKernel(t *testing.T) {
	p := newPair(t)
	bridge, _, v := topology.Pair(t, topology.VethOptions{})
	const flow4, flow6 = 21, 22
	local4 := netip.AddrPortFrom(v.A.Addr4.Addr(), 4000)
	local6 := netip.AddrPortFrom(v.A.Addr6.Addr(), 4000)
	remote4 := netip.AddrPortFrom(v.B.Addr4.Addr(), 53) // nothing listens there
	remote6 := netip.AddrPortFrom(v.B.Addr6.Addr(), 53)
	rs := &classifier.RuleSet{Flows: []classifier.Flow{
		{ID: flow4, Protocol: classifier.ProtoUDP, Local: local4, Remote: remote4, Stream: 1},
		{ID: flow6, Protocol: classifier.ProtoUDP, Local: local6, Remote: remote6, Stream: 1},
	}}
	if err := p.install(rs); err != nil {
		t.Fatal(err)
	}
	if err := bridge.Do(func() error {
		_, err := p.prog.Attach(v.A.Index, ModeNative)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.prog.Detach() })

	for _, c := range []struct {
		id            uint32
		local, remote netip.AddrPort
	}{{flow4, local4, remote4}, {flow6, local6, remote6}} {
		var conn *net.UDPConn
		if err := bridge.Do(func() (err error) {
			conn, err = net.DialUDP("udp", net.UDPAddrFromAddrPort(c.local), net.UDPAddrFromAddrPort(c.remote))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		refused := false
		buf := make([]byte, 64)
		for range 3 {
			if _, err := conn.Write([]byte("anyone there?")); err != nil && !errors.Is(err, syscall.ECONNREFUSED) {
				t.Fatal(err)
			}
			conn.SetReadDeadline(time.Now().Add(time.Second))
			if _, err := conn.Read(buf); errors.Is(err, syscall.ECONNREFUSED) {
				refused = true
				break
			}
		}
		if !refused {
			t.Errorf("%v to %v: the kernel socket never heard of the port unreachable", c.local, c.remote)
		}
		n, err := p.prog.RuleCounter(c.id)
		if err != nil {
			t.Fatal(err)
		}
		if n.Packets == 0 {
			t.Errorf("%v to %v: no ICMP error counted under flow %d", c.local, c.remote, c.id)
		}
	}
	cs, err := p.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if steered := cs.Verdicts[classifier.VerdictSteer].Packets; steered < 2 || cs.RedirectFailed != steered {
		t.Errorf("steer verdicts %d, failed redirects %d: want both ICMP errors steered and fallen back", steered, cs.RedirectFailed)
	}
}
