package userstack

// An application's stack follows the wire's MTU as the kernel's sockets
// follow their interface's: the bridge pushes the new MTU (control's
// OnMTU), the link endpoint takes it (SetMTU), and
//
//   - new connections size their MSS by it, since gVisor reads the link's
//     MTU for every route it makes;
//   - connections already established, whose MSS was fixed at their
//     handshake, still send: the link cuts their segments to the new MTU
//     as a NIC's TSO would (segmentSize), and the peer takes the smaller
//     segments as any TCP does.
//
// Without it, a lowered MTU leaves the stack sending packets the bridge
// refuses (tx_rejects{reason="mtu"}) and its downloads stall.

// followMTU keeps s's link MTU at the bridge's, within the caller's cap,
// across every bridge the attachment reaches.
func (s *Stack) followMTU(a *attachment, capped int) {
	f := func(mtu int) { s.ep.SetMTU(uint32(mtuOf(mtu, capped, s.ep.maxPacket))) }
	a.mtu.Store(&f)
}

// watchMTU hands the MTUs that at's bridge pushes, and the one it
// registered with, to the stack's follower (once followMTU set it).
func (a *attachment) watchMTU(at attached, registered bool) {
	apply := func(mtu int) {
		if f := a.mtu.Load(); f != nil && mtu > 0 {
			(*f)(mtu)
		}
	}
	at.client.OnMTU(apply)
	if registered {
		apply(at.reg.MTU)
	}
}

// segmentSize is the TCP payload of one segment of an offload packet whose
// headers take hdr bytes: the stack's MSS for it, but never more than the
// link's MTU now carries (an MSS of 0 means the MTU's).
func (e *LinkEndpoint) segmentSize(mss, hdr int) int {
	lim := int(e.mtu.Load()) - hdr
	if mss <= 0 || mss > lim {
		return lim
	}
	return mss
}
