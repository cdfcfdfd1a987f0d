package topology

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"
)

// ICMP message types used by Ping.
const (
	icmp4EchoRequest = 8
	icmp4EchoReply   = 0
	icmp6EchoRequest = 128
	icmp6EchoReply   = 129
)

// Limits on Ping, so that a wrong argument cannot turn a test into a flood or
// a hang.
const (
	maxPingCount   = 1000
	maxPingTimeout = time.Minute
)

// Ping sends count ICMP (or ICMPv6) echo requests from inside n to dst and
// reports how many distinct ones were answered within timeout, which bounds
// the whole call. Requests go out one at a time, each after the previous
// reply or after its share (timeout/count) of the time, so a healthy link
// answers in well under a millisecond per probe. The error is non-nil
// whenever fewer than count replies came back, so `if _, err := ...` is a
// complete connectivity check.
//
// There is no ping binary to rely on, and the kernel's unprivileged ICMP
// sockets are disabled by default in a new namespace (ping_group_range), so
// this builds echo packets itself and uses a raw socket, which needs
// CAP_NET_RAW. dst must be in 198.18.0.0/15, 2001:db8::/32 or loopback.
func (n *NS) Ping(dst netip.Addr, count int, timeout time.Duration) (received int, err error) {
	dst = dst.Unmap()
	if err := checkPingTarget(dst); err != nil {
		return 0, err
	}
	if count < 1 || count > maxPingCount {
		return 0, fmt.Errorf("netns: ping count %d outside 1..%d", count, maxPingCount)
	}
	if timeout <= 0 || timeout > maxPingTimeout {
		return 0, fmt.Errorf("netns: ping timeout %v outside (0, %v]", timeout, maxPingTimeout)
	}
	network, request, reply := "ip4:icmp", byte(icmp4EchoRequest), byte(icmp4EchoReply)
	if dst.Is6() {
		network, request, reply = "ip6:ipv6-icmp", icmp6EchoRequest, icmp6EchoReply
	}
	var conn net.PacketConn
	err = n.Do(func() (err error) {
		conn, err = net.ListenPacket(network, "")
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("netns: ping from %s: %w", n.Name, err)
	}
	defer conn.Close()

	// A raw socket sees every ICMP message in the namespace, including other
	// pings and, for a local destination, our own requests; the identifier,
	// a random token in the payload and the source address pick out ours.
	var token [16]byte
	_, _ = rand.Read(token[:])
	id := binary.BigEndian.Uint16(token[:])
	to := &net.IPAddr{IP: dst.AsSlice()}

	start := time.Now()
	got := make([]bool, count)
	buf := make([]byte, 1500)
	for seq := range count {
		msg := echo(request, id, uint16(seq), token[:])
		if _, err := conn.WriteTo(msg, to); err != nil {
			return received, fmt.Errorf("netns: ping %v from %s: %w", dst, n.Name, err)
		}
		probeEnd := start.Add(timeout * time.Duration(seq+1) / time.Duration(count))
		if err := conn.SetReadDeadline(probeEnd); err != nil {
			return received, err
		}
		for !got[seq] {
			m, from, err := conn.ReadFrom(buf)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break
			}
			if err != nil {
				return received, fmt.Errorf("netns: ping %v from %s: %w", dst, n.Name, err)
			}
			src, ok := netip.AddrFromSlice(from.(*net.IPAddr).IP)
			if !ok || src.Unmap() != dst {
				continue
			}
			s, ok := parseEcho(buf[:m], reply, id, token[:])
			if ok && int(s) < count && !got[s] {
				got[s] = true
				received++
			}
		}
	}
	if received < count {
		return received, fmt.Errorf("netns: ping %v from %s: %d of %d echo requests answered within %v",
			dst, n.Name, received, count, timeout)
	}
	return received, nil
}

// checkPingTarget keeps Ping inside the ranges this package hands out.
func checkPingTarget(dst netip.Addr) error {
	if dst.IsLoopback() || bench4.Contains(dst) || bench6.Contains(dst) {
		return nil
	}
	return fmt.Errorf("netns: refusing to ping %v: only 198.18.0.0/15, 2001:db8::/32 and loopback", dst)
}

// echo builds an ICMP or ICMPv6 echo message. For ICMPv6 the checksum is left
// zero: it covers a pseudo-header with the source address, which only the
// kernel knows, and Linux fills it in on raw ICMPv6 sockets.
func echo(typ byte, id, seq uint16, payload []byte) []byte {
	b := make([]byte, 8+len(payload))
	b[0] = typ
	binary.BigEndian.PutUint16(b[4:], id)
	binary.BigEndian.PutUint16(b[6:], seq)
	copy(b[8:], payload)
	if typ == icmp4EchoRequest {
		binary.BigEndian.PutUint16(b[2:], checksum(b))
	}
	return b
}

// parseEcho returns the sequence number of b if it is an echo reply of the
// given type carrying our identifier and payload.
func parseEcho(b []byte, typ byte, id uint16, payload []byte) (seq uint16, ok bool) {
	if len(b) < 8 || b[0] != typ || b[1] != 0 || binary.BigEndian.Uint16(b[4:]) != id {
		return 0, false
	}
	if !bytes.Equal(b[8:], payload) {
		return 0, false
	}
	return binary.BigEndian.Uint16(b[6:]), true
}

// checksum is the Internet checksum (RFC 1071) of b.
func checksum(b []byte) uint16 {
	var sum uint32
	for len(b) >= 2 {
		sum += uint32(b[0])<<8 | uint32(b[1])
		b = b[2:]
	}
	if len(b) == 1 {
		sum += uint32(b[0]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
