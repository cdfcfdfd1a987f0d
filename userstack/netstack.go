package userstack

import (
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv6"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

// nicID is the stack's interface to its bridge's stream; with several
// bridges, the one the stack routes through (the others' follow it).
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

// receiveBufferMax bounds a connection's receive buffer so that its window
// fits the link's receive queue: a local stream's RX ring drops what does
// not fit (the bridge never waits), and a window larger than the ring lets
// one burst overflow it whenever the application falls behind for a moment
// (measured: 0.7-2.6% of a bulk transfer's segments dropped and sent again
// with 8 MB buffers over a 1024-slot ring; none with the bound). gVisor
// advertises about half the free buffer, hence the factor 2. rxDepth 0
// means a link that does not drop (the remote transport is flow
// controlled by credits): the data-centre maximum.
func receiveBufferMax(rxDepth, mtu int) int {
	if rxDepth <= 0 {
		return tcpBufMax
	}
	return min(max(2*rxDepth*(mtu-header.IPv4MinimumSize-header.TCPMinimumSize), tcpBufMin), tcpBufMax)
}

// receiveBufferOption bounds TCP receive buffers at rcvMax.
func receiveBufferOption(rcvMax int) *tcpip.TCPReceiveBufferSizeRangeOption {
	return &tcpip.TCPReceiveBufferSizeRangeOption{Min: tcpBufMin, Default: min(tcpBufDefault, rcvMax), Max: rcvMax}
}

// tcpProbe, when a test sets it, sees every TCP endpoint's complete state
// after each segment it handles (gVisor's TCP probe). Nil in production.
var tcpProbe atomic.Pointer[tcp.TCPProbeFunc]

// newNetstack builds a gVisor stack over ep with the given addresses and
// the TCP settings above: SACK on (recovery by RFC 6675, not RACK), CUBIC,
// receive-buffer moderation up to rcvMax (see receiveBufferMax), no Nagle
// delay (Go's net package turns it off for every TCP connection too),
// TIME-WAIT ports reusable when safe, since ephemeral ports come from a
// bounded reserved range, and TIME-WAIT as long as the flow is held
// (timeWaitHold), not gVisor's minute.
func newNetstack(ep *LinkEndpoint, addrs []netip.Addr, rcvMax int) (*stack.Stack, error) {
	s := stack.New(stack.Options{
		NetworkProtocols: []stack.NetworkProtocolFactory{
			ipv4.NewProtocol,
			// No duplicate address detection, no MLD, no router
			// solicitations: the kernel behind the bridge owns those (and
			// the bridge would not let such packets out).
			ipv6.NewProtocolWithOptions(ipv6.Options{}),
		},
		TransportProtocols: []stack.TransportProtocolFactory{tcpFactory(), udp.NewProtocol},
		// The link endpoint loops the stack's traffic to itself back
		// and drops spoofs of its addresses (local.go), which gVisor's
		// HandleLocal does with a locked lookup per packet received.
		HandleLocal: false,
		Clock:       newMonotonicClock(),
	})
	ep.conns = s
	fail := func(what string, err tcpip.Error) (*stack.Stack, error) {
		s.Destroy()
		return nil, fmt.Errorf("userstack: %s: %v", what, err)
	}
	opts := []tcpip.SettableTransportProtocolOption{
		func() *tcpip.TCPSACKEnabled { v := tcpip.TCPSACKEnabled(true); return &v }(),
		receiveBufferOption(rcvMax),
		&tcpip.TCPSendBufferSizeRangeOption{Min: tcpBufMin, Default: tcpBufDefault, Max: tcpBufMax},
		func() *tcpip.TCPModerateReceiveBufferOption {
			v := tcpip.TCPModerateReceiveBufferOption(true)
			return &v
		}(),
		// CUBIC needs gVisor from September 2026 on: before, an ACK in
		// congestion avoidance could lower a small window to 0, and with
		// nothing in flight the connection stalled for good (no ACK to
		// open it, no timer running). TestChecksumsAreVerifiedInTheStack
		// found it, once in about 40 runs on a loaded machine.
		func() *tcpip.CongestionControlOption { v := tcpip.CongestionControlOption("cubic"); return &v }(),
		func() *tcpip.TCPDelayEnabled { v := tcpip.TCPDelayEnabled(false); return &v }(),
		// Loss recovery by duplicate ACKs and SACK (RFC 6675), not RACK.
		// gVisor's RACK turns a retransmission timeout after the loss of a
		// whole window (a bridge restart, a ring overflow) into one
		// segment per timeout: once the RTO's retransmission is ACKed,
		// RACK marks the rest lost and re-enters fast recovery, whose
		// retransmission loop stops at the send pointer the RTO rewound,
		// while the pipe, counted from the (empty) SACK scoreboard, keeps
		// every lost segment in flight and so closes the window to new
		// sends. A 16 MiB transfer across a restart crawled for over a
		// minute (TestStacksOutliveTheirBridge, about 1 run in 4 under
		// -race). Without RACK, slow start after the RTO sends again from
		// the rewound pointer, its window doubling every round trip.
		func() *tcpip.TCPRecovery { v := tcpip.TCPRecovery(0); return &v }(),
		func() *tcpip.TCPTimeWaitReuseOption { v := tcpip.TCPTimeWaitReuseGlobal; return &v }(),
		func() *tcpip.TCPTimeWaitTimeoutOption { v := tcpip.TCPTimeWaitTimeoutOption(timeWaitHold); return &v }(),
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
	if err := addNIC(s, nicID, ep, addrs); err != nil {
		s.Destroy()
		return nil, err
	}
	have4 := slices.ContainsFunc(addrs, netip.Addr.Is4)
	have6 := slices.ContainsFunc(addrs, netip.Addr.Is6)
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

// addNIC attaches ep to s as NIC id, with the application's addresses.
func addNIC(s *stack.Stack, id tcpip.NICID, ep *LinkEndpoint, addrs []netip.Addr) error {
	name := "fabric"
	if id != nicID {
		name = fmt.Sprintf("fabric%d", id-nicID)
	}
	opts := stack.NICOptions{Name: name}
	ep.local = newLocalAddrs(addrs)
	link := withHopTrace(ep)
	if link == stack.LinkEndpoint(ep) {
		// Tracing sees packets in the wrapper's WritePackets, which a
		// discipline of ours would bypass: it keeps gVisor's default.
		opts.QDisc = linkQDisc{ep}
	}
	if err := s.CreateNICWithOptions(id, link, opts); err != nil {
		return fmt.Errorf("userstack: creating NIC %d: %v", id, err)
	}
	for _, a := range addrs {
		proto, bits := ipv4.ProtocolNumber, 32
		if a.Is6() {
			proto, bits = ipv6.ProtocolNumber, 128
		}
		pa := tcpip.ProtocolAddress{
			Protocol:          proto,
			AddressWithPrefix: tcpip.AddressWithPrefix{Address: tcpip.AddrFromSlice(a.AsSlice()), PrefixLen: bits},
		}
		if err := s.AddProtocolAddress(id, pa, stack.AddressProperties{}); err != nil {
			return fmt.Errorf("userstack: adding %v to NIC %d: %v", a, id, err)
		}
	}
	return nil
}

func tcpFactory() stack.TransportProtocolFactory {
	if p := tcpProbe.Load(); p != nil {
		return tcp.NewProtocolProbe(*p)
	}
	return tcp.NewProtocol
}
