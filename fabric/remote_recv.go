package fabric

import (
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// loop receives batches with recvmmsg, demultiplexes them by VNI, refuses
// and counts what does not belong, publishes credits periodically and
// watches the peers.
func (r *Remote) loop() {
	defer close(r.done)
	tick := r.cfg.CreditInterval
	next := time.Now().Add(tick)
	ms := int((tick + time.Millisecond - 1) / time.Millisecond)
	for !r.closed.Load() {
		r.pfd[0] = unix.PollFd{Fd: int32(r.fd), Events: unix.POLLIN}
		unix.Poll(r.pfd[:], ms)
		r.loopMu.Lock()
		r.now = time.Now()
		if r.pfd[0].Revents&unix.POLLERR != 0 {
			r.readErrors()
		}
		for {
			for i := range r.msgs {
				r.msgs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
				r.msgs[i].Hdr.Flags = 0
				if r.gro {
					r.msgs[i].Hdr.Control = &r.ctrl[i][0]
					r.msgs[i].Hdr.SetControllen(len(r.ctrl[i]))
				}
			}
			n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(r.fd), uintptr(unsafe.Pointer(&r.msgs[0])), remoteBatch, unix.MSG_DONTWAIT, 0, 0)
			if errno != 0 || n == 0 {
				break // EAGAIN, or a pending ICMP error reported once
			}
			m := *r.streams.Load()
			for i := 0; i < int(n); i++ {
				r.deliver(m, i)
			}
			r.flush() // the next recvmmsg overwrites the buffers
			if int(n) < remoteBatch {
				break
			}
		}
		if !r.now.Before(next) {
			r.tick()
			next = r.now.Add(tick)
		}
		r.loopMu.Unlock()
	}
}

// groSize returns the segment size of a coalesced datagram, or 0.
func (r *Remote) groSize(i int) int {
	h := &r.msgs[i].Hdr
	if !r.gro || h.Controllen < uint64(unix.CmsgLen(4)) {
		return 0
	}
	c := r.ctrl[i][:h.Controllen]
	for len(c) >= unix.SizeofCmsghdr {
		ch := (*unix.Cmsghdr)(unsafe.Pointer(&c[0]))
		l := int(ch.Len)
		if l < unix.SizeofCmsghdr || l > len(c) {
			return 0
		}
		if ch.Level == unix.SOL_UDP && ch.Type == unix.UDP_GRO && l >= unix.CmsgLen(4) {
			return int(*(*int32)(unsafe.Pointer(&c[unix.SizeofCmsghdr])))
		}
		c = c[min(len(c), unix.CmsgSpace(l-unix.SizeofCmsghdr)):]
	}
	return 0
}

func (r *Remote) deliver(m map[uint32]*RemoteStream, i int) {
	h := &r.msgs[i]
	if h.Hdr.Flags&unix.MSG_TRUNC != 0 {
		r.malformed.Add(1)
		return
	}
	b := r.bufs[i][:h.Len]
	seg := r.groSize(i)
	if seg <= 0 || seg >= len(b) {
		r.deliverOne(m, b, &r.names[i], h.Hdr.Namelen)
		return
	}
	r.coalesced.Add(1)
	for len(b) > 0 {
		k := min(seg, len(b))
		r.deliverOne(m, b[:k], &r.names[i], h.Hdr.Namelen)
		b = b[k:]
	}
}

func (r *Remote) deliverOne(m map[uint32]*RemoteStream, b []byte, name *unix.RawSockaddrInet6, nameLen uint32) {
	g, err := parseGeneve(b)
	if err != nil {
		r.malformed.Add(1)
		return
	}
	s := m[g.vni]
	if s == nil {
		r.wrongVNI.Add(1)
		return
	}
	if !s.peer.same(name, nameLen) {
		r.wrongSource.Add(1)
		return
	}
	s.heard, s.lastRx = true, r.now
	if g.hasCredit {
		if s.gate.update(g.credit, s.sentCount()) {
			r.credits.Add(1)
			select {
			case s.creditCh <- struct{}{}:
			default:
			}
		} else {
			r.badCredits.Add(1)
		}
	}
	if g.goodbye {
		if s == r.cur {
			r.flush() // the peer's last packets are queued before it is gone
		}
		s.markBroken(fmt.Errorf("%w: peer %v closed stream %d", ErrPeerGone, s.peerAP, s.vni))
	}
	if g.control {
		return
	}
	if s.closed.Load() || s.broken.Load() {
		r.dead.Add(1)
		return
	}
	if len(g.payload) > s.MaxPayload() {
		r.malformed.Add(1)
		return
	}
	if s != r.cur || r.nh == len(r.held) {
		r.flush()
		r.cur = s
	}
	r.held[r.nh] = g.payload
	r.heldMeta[r.nh] = g.marks
	r.nh++
}

// flush queues the held packets into their stream's receive queue with one
// Produce (one release store, at most one wake-up), as the bridge's
// dispatcher delivers a batch per stream. What does not fit is dropped and
// counted: the peer ignored its credit.
func (r *Remote) flush() {
	if r.nh == 0 {
		return
	}
	s, k := r.cur, r.nh
	r.cur, r.nh = nil, 0
	n, _ := s.rxP.ProduceMeta(r.held[:k], r.heldMeta[:k])
	if lost := k - n; lost > 0 {
		r.overflow.Add(uint64(lost))
		s.dropped.Add(uint64(lost))
	}
	if n > 0 {
		r.received.Add(uint64(n))
	}
	clear(r.held[:k]) // do not keep the receive buffers reachable through it
}
