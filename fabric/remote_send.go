package fabric

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Send transmits packets (IPv4 or IPv6, starting at the IP header) with
// one sendmmsg per batch, waiting for credit when the peer's queue is at
// its high-water mark (backpressure, as on the shm TX ring). It returns
// len(pkts), or fewer and an error.
//
// With GSO, each run of packets of one length (and at most one shorter
// packet ending it) is a single sendmmsg entry that the kernel, or the
// NIC, cuts into one datagram per packet: the same datagrams on the wire,
// one pass through the stack instead of one per packet. A path that
// refuses a segment size (EMSGSIZE: it exceeds the MTU, where a single
// datagram would have been fragmented) makes the stream send that size
// and larger ones singly from then on.
func (s *RemoteStream) Send(pkts [][]byte) (int, error) { return s.send(pkts, nil, false) }

// SendMeta is Send with a metadata word per packet (meta may be nil), of
// which the marks (MarkMask) travel: see the marks option in geneve.go.
func (s *RemoteStream) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	return s.send(pkts, meta, false)
}

// send is Send, or with drop set the bridge's SendMeta (see RemoteBridge):
// instead of waiting for credit or socket buffer it drops the rest, and
// instead of failing on a packet it cannot send it drops that one, each
// counted.
func (s *RemoteStream) send(pkts [][]byte, meta []uint32, drop bool) (int, error) {
	if meta != nil && len(meta) < len(pkts) {
		panic("fabric: SendMeta: fewer metadata words than packets")
	}
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	flags := 0
	if drop {
		flags = unix.MSG_DONTWAIT
	}
	done, retries := 0, 0
	maxLen := s.MaxPayload()
loop:
	for done < len(pkts) {
		if err := s.Err(); err != nil {
			return done, err
		}
		allow := s.gate.allowance()
		if allow == 0 {
			if drop {
				break
			}
			s.stalls.Add(1)
			select {
			case <-s.creditCh:
			case <-s.dead:
			case <-s.r.done:
				return done, ErrClosed
			}
			continue
		}
		batch := pkts[done : done+min(allow, len(pkts)-done, remoteBatch)]
		var marks []uint32
		if meta != nil {
			marks = meta[done:]
		}
		ok := s.stage(batch, marks, maxLen)
		if ok < len(batch) && !drop {
			return done, fmt.Errorf("%w: packet %d is not an IP packet of at most %d bytes", ErrTooBig, done+ok, maxLen)
		}
		n, errno := 0, unix.Errno(0)
		if ok > 0 {
			n, errno = s.transmit(batch[:ok], flags)
			done += n
		}
		if n == ok && ok < len(batch) {
			s.dropped.Add(1) // batch[ok] cannot be sent
			done++
			continue
		}
		switch {
		case errno == 0 || errno == unix.EINTR:
		case !drop && (errno == unix.EAGAIN || errno == unix.ENOBUFS):
		case retries < 8 && icmpReported(errno):
			retries++
		case drop:
			break loop // EAGAIN, ENOBUFS: the socket's buffer is full
		default:
			return done, fmt.Errorf("fabric: sendmmsg to %v: %w", s.peerAP, errno)
		}
	}
	if lost := len(pkts) - done; lost > 0 {
		s.dropped.Add(uint64(lost)) // only a dropping send gets here short
	}
	return done, nil
}

// icmpReported reports an error that an ICMP message queued for the socket
// (IP_RECVERR) caused. It is reported once, by whichever call comes next,
// whatever peer it concerns; the loop reads the details, and the sender
// tries again.
func icmpReported(errno unix.Errno) bool {
	return errno == unix.ECONNREFUSED || errno == unix.EHOSTUNREACH ||
		errno == unix.ENETUNREACH || errno == unix.EHOSTDOWN || errno == unix.EMSGSIZE
}

// stage writes the GENEVE header and iovecs of each packet of batch, up to
// the first that is not an IP packet of at most maxLen bytes, and returns
// how many it staged. A packet whose metadata word (meta may be nil) has
// marks gets the marks option.
func (s *RemoteStream) stage(batch [][]byte, meta []uint32, maxLen int) int {
	for i, pkt := range batch {
		proto, ok := protoFor(pkt)
		if !ok || len(pkt) > maxLen {
			return i
		}
		var marks uint32
		if meta != nil {
			marks = meta[i] & MarkMask
		}
		if marks == 0 {
			putGeneve(s.shdrs[i][:], s.vni, proto, 0, false)
			s.shlen[i] = geneveHdrLen
		} else {
			putGeneve(s.shdrs[i][:], s.vni, proto, marksOptLen/4, false)
			putMarks(s.shdrs[i][:], marks)
			s.shlen[i] = geneveHdrLen + marksOptLen
		}
		s.siovs[2*i].SetLen(s.shlen[i])
		s.siovs[2*i+1].Base = &pkt[0]
		s.siovs[2*i+1].SetLen(len(pkt))
	}
	return len(batch)
}

// transmit sends a staged batch with one sendmmsg and returns how many
// packets left, with the error that stopped the rest. A GSO entry the path
// refuses (EMSGSIZE and the like: the segment size exceeds its MTU, where a
// single datagram would have been fragmented) lowers gsoLimit below that
// size and reports no error: the caller sends the rest again, singly.
func (s *RemoteStream) transmit(batch [][]byte, flags int) (int, unix.Errno) {
	k := len(batch)
	nmsg := s.group(batch)
	// Count the batch as sent before it leaves: the peer may consume and
	// credit it before sendmmsg returns, and a credit beyond the sent
	// count would be refused as forged.
	s.sent.Add(uint64(k))
	n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(s.r.fd), uintptr(unsafe.Pointer(&s.smsgs[0])), uintptr(nmsg), uintptr(flags), 0, 0)
	runtime.KeepAlive(batch)
	for i := range batch {
		s.siovs[2*i+1].Base = nil // do not keep the caller's buffers reachable
	}
	if errno != 0 {
		n = 0
	}
	left := 0
	for i := int(n); i < nmsg; i++ {
		left += s.scount[i]
	}
	for i := 0; i < int(n); i++ {
		if s.scount[i] > 1 {
			s.r.segmented.Add(1)
		}
	}
	if left > 0 {
		s.sent.Add(^uint64(left - 1)) // subtract what did not leave
	}
	s.gate.sent += uint32(k - left)
	if errno != 0 && s.scount[0] > 1 && (errno == unix.EMSGSIZE || errno == unix.EINVAL || errno == unix.EIO) {
		s.gsoLimit = s.shlen[0] + len(batch[0]) - 1
		errno = 0
	}
	return k - left, errno
}

// group lays out one batch (GENEVE headers and iovecs already filled)
// as sendmmsg entries and returns how many. Without GSO every packet is
// an entry; with it, a run of packets of one length, ended by at most
// one shorter packet, shares an entry with a UDP_SEGMENT control message,
// as the kernel requires (every segment full-sized but the last). A marked
// packet (a longer header) travels alone: the segments of an entry share
// the first one's header length.
func (s *RemoteStream) group(batch [][]byte) int {
	nmsg := 0
	for i := 0; i < len(batch); {
		seg := s.shlen[i] + len(batch[i])
		j := i + 1
		if s.r.gso && seg <= s.gsoLimit && s.shlen[i] == geneveHdrLen {
			total := seg
			for j < len(batch) && j-i < maxGSOSegs && s.shlen[j] == geneveHdrLen {
				l := geneveHdrLen + len(batch[j])
				if l > seg || total+l > maxDatagram {
					break
				}
				total += l
				j++
				if l < seg {
					break
				}
			}
		}
		h := &s.smsgs[nmsg].Hdr
		h.Iov = &s.siovs[2*i]
		h.SetIovlen(2 * (j - i))
		if j-i > 1 {
			c := &s.scmsg[nmsg]
			*(*uint16)(unsafe.Pointer(&c[unix.SizeofCmsghdr])) = uint16(seg)
			h.Control = &c[0]
			h.SetControllen(cmsgSegLen)
		} else {
			h.Control = nil
			h.SetControllen(0)
		}
		s.scount[nmsg] = j - i
		nmsg++
		i = j
	}
	return nmsg
}
