package bridge

// Segmentation offload on the AF_XDP copy path.
//
// An AF_XDP descriptor is one frame with no offload request, so a 4 KiB
// answer of a user-space stack leaves as three MSS-sized frames: three
// skbs the kernel builds, three the peer's stack receives. The kernel's own
// TCP would hand the device one skb with a segmentation request, which a
// TSO NIC cuts in hardware and a veth passes whole to its peer. In copy
// mode the kernel copies every AF_XDP frame into an skb anyway, so sending
// through a packet socket with a virtio-net header costs no more per skb:
// a flush that holds consecutive segments of one TCP connection joins
// them back into one such packet and sends the whole flush through the
// packet socket, in order.

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/fabricbridge/fabricbridge/bridge/features"
)

// The virtio-net header a packet socket with PACKET_VNET_HDR reads in
// front of every frame (struct virtio_net_hdr, little-endian on the hosts
// this builds for).
const (
	vnetHdrLen       = 10
	vnetNeedsCsum    = 1 // VIRTIO_NET_HDR_F_NEEDS_CSUM
	vnetGSOTCPv4     = 1 // VIRTIO_NET_HDR_GSO_TCPV4
	vnetGSOTCPv6     = 4 // VIRTIO_NET_HDR_GSO_TCPV6
	tcpChecksumField = 16
)

// Bounds on one joined packet: the IP length fields are 16 bits, and a
// run of more segments buys nothing the batch does not. Below
// gsoMinSegment (IPv4's default MSS) a run is cut at a size some devices
// refuse to segment at (drivers that check have minimums of 64 bytes and
// more), and the bypass loses what the device refuses; so a run whose
// first segment is smaller takes nothing that would need cutting, only a
// bare FIN.
const (
	gsoMaxBytes    = 65535
	gsoMaxSegments = 64
	gsoMinSegment  = 536
)

// tcpSeg is what joining needs to know of one frame: where its headers
// end and its payload's length. hdr is 0 for a frame that is not a
// plain TCP segment over untagged Ethernet (never joined).
type tcpSeg struct {
	l3, l4, hdr int // offsets of the IP header, the TCP header, the payload
	payload     int
	v6          bool
}

// parseSeg reads f's headers. The frame passed the bridge's verification,
// so lengths agree with the frame; what is checked here is only whether
// it is a segment joining can handle.
func parseSeg(f []byte) tcpSeg {
	const l3 = ethHeader
	if len(f) < l3+header.IPv4MinimumSize+header.TCPMinimumSize {
		return tcpSeg{}
	}
	var s tcpSeg
	switch binary.BigEndian.Uint16(f[12:]) {
	case 0x0800:
		ip := header.IPv4(f[l3:])
		// No options, no fragments: the header is copied as it is.
		if ip[0] != 0x45 || ip.Protocol() != uint8(header.TCPProtocolNumber) || ip.More() || ip.FragmentOffset() != 0 {
			return tcpSeg{}
		}
		if int(ip.TotalLength()) != len(f)-l3 {
			return tcpSeg{}
		}
		s.l4 = l3 + header.IPv4MinimumSize
	case 0x86dd:
		if len(f) < l3+header.IPv6MinimumSize+header.TCPMinimumSize {
			return tcpSeg{}
		}
		ip := header.IPv6(f[l3:])
		if ip.NextHeader() != uint8(header.TCPProtocolNumber) || int(ip.PayloadLength()) != len(f)-l3-header.IPv6MinimumSize {
			return tcpSeg{}
		}
		s.l4, s.v6 = l3+header.IPv6MinimumSize, true
	default:
		return tcpSeg{}
	}
	off := int(header.TCP(f[s.l4:]).DataOffset())
	if off < header.TCPMinimumSize || s.l4+off > len(f) {
		return tcpSeg{}
	}
	s.l3, s.hdr = l3, s.l4+off
	s.payload = len(f) - s.hdr
	return s
}

// joins reports whether segment b, right after a in the flush, continues
// it in one offload packet whose segment size is mss: the same Ethernet
// and IP headers but for the lengths, ID and checksum, the same TCP header
// but for the sequence number (which follows a's data), the flags and the
// checksum; a carries ACK and at most PSH, b at most PSH and FIN beside
// ACK, and b's data fits a segment. b may be a bare FIN: the closing
// segment that follows an answer leaves on the answer's last segment, as
// the kernel's TCP sets FIN on a segment still queued.
//
// a need not be a whole segment. The device cuts the packet at mss
// whatever the runs it was joined from, so a short segment followed by
// more data (the end of one write and the next write, as net/http's
// answer and its closing flush) leaves as fewer, fuller segments: the
// same bytes and sequence numbers, PSH only on the last, which is what
// the kernel's own TCP does with writes that meet in its send queue.
func joins(a, b []byte, sa, sb tcpSeg, mss int) bool {
	if sb.hdr != sa.hdr || sb.v6 != sa.v6 || sa.payload == 0 || sb.payload > mss {
		return false
	}
	if string(a[:ethHeader]) != string(b[:ethHeader]) {
		return false
	}
	ia, ib := a[sa.l3:sa.l4], b[sb.l3:sb.l4]
	if sa.v6 {
		// Version, class, flow label; next header, hop limit, addresses.
		if string(ia[:4]) != string(ib[:4]) || string(ia[6:]) != string(ib[6:]) {
			return false
		}
	} else {
		// TOS; flags and fragment offset, TTL, protocol; addresses.
		if ia[1] != ib[1] || string(ia[6:10]) != string(ib[6:10]) || string(ia[12:]) != string(ib[12:]) {
			return false
		}
	}
	ta, tb := header.TCP(a[sa.l4:sa.hdr]), header.TCP(b[sb.l4:sb.hdr])
	if fa := ta.Flags(); fa&header.TCPFlagAck == 0 || fa&^(header.TCPFlagAck|header.TCPFlagPsh) != 0 {
		return false
	}
	fb := tb.Flags()
	if fb&header.TCPFlagAck == 0 || fb&^(header.TCPFlagAck|header.TCPFlagPsh|header.TCPFlagFin) != 0 {
		return false
	}
	if sb.payload == 0 && fb&header.TCPFlagFin == 0 {
		return false // a pure ACK
	}
	if tb.SequenceNumber() != ta.SequenceNumber()+uint32(sa.payload) {
		return false
	}
	// Ports and acknowledgment; data offset; window; options.
	return string(ta[:4]) == string(tb[:4]) && string(ta[8:13]) == string(tb[8:13]) &&
		string(ta[14:16]) == string(tb[14:16]) && string(ta[18:]) == string(tb[18:])
}

// segOffload sends a flush of frames through a packet socket, joining
// runs of segments into offload packets. Its buffers are sized once for
// the most frames a flush holds; sending allocates nothing.
type segOffload struct {
	fd     int
	segs   []tcpSeg
	vnet   [][vnetHdrLen]byte
	iovs   []unix.Iovec
	msgs   []unix.Mmsghdr
	names  []unix.RawSockaddrLinklayer
	name   unix.RawSockaddrLinklayer // the interface; each message adds its EtherType
	frames [][]byte                  // a flush's frames, for plan and send
	joined atomic.Uint64             // frames sent as part of an offload packet
	lost   atomic.Uint64             // frames a failed send lost
	sent   atomic.Uint64             // frames sent, joined or not
}

// offloadCounts are a TX port's packet-socket counters (QueueStats).
type offloadCounts struct{ joined, lost, sent uint64 }

// newSegOffload opens a packet socket on ifindex, in the calling thread's
// network namespace, that sends frames with a virtio-net header and
// bypasses the qdisc (as AF_XDP does). maxFrames bounds one flush.
func newSegOffload(ifindex, maxFrames int) (*segOffload, error) {
	// Protocol 0: the socket receives nothing.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("segmentation offload: packet socket: %w", err)
	}
	for _, o := range []struct {
		name string
		opt  int
	}{{"PACKET_VNET_HDR", unix.PACKET_VNET_HDR}, {"PACKET_QDISC_BYPASS", unix.PACKET_QDISC_BYPASS}} {
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, o.opt, 1); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("segmentation offload: %s: %w", o.name, err)
		}
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifindex}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("segmentation offload: bind: %w", err)
	}
	// A flush of whole frames must not meet a full send buffer: the skbs
	// of one flush are charged to the socket until the device is done.
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, 4<<20)
	o := &segOffload{
		fd:     fd,
		segs:   make([]tcpSeg, maxFrames),
		frames: make([][]byte, maxFrames),
		vnet:   make([][vnetHdrLen]byte, maxFrames),
		iovs:   make([]unix.Iovec, 2*maxFrames),
		msgs:   make([]unix.Mmsghdr, maxFrames),
		names:  make([]unix.RawSockaddrLinklayer, maxFrames),
		name:   unix.RawSockaddrLinklayer{Family: unix.AF_PACKET, Ifindex: int32(ifindex), Halen: 6},
	}
	return o, nil
}

func (o *segOffload) close() {
	if o.fd >= 0 {
		unix.Close(o.fd)
		o.fd = -1
	}
}

// The device's segmentation offloads, as segOffload.plan takes them.
const (
	tsoIPv4 = 1 << iota // tx-tcp-segmentation
	tsoIPv6             // tx-tcp6-segmentation
	tsoRead             // set once the features have been read
)

// plan parses the frames and reports whether any two of them join; only
// then is the flush worth taking off the AF_XDP ring. tso says which
// families the device segments: with qdisc bypass the kernel drops an
// offload packet it would have to cut in software.
func (o *segOffload) plan(frames [][]byte, tso uint32) bool {
	join := false
	for i, f := range frames {
		s := parseSeg(f)
		if fam := uint32(tsoIPv4); s.hdr != 0 {
			if s.v6 {
				fam = tsoIPv6
			}
			if tso&fam == 0 {
				s = tcpSeg{} // sent as it is
			}
		}
		o.segs[i] = s
		if i > 0 && !join && o.segs[i-1].hdr != 0 && o.segs[i].hdr != 0 &&
			joins(frames[i-1], f, o.segs[i-1], o.segs[i], o.segs[i-1].payload) {
			join = true
		}
	}
	return join
}

// send sends frames, which plan has parsed, in order: each run of joining
// segments as one offload packet, every other frame as it is. It reports
// how many frames were sent; the rest are lost as a NIC's full queue
// loses them, and TCP sends them again.
func (o *segOffload) send(frames [][]byte) int {
	nmsg, niov := 0, 0
	for i := 0; i < len(frames); {
		f, s := frames[i], o.segs[i]
		j, total := i+1, len(f)-s.l3 // total: the IP packet the run becomes
		if s.hdr != 0 {
			for j < len(frames) && j-i < gsoMaxSegments && o.segs[j].hdr != 0 &&
				total+o.segs[j].payload <= gsoMaxBytes &&
				(s.payload >= gsoMinSegment || o.segs[j].payload == 0) &&
				joins(frames[j-1], frames[j], o.segs[j-1], o.segs[j], s.payload) {
				total += o.segs[j].payload
				j++
			}
		}
		vh := &o.vnet[nmsg]
		*vh = [vnetHdrLen]byte{}
		o.iovs[niov] = iovec(vh[:])
		o.iovs[niov+1] = iovec(f)
		first := niov
		niov += 2
		if j-i > 1 {
			for k := i + 1; k < j; k++ {
				o.iovs[niov] = iovec(frames[k][o.segs[k].hdr:])
				niov++
			}
			o.head(f, s, frames[j-1], o.segs[j-1], total-(s.hdr-s.l3), vh)
			o.joined.Add(uint64(j - i))
		}
		// The EtherType as the frame has it, in network order: the
		// kernel takes the packet's protocol from the address.
		sa := &o.names[nmsg]
		*sa = o.name
		if len(f) >= ethHeader {
			sa.Protocol = uint16(f[12]) | uint16(f[13])<<8
		}
		o.msgs[nmsg].Hdr = unix.Msghdr{
			Name: (*byte)(unsafe.Pointer(sa)), Namelen: unix.SizeofSockaddrLinklayer,
			Iov: &o.iovs[first], Iovlen: uint64(niov - first),
		}
		nmsg++
		i = j
	}
	n := o.sendmmsg(nmsg)
	o.sent.Add(uint64(n))
	if n < len(frames) {
		o.lost.Add(uint64(len(frames) - n))
	}
	return n
}

// sendmmsg sends msgs[:n] and returns how many frames they carried went.
// A message the kernel refuses is lost alone: sendmmsg reports the error
// of the first message it could not send, and the rest are tried after it.
func (o *segOffload) sendmmsg(n int) (frames int) {
	for done := 0; done < n; {
		r, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(o.fd), uintptr(unsafe.Pointer(&o.msgs[done])), uintptr(n-done), unix.MSG_DONTWAIT, 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 || r == 0 {
			done++
			continue
		}
		for _, m := range o.msgs[done : done+int(r)] {
			frames += int(m.Hdr.Iovlen) - 1
		}
		done += int(r)
	}
	return frames
}

// head rewrites the first frame's headers into those of an offload packet
// of payload bytes in all, ending with last, and fills its virtio-net
// header: the lengths cover every segment, the segment size is the first
// one's, the flags are the last segment's (the device clears PSH and FIN
// on all but the last it cuts), and the TCP checksum is left partial,
// over the pseudo-header, for the device.
func (o *segOffload) head(f []byte, s tcpSeg, last []byte, sl tcpSeg, payload int, vh *[vnetHdrLen]byte) {
	l4len := s.hdr - s.l4 + payload
	t := header.TCP(f[s.l4:])
	t.SetFlags(uint8(header.TCP(last[sl.l4:]).Flags()))
	var gso byte
	if s.v6 {
		ip := header.IPv6(f[s.l3:])
		ip.SetPayloadLength(uint16(l4len))
		t.SetChecksum(header.PseudoHeaderChecksum(header.TCPProtocolNumber, ip.SourceAddress(), ip.DestinationAddress(), uint16(l4len)))
		gso = vnetGSOTCPv6
	} else {
		ip := header.IPv4(f[s.l3:])
		ip.SetTotalLength(uint16(s.l4 - s.l3 + l4len))
		ip.SetChecksum(0)
		ip.SetChecksum(^ip.CalculateChecksum())
		t.SetChecksum(header.PseudoHeaderChecksum(header.TCPProtocolNumber, ip.SourceAddress(), ip.DestinationAddress(), uint16(l4len)))
		gso = vnetGSOTCPv4
	}
	size := s.payload
	if payload <= size {
		// Data and a bare FIN: one segment, which needs only its checksum.
		gso, size = 0, 0
	}
	vh[0], vh[1] = vnetNeedsCsum, gso
	binary.LittleEndian.PutUint16(vh[2:], uint16(s.hdr))
	binary.LittleEndian.PutUint16(vh[4:], uint16(size))
	binary.LittleEndian.PutUint16(vh[6:], uint16(s.l4))
	binary.LittleEndian.PutUint16(vh[8:], tcpChecksumField)
}

// iovec describes b; an empty b (a bare FIN's payload) gives an empty
// entry, which keeps one entry per frame for the frame counts.
func iovec(b []byte) unix.Iovec {
	if len(b) == 0 {
		return unix.Iovec{}
	}
	v := unix.Iovec{Base: &b[0]}
	v.SetLen(len(b))
	return v
}

// tsoOf reads which families the device segments TCP for.
func tsoOf(f *features.Interface) uint32 {
	var tso uint32
	for _, x := range []struct {
		name string
		bit  uint32
	}{{"tx-tcp-segmentation", tsoIPv4}, {"tx-tcp6-segmentation", tsoIPv6}} {
		if st, err := f.Get(x.name); err == nil && st.Active {
			tso |= x.bit
		}
	}
	return tso
}
