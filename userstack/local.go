package userstack

import (
	"net/netip"
	"slices"

	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// The stack runs with gVisor's HandleLocal off, and the link endpoint does
// its two jobs instead:
//
//   - A packet the stack sends to one of its own addresses never reaches
//     the bridge: the endpoint hands it back up (loopBack), as a kernel's
//     local route would.
//   - A packet from the bridge whose source is one of the stack's own
//     addresses is a spoof, since the stack's traffic to itself never
//     leaves it: the receive loop drops it (RxFromSelf).
//
// While HandleLocal is on, gVisor's IPv4 and IPv6 receive paths look every
// packet's source up among the NIC's addresses (docs/performance.md, "The
// stack's own addresses"); comparing it with one or two addresses here
// costs a few nanoseconds.

// localAddrs are a stack's own addresses, the same on each of its NICs and
// fixed before the first NIC attaches.
type localAddrs struct {
	v4 [][4]byte
	v6 [][16]byte
}

func newLocalAddrs(addrs []netip.Addr) localAddrs {
	var l localAddrs
	for _, a := range addrs {
		if a.Is4() {
			l.v4 = append(l.v4, a.As4())
		} else {
			l.v6 = append(l.v6, a.As16())
		}
	}
	return l
}

// fromSelf reports whether the IP packet p claims one of the addresses as
// its source. A packet too short to hold a source is not judged here.
func (l *localAddrs) fromSelf(p []byte) bool {
	switch {
	case p[0]>>4 == 4 && len(p) >= header.IPv4MinimumSize:
		return slices.Contains(l.v4, [4]byte(p[12:16]))
	case p[0]>>4 == 6 && len(p) >= header.IPv6MinimumSize:
		return slices.Contains(l.v6, [16]byte(p[8:24]))
	}
	return false
}

// has reports whether a is one of the addresses.
func (l *localAddrs) has(a tcpip.Address) bool {
	switch a.Len() {
	case 4:
		return slices.Contains(l.v4, a.As4())
	case 16:
		return slices.Contains(l.v6, a.As16())
	}
	return false
}

// toSelf reports whether the stack addressed pkt to one of its own
// addresses. gVisor sets the route's remote address on every packet it
// sends through a route; packets without one (neighbour protocols, which
// this link does not run) are never local.
func (e *LinkEndpoint) toSelf(pkt *stack.PacketBuffer) bool {
	return e.local.has(pkt.EgressRoute.RemoteAddress)
}

// loopBack hands a packet the stack sent to itself back up, as received.
// The packet is copied whole, since the stack keeps the views of what it
// sends for retransmission, and a TCP offload packet's partial checksum is
// completed: the receive path may check it (see Capabilities). It runs
// without the transmit lock, because delivering can make the stack send
// (an RST to a closed port, an ACK), which would take the lock again.
// Loopback traffic is a configuration's odd case (an application calling
// itself by its own address), so a copy is no concern.
func (e *LinkEndpoint) loopBack(pkt *stack.PacketBuffer) {
	e.mu.RLock()
	d := e.dispatcher
	e.mu.RUnlock()
	if d == nil {
		return
	}
	v := buffer.NewViewSize(pkt.Size())
	p := flatten(pkt, v.AsSlice())
	if pkt.GSOOptions.Type != stack.GSONone && pkt.GSOOptions.NeedsCsum {
		l3, _, ok := tcpHeaders(p)
		if !ok {
			v.Release()
			e.stats.txDropped.Add(1)
			return
		}
		finishTCP(p, l3)
	}
	in := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithView(v)})
	in.NetworkProtocolNumber = pkt.NetworkProtocolNumber
	d.DeliverNetworkPacket(in.NetworkProtocolNumber, in)
	in.DecRef()
	e.stats.txLooped.Add(1)
}
