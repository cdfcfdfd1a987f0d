package fabric

import (
	"fmt"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// readErrors drains the socket's error queue. An ICMP port unreachable
// names, as the original destination, a peer whose socket is gone: every
// stream to it that has heard from it breaks. Streams that have never
// heard from their peer ignore it, because a peer that has not started
// yet looks the same; PeerTimeout covers them. Rare, so it may allocate.
func (r *Remote) readErrors() {
	var data [64]byte
	var oob [256]byte
	for {
		_, oobn, _, from, err := unix.Recvmsg(r.fd, data[:], oob[:], unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if err != nil {
			return
		}
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			continue
		}
		refused := false
		for _, cm := range cms {
			isErr := (cm.Header.Level == unix.SOL_IP && cm.Header.Type == unix.IP_RECVERR) ||
				(cm.Header.Level == unix.SOL_IPV6 && cm.Header.Type == unix.IPV6_RECVERR)
			if isErr && len(cm.Data) >= int(unsafe.Sizeof(unix.SockExtendedErr{})) {
				ee := (*unix.SockExtendedErr)(unsafe.Pointer(&cm.Data[0]))
				refused = refused || unix.Errno(ee.Errno) == unix.ECONNREFUSED
			}
		}
		if !refused || from == nil {
			continue
		}
		dst := addrPortOf(from)
		if !r.v6 {
			dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
		}
		hit := false
		for _, s := range *r.streams.Load() {
			if s.peerAP == dst && s.heard {
				hit = true
				s.markBroken(fmt.Errorf("%w: %v answers port unreachable (stream %d)", ErrPeerGone, dst, s.vni))
			}
		}
		if hit {
			r.unreachable.Add(1)
		}
	}
}
