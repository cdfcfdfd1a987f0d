package bridge

import (
	"context"
	"encoding/binary"
	"log/slog"
	"net/netip"
	"time"
)

// rejectLogBurst bounds the debug lines about refused packets to so many a
// second per loop: enough for an operator (or a failing test) to see every
// packet of a burst an application should not have sent, never a flood
// from one that sends nothing else.
const rejectLogBurst = 10

// The names are the metrics' reason labels (fabricbridge_stream_tx_rejects_total).
var reasonNames = [numReasons]string{
	accepted: "accepted", rejVersion: "version", rejHeader: "header_length", rejLength: "total_length",
	rejMTU: "mtu", rejSourceAddr: "source_addr", rejProtocol: "protocol", rejSourcePort: "source_port",
	rejSecondChance: "second_chance",
}

func (r reason) String() string {
	if r < numReasons {
		return reasonNames[r]
	}
	return "unknown"
}

// logReject says at debug level, for up to rejectLogBurst packets a second
// per loop, which packet stream e sent that was refused for r. Off the hot
// path: it runs only for refused packets, and returns at once unless debug
// is on.
func (t *txSide) logReject(e *streamEntry, r reason, p []byte) {
	if !t.b.log.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	if now := time.Now(); now.Sub(t.rejectLogSecond) >= time.Second {
		t.rejectLogSecond, t.rejectLogged = now, 0
	}
	if t.rejectLogged >= rejectLogBurst {
		return
	}
	t.rejectLogged++
	src, dst, proto, sport, dport, flags, ok := packetTuple(p)
	if !ok {
		t.b.log.Debug("bridge: refused a packet a stream sent", "stream", e.id, "reason", r, "bytes", len(p))
		return
	}
	t.b.log.Debug("bridge: refused a packet a stream sent", "stream", e.id, "reason", r, "bytes", len(p),
		"proto", proto, "src", netip.AddrPortFrom(src, sport), "dst", netip.AddrPortFrom(dst, dport), "tcp_flags", flags)
}

// tcpFlagNames spells a TCP header's flags as tcpdump does (S, F, R, P, .
// for ACK), FIN first.
func tcpFlagNames(f byte) string {
	var b []byte
	for i, c := range []byte("FSRP.U") {
		if f&(1<<i) != 0 {
			b = append(b, c)
		}
	}
	return string(b)
}

// packetTuple reads addresses, protocol and ports of an IP packet, the
// ports only where an unfragmented TCP or UDP header follows the fixed IP
// header (0 otherwise), and a TCP header's flags ("" otherwise).
func packetTuple(p []byte) (src, dst netip.Addr, proto uint8, sport, dport uint16, flags string, ok bool) {
	var l4 []byte
	switch {
	case len(p) >= 20 && p[0]>>4 == 4:
		ihl := int(p[0]&0xf) * 4
		src, dst, proto = netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20])), p[9]
		if ihl >= 20 && ihl <= len(p) && binary.BigEndian.Uint16(p[6:])&0x1fff == 0 {
			l4 = p[ihl:]
		}
	case len(p) >= 40 && p[0]>>4 == 6:
		src, dst, proto = netip.AddrFrom16([16]byte(p[8:24])), netip.AddrFrom16([16]byte(p[24:40])), p[6]
		l4 = p[40:]
	default:
		return src, dst, 0, 0, 0, "", false
	}
	if (proto == 6 || proto == 17) && len(l4) >= 4 {
		sport, dport = binary.BigEndian.Uint16(l4), binary.BigEndian.Uint16(l4[2:])
	}
	if proto == 6 && len(l4) >= 14 {
		flags = tcpFlagNames(l4[13])
	}
	return src, dst, proto, sport, dport, flags, true
}
