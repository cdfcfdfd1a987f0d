package userstack

import (
	"encoding/binary"
	"net/netip"
	"sync"
	"syscall"

	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// ICMPv6 destination unreachable, done as Linux does it (and IPv4's for
// UDP: adaptUnreach4 at the end).
//
// gVisor acts on two ICMPv6 destination unreachable codes only: no route
// (0, a TCP connect fails with ENETUNREACH) and port unreachable (4,
// ECONNREFUSED). The others — administratively prohibited (1), beyond the
// scope of the source (2), address unreachable (3), source address failed
// policy (5), reject route (6) and any later code — it counts and drops,
// so a TCP connect answered with one waits for its SYN retransmissions to
// time out. Linux fails a connect in SYN_SENT on any destination
// unreachable, with the errno of icmpv6_err_convert: ENETUNREACH for 0,
// EACCES for 1, 5 and 6, EHOSTUNREACH for 2 and 3, ECONNREFUSED for 4,
// EPROTO for unknown codes; a connected UDP socket reports the "fatal"
// ones (1, 4, 5, 6 and unknown codes) on its next call and ignores the
// rest.
//
// Without forking gVisor, the receive loop rewrites such an error, after
// it verified the packet, into a code gVisor acts on the same way — no
// route for TCP (gVisor then aborts a connecting endpoint, as Linux does,
// and keeps the error as a soft one on an established connection, as
// Linux does too), port unreachable for a fatal code on UDP — and notes,
// per quoted flow, the errno Linux would report. Dial and a UDP socket's
// calls swap the stand-in errno for the noted one (errors.go). The note
// is taken by the first call that reports the error, like a socket's
// pending error; a genuine no route or port unreachable for the same flow
// clears it, and the table is bounded (unreachNotesMax).

// unreachNotesMax bounds the noted flows; a note nobody took (the flow
// was an established TCP connection, whose error stays soft, or a socket
// that closed) is dropped when the table is full.
const unreachNotesMax = 64

// flowKey names a flow from the application's side. The local address
// is left out: a port of the stack with one peer names one flow.
type flowKey struct {
	proto     uint8 // header.TCPProtocolNumber or UDPProtocolNumber
	localPort uint16
	remote    netip.AddrPort
}

// unreachNotes are the errnos noted for flows whose ICMPv6 error was
// rewritten. Touched only when such an error arrives or a call reports
// one: never on the data path.
type unreachNotes struct {
	mu sync.Mutex
	m  map[flowKey]syscall.Errno
}

func (n *unreachNotes) put(k flowKey, errno syscall.Errno) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.m == nil {
		n.m = make(map[flowKey]syscall.Errno)
	}
	if _, ok := n.m[k]; !ok && len(n.m) >= unreachNotesMax {
		for old := range n.m {
			delete(n.m, old)
			break
		}
	}
	n.m[k] = errno
}

// take returns and forgets the errno noted for k.
func (n *unreachNotes) take(k flowKey) (syscall.Errno, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	errno, ok := n.m[k]
	if ok {
		delete(n.m, k)
	}
	return errno, ok
}

// unreach6Errno is Linux's icmpv6_err_convert for a destination
// unreachable with the given code: the errno, and whether a connected UDP
// socket reports it (Linux's "fatal").
func unreach6Errno(code uint8) (syscall.Errno, bool) {
	switch code {
	case 0:
		return syscall.ENETUNREACH, false
	case 1, 5, 6:
		return syscall.EACCES, true
	case 2, 3:
		return syscall.EHOSTUNREACH, false
	case 4:
		return syscall.ECONNREFUSED, true
	}
	return syscall.EPROTO, true
}

// icmpv6 destination unreachable layout: the ICMPv6 header (type, code,
// checksum, 4 unused bytes) after the IPv6 header, then the quoted packet.
const (
	unreach6Code   = header.IPv6MinimumSize + 1
	unreach6Quoted = header.IPv6MinimumSize + header.ICMPv6DstUnreachableMinimumSize
	// The quoted IPv6 header and the ports of the transport header after it.
	unreach6MinLen = unreach6Quoted + header.IPv6MinimumSize + 4
)

// adaptUnreach6 looks at a packet whose checksums the receive loop has
// verified. If it is an ICMPv6 destination unreachable quoting a TCP or
// UDP packet directly (no extension headers), it notes the errno Linux
// would report for that flow and, where gVisor would ignore the code,
// rewrites the code in place (keeping the checksum right). It returns
// whether it rewrote the packet.
func (n *unreachNotes) adaptUnreach6(p []byte) bool {
	if len(p) < unreach6MinLen || p[0]>>4 != 6 || p[6] != uint8(header.ICMPv6ProtocolNumber) ||
		header.ICMPv6Type(p[header.IPv6MinimumSize]) != header.ICMPv6DstUnreachable {
		return false
	}
	q := p[unreach6Quoted:]
	proto := q[6]
	if proto != uint8(header.TCPProtocolNumber) && proto != uint8(header.UDPProtocolNumber) {
		return false
	}
	qip := header.IPv6(q)
	l4 := q[header.IPv6MinimumSize:]
	k := flowKey{
		proto:     proto,
		localPort: binary.BigEndian.Uint16(l4),
		remote:    netip.AddrPortFrom(netip.AddrFrom16(qip.DestinationAddress().As16()), binary.BigEndian.Uint16(l4[2:])),
	}
	code := p[unreach6Code]
	errno, fatal := unreach6Errno(code)
	var to uint8
	switch {
	case code == uint8(header.ICMPv6NetworkUnreachable) || code == uint8(header.ICMPv6PortUnreachable):
		// gVisor's own errno is Linux's: an older note is stale.
		n.take(k)
		return false
	case proto == uint8(header.TCPProtocolNumber):
		to = uint8(header.ICMPv6NetworkUnreachable)
	case fatal: // UDP
		to = uint8(header.ICMPv6PortUnreachable)
	default:
		return false // a UDP socket ignores it on Linux too
	}
	n.put(k, errno)
	setICMPv6Code(p, to)
	return true
}

// setICMPv6Code changes the code of the ICMPv6 message in the IPv6
// packet p, keeping its checksum right.
func setICMPv6Code(p []byte, code uint8) { setICMPCode(p[header.IPv6MinimumSize:], code) }

// setICMPCode changes the code of the ICMP or ICMPv6 message m and updates
// its checksum incrementally (RFC 1624, eqn. 3): the type and code are the
// checksum's first 16-bit word, the checksum the second.
func setICMPCode(m []byte, code uint8) {
	old := binary.BigEndian.Uint16(m)
	m[1] = code
	new := binary.BigEndian.Uint16(m)
	sum := uint32(^binary.BigEndian.Uint16(m[2:])) + uint32(^old) + uint32(new)
	sum = (sum & 0xffff) + sum>>16
	sum = (sum & 0xffff) + sum>>16
	binary.BigEndian.PutUint16(m[2:], ^uint16(sum))
}

// unreach4Errno is Linux's icmp_err_convert for an IPv4 destination
// unreachable with the given code: the errno, and whether a connected UDP
// socket reports it (Linux's "fatal"). Codes past the table are neither.
func unreach4Errno(code uint8) (syscall.Errno, bool) {
	switch code {
	case 0, 11: // net unreachable, for TOS
		return syscall.ENETUNREACH, false
	case 1, 12: // host unreachable, for TOS
		return syscall.EHOSTUNREACH, false
	case 2:
		return syscall.ENOPROTOOPT, true
	case 3:
		return syscall.ECONNREFUSED, true
	case 4:
		return syscall.EMSGSIZE, false
	case 5:
		return syscall.EOPNOTSUPP, false
	case 6, 9: // net unknown, net administratively prohibited
		return syscall.ENETUNREACH, true
	case 7:
		return syscall.EHOSTDOWN, true
	case 8:
		return syscall.ENONET, true
	case 10, 13, 14, 15: // host prohibited, communication prohibited (filtered), precedence
		return syscall.EHOSTUNREACH, true
	}
	return syscall.EHOSTUNREACH, false
}

// adaptUnreach4 is adaptUnreach6 for IPv4 and UDP: gVisor acts on every
// IPv4 destination unreachable code for TCP (with Linux's errnos), but a
// UDP socket of gVisor's reports port unreachable only, where a connected
// Linux socket also reports the other "fatal" codes (administratively
// prohibited: EHOSTUNREACH). Those are handed to gVisor as port
// unreachable, with the errno noted.
func (n *unreachNotes) adaptUnreach4(p []byte) bool {
	if len(p) < header.IPv4MinimumSize || p[0]>>4 != 4 || p[9] != uint8(header.ICMPv4ProtocolNumber) {
		return false
	}
	ihl := int(p[0]&0xf) * 4
	if len(p) < ihl+header.ICMPv4MinimumSize+header.IPv4MinimumSize || header.ICMPv4Type(p[ihl]) != header.ICMPv4DstUnreachable {
		return false
	}
	q := p[ihl+header.ICMPv4MinimumSize:]
	qihl := int(q[0]&0xf) * 4
	if q[0]>>4 != 4 || q[9] != uint8(header.UDPProtocolNumber) || qihl < header.IPv4MinimumSize || len(q) < qihl+4 {
		return false
	}
	qip := header.IPv4(q)
	k := flowKey{
		proto:     uint8(header.UDPProtocolNumber),
		localPort: binary.BigEndian.Uint16(q[qihl:]),
		remote:    netip.AddrPortFrom(netip.AddrFrom4(qip.DestinationAddress().As4()), binary.BigEndian.Uint16(q[qihl+2:])),
	}
	code := p[ihl+1]
	errno, fatal := unreach4Errno(code)
	switch {
	case code == uint8(header.ICMPv4PortUnreachable):
		n.take(k) // gVisor's own errno is Linux's: an older note is stale
		return false
	case !fatal:
		return false
	}
	n.put(k, errno)
	setICMPCode(p[ihl:], uint8(header.ICMPv4PortUnreachable))
	return true
}
