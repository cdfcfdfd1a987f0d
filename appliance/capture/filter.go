package capture

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Filter is a small subset of tcpdump's expression language, enough to
// narrow one stream's traffic: primitives joined by "and" (or just listed),
//
//	tcp | udp | icmp        the protocol
//	[src|dst] host ADDR     an address
//	[src|dst] port N        a TCP or UDP port
//
// Every primitive must match. The zero Filter matches everything.
type Filter struct {
	prims []prim
	text  string
}

type prim struct {
	kind  string // "proto", "host", "port"
	dir   string // "", "src", "dst"
	proto uint8
	addr  netip.Addr
	port  uint16
}

func (f Filter) String() string { return f.text }

// ParseFilter parses an expression; words may come as separate arguments
// joined by spaces.
func ParseFilter(expr string) (Filter, error) {
	f := Filter{text: strings.TrimSpace(expr)}
	words := strings.Fields(expr)
	for i := 0; i < len(words); i++ {
		w := strings.ToLower(words[i])
		if w == "and" || w == "&&" {
			continue
		}
		var p prim
		if w == "src" || w == "dst" {
			p.dir = w
			i++
			if i == len(words) {
				return Filter{}, fmt.Errorf("filter: %q needs host or port after it", w)
			}
			w = strings.ToLower(words[i])
		}
		switch w {
		case "tcp", "udp", "icmp", "icmp6":
			if p.dir != "" {
				return Filter{}, fmt.Errorf("filter: %s %s: a protocol has no direction", p.dir, w)
			}
			p.kind, p.proto = "proto", map[string]uint8{"tcp": 6, "udp": 17, "icmp": 1, "icmp6": 58}[w]
		case "host", "port":
			i++
			if i == len(words) {
				return Filter{}, fmt.Errorf("filter: %q needs a value", w)
			}
			p.kind = w
			if w == "host" {
				a, err := netip.ParseAddr(words[i])
				if err != nil {
					return Filter{}, fmt.Errorf("filter: host %q is not an IP address", words[i])
				}
				p.addr = a.Unmap()
			} else {
				n, err := strconv.ParseUint(words[i], 10, 16)
				if err != nil {
					return Filter{}, fmt.Errorf("filter: port %q is not a number 0-65535", words[i])
				}
				p.port = uint16(n)
			}
		case "or", "not", "||", "!":
			return Filter{}, fmt.Errorf("filter: %q is not supported: primitives can only be joined by and", w)
		default:
			return Filter{}, fmt.Errorf("filter: unknown word %q (want tcp, udp, icmp, [src|dst] host ADDR, [src|dst] port N, and)", words[i])
		}
		f.prims = append(f.prims, p)
	}
	return f, nil
}

// headers is what the filter looks at in one IP packet.
type headers struct {
	proto            uint8
	src, dst         netip.Addr
	sport, dport     uint16
	hasPorts, parsed bool
}

func parse(pkt []byte) (h headers) {
	if len(pkt) < 1 {
		return
	}
	var l4 []byte
	switch pkt[0] >> 4 {
	case 4:
		if len(pkt) < 20 {
			return
		}
		ihl := int(pkt[0]&15) * 4
		if ihl < 20 || len(pkt) < ihl {
			return
		}
		h.proto = pkt[9]
		h.src = netip.AddrFrom4([4]byte(pkt[12:16]))
		h.dst = netip.AddrFrom4([4]byte(pkt[16:20]))
		if binary.BigEndian.Uint16(pkt[6:8])&0x1fff == 0 { // not a later fragment
			l4 = pkt[ihl:]
		}
	case 6:
		if len(pkt) < 40 {
			return
		}
		h.proto = pkt[6]
		h.src = netip.AddrFrom16([16]byte(pkt[8:24]))
		h.dst = netip.AddrFrom16([16]byte(pkt[24:40]))
		l4 = pkt[40:] // extension headers are not walked: ports only without them
	default:
		return
	}
	h.parsed = true
	if (h.proto == 6 || h.proto == 17) && len(l4) >= 4 {
		h.sport, h.dport = binary.BigEndian.Uint16(l4[0:2]), binary.BigEndian.Uint16(l4[2:4])
		h.hasPorts = true
	}
	return h
}

// Match reports whether an IP packet passes the filter.
func (f Filter) Match(pkt []byte) bool {
	if len(f.prims) == 0 {
		return true
	}
	h := parse(pkt)
	if !h.parsed {
		return false
	}
	for _, p := range f.prims {
		if !p.match(&h) {
			return false
		}
	}
	return true
}

func (p *prim) match(h *headers) bool {
	switch p.kind {
	case "proto":
		return h.proto == p.proto
	case "host":
		return (p.dir != "dst" && h.src == p.addr) || (p.dir != "src" && h.dst == p.addr)
	default: // port
		return h.hasPorts && ((p.dir != "dst" && h.sport == p.port) || (p.dir != "src" && h.dport == p.port))
	}
}
