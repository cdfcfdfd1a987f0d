package userstack

import (
	"encoding/binary"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// verdict is what the receive path's check found.
type verdict uint8

const (
	verified   verdict = iota // headers sane, every checksum right: the stack may skip them
	unverified                // not checkable here (fragment, extension headers, unknown protocol, odd lengths): the stack checks it
	corrupt                   // a checksum is wrong: drop
)

// check verifies an IP packet's checksums in one pass over it: the IPv4
// header checksum and the TCP, UDP, ICMP or ICMPv6 checksum with its
// pseudo-header. Whatever it cannot judge on its own is left to the stack,
// which then does its usual checks (see LinkEndpoint).
func check(p []byte) verdict {
	if len(p) < header.IPv4MinimumSize {
		return unverified
	}
	var l4 []byte
	var proto uint8
	var src, dst tcpip.Address
	switch p[0] >> 4 {
	case 4:
		ihl := int(p[0]&0xf) * 4
		total := int(binary.BigEndian.Uint16(p[2:]))
		if ihl < header.IPv4MinimumSize || total < ihl || total > len(p) {
			return unverified
		}
		ip := header.IPv4(p)
		if ip.More() || ip.FragmentOffset() != 0 {
			return unverified // the L4 checksum covers the reassembled datagram
		}
		if checksum.Checksum(p[:ihl], 0) != 0xffff {
			return corrupt
		}
		l4, proto = p[ihl:total], p[9]
		src, dst = ip.SourceAddress(), ip.DestinationAddress()
	case 6:
		if len(p) < header.IPv6MinimumSize {
			return unverified
		}
		total := header.IPv6MinimumSize + int(binary.BigEndian.Uint16(p[4:]))
		if total > len(p) {
			return unverified
		}
		ip := header.IPv6(p)
		l4, proto = p[header.IPv6MinimumSize:total], p[6]
		src, dst = ip.SourceAddress(), ip.DestinationAddress()
	default:
		return unverified
	}
	pseudo := true
	switch tcpip.TransportProtocolNumber(proto) {
	case header.TCPProtocolNumber:
		if len(l4) < header.TCPMinimumSize {
			return unverified
		}
	case header.UDPProtocolNumber:
		if len(l4) < header.UDPMinimumSize || int(binary.BigEndian.Uint16(l4[4:])) != len(l4) {
			return unverified
		}
		if binary.BigEndian.Uint16(l4[6:]) == 0 {
			if p[0]>>4 == 4 {
				return verified // IPv4 UDP without a checksum
			}
			return corrupt // IPv6 requires one
		}
	case header.ICMPv4ProtocolNumber:
		if p[0]>>4 != 4 {
			return unverified
		}
		pseudo = false
	case header.ICMPv6ProtocolNumber:
		if p[0]>>4 != 6 {
			return unverified
		}
	default:
		return unverified
	}
	var x uint16
	if pseudo {
		x = header.PseudoHeaderChecksum(tcpip.TransportProtocolNumber(proto), src, dst, uint16(len(l4)))
	}
	if checksum.Checksum(l4, x) != 0xffff {
		return corrupt
	}
	return verified
}

// isICMPError tells whether p is an ICMP error (destination unreachable,
// time exceeded, parameter problem; for IPv6 also packet too big) directly
// after the IP header, the kind the bridge steers to the application whose
// packet it quotes.
func isICMPError(p []byte) bool {
	if len(p) < header.IPv4MinimumSize {
		return false
	}
	switch p[0] >> 4 {
	case 4:
		ihl := int(p[0]&0xf) * 4
		if p[9] != uint8(header.ICMPv4ProtocolNumber) || len(p) <= ihl {
			return false
		}
		switch header.ICMPv4Type(p[ihl]) {
		case header.ICMPv4DstUnreachable, header.ICMPv4TimeExceeded, header.ICMPv4ParamProblem:
			return true
		}
	case 6:
		if len(p) <= header.IPv6MinimumSize || p[6] != uint8(header.ICMPv6ProtocolNumber) {
			return false
		}
		switch header.ICMPv6Type(p[header.IPv6MinimumSize]) {
		case header.ICMPv6DstUnreachable, header.ICMPv6PacketTooBig, header.ICMPv6TimeExceeded, header.ICMPv6ParamProblem:
			return true
		}
	}
	return false
}
