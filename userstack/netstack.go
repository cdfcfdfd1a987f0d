package userstack

import (
	"fmt"
	"net/netip"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv6"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

// nicID is the stack's only interface: the stream.
const nicID tcpip.NICID = 1

// TCP buffer sizes. A data-centre path of 10-100 Gbit/s and 50-500 µs RTT
// has a bandwidth-delay product of 60 KB to 6 MB; connections start at
// 1 MB (enough for most of that range without moderation) and receive-
// buffer moderation grows a busy connection's window to the maximum,
// like Linux's tcp_rmem autotuning. Idle connections cost nothing: gVisor
// allocates buffer memory only for data actually queued.
const (
	tcpBufMin     = 4 << 10
	tcpBufDefault = 1 << 20
	tcpBufMax     = 8 << 20
)

// newNetstack builds a gVisor stack over ep with the given addresses and
// the TCP settings above: SACK on, CUBIC, receive-buffer moderation, no
// Nagle delay (Go's net package turns it off for every TCP connection too),
// and TIME-WAIT ports reusable when safe, since ephemeral ports come from a
// bounded reserved range.
func newNetstack(ep *LinkEndpoint, addrs []netip.Addr) (*stack.Stack, error) {
	s := stack.New(stack.Options{
		NetworkProtocols: []stack.NetworkProtocolFactory{
			ipv4.NewProtocol,
			// No duplicate address detection, no MLD, no router
			// solicitations: the kernel behind the bridge owns those (and
			// the bridge would not let such packets out).
			ipv6.NewProtocolWithOptions(ipv6.Options{}),
		},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol},
		HandleLocal:        true,
	})
	fail := func(what string, err tcpip.Error) (*stack.Stack, error) {
		s.Destroy()
		return nil, fmt.Errorf("userstack: %s: %v", what, err)
	}
	opts := []tcpip.SettableTransportProtocolOption{
		func() *tcpip.TCPSACKEnabled { v := tcpip.TCPSACKEnabled(true); return &v }(),
		&tcpip.TCPReceiveBufferSizeRangeOption{Min: tcpBufMin, Default: tcpBufDefault, Max: tcpBufMax},
		&tcpip.TCPSendBufferSizeRangeOption{Min: tcpBufMin, Default: tcpBufDefault, Max: tcpBufMax},
		func() *tcpip.TCPModerateReceiveBufferOption {
			v := tcpip.TCPModerateReceiveBufferOption(true)
			return &v
		}(),
		func() *tcpip.CongestionControlOption { v := tcpip.CongestionControlOption("cubic"); return &v }(),
		func() *tcpip.TCPDelayEnabled { v := tcpip.TCPDelayEnabled(false); return &v }(),
		func() *tcpip.TCPTimeWaitReuseOption { v := tcpip.TCPTimeWaitReuseGlobal; return &v }(),
	}
	for _, o := range opts {
		if err := s.SetTransportProtocolOption(tcp.ProtocolNumber, o); err != nil {
			return fail(fmt.Sprintf("TCP option %T", o), err)
		}
	}
	// ICMP belongs to the kernel behind the bridge, which does not let an
	// application send it: generating errors here would only be dropped.
	s.SetICMPLimit(0)
	s.SetICMPBurst(0)
	if err := s.CreateNICWithOptions(nicID, ep, stack.NICOptions{Name: "fabric"}); err != nil {
		return fail("creating the NIC", err)
	}
	var have4, have6 bool
	for _, a := range addrs {
		proto, bits := ipv4.ProtocolNumber, 32
		if a.Is6() {
			proto, bits = ipv6.ProtocolNumber, 128
			have6 = true
		} else {
			have4 = true
		}
		pa := tcpip.ProtocolAddress{
			Protocol:          proto,
			AddressWithPrefix: tcpip.AddressWithPrefix{Address: tcpip.AddrFromSlice(a.AsSlice()), PrefixLen: bits},
		}
		if err := s.AddProtocolAddress(nicID, pa, stack.AddressProperties{}); err != nil {
			return fail(fmt.Sprintf("adding %v", a), err)
		}
	}
	// Everything goes to the bridge, which routes with the kernel's tables.
	var routes []tcpip.Route
	if have4 {
		routes = append(routes, tcpip.Route{Destination: header.IPv4EmptySubnet, NIC: nicID})
	}
	if have6 {
		routes = append(routes, tcpip.Route{Destination: header.IPv6EmptySubnet, NIC: nicID})
	}
	s.SetRouteTable(routes)
	return s, nil
}
