package fabric

import (
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// tick runs every CreditInterval: credits, keepalives, peer timeouts.
func (r *Remote) tick() {
	keep := r.cfg.PeerTimeout / 4
	for _, s := range *r.streams.Load() {
		if s.closed.Load() || s.broken.Load() {
			continue
		}
		force := r.now.Sub(s.lastKeep) >= keep
		if s.publish(false, force) {
			s.lastKeep = r.now
		}
		if silent := r.now.Sub(s.lastRx); silent > r.cfg.PeerTimeout {
			s.markBroken(fmt.Errorf("%w: nothing from %v on stream %d for %v", ErrPeerGone, s.peerAP, s.vni, silent.Round(time.Millisecond)))
		}
	}
}

func (s *RemoteStream) sentCount() uint32 { return uint32(s.sent.Load()) }

// publish announces how much this side has consumed if that changed (from
// Recv: only once it grew by half the hysteresis band), or in any case
// when force is set (a keepalive). It reports whether it sent.
func (s *RemoteStream) publish(fromRecv, force bool) bool {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	c := s.consumed.Load() // under the lock, so published values never go back
	if !force {
		if c == s.pubbed {
			return false
		}
		if fromRecv && c-s.pubbed < uint32(s.r.cfg.High-s.r.cfg.Low)/2 {
			return false
		}
	}
	putCredit(s.pubBuf[:], s.vni, c)
	if s.sendCtl(s.pubBuf[:]) {
		s.pubbed = c
		return true
	}
	return false
}

// sendCtl sends one control datagram to the peer.
func (s *RemoteStream) sendCtl(b []byte) bool {
	_, _, errno := unix.Syscall6(unix.SYS_SENDTO, uintptr(s.r.fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), 0,
		uintptr(unsafe.Pointer(&s.peer.sa)), uintptr(s.peer.len))
	return errno == 0
}
