package classifier

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Ownership is what a stream may send, the transmit side of the tables
// that steer to it: its source addresses, and the protocol and source port
// of every listener and flow it holds (a listener it registered, an
// ephemeral port it was given). The bridge drops and counts a packet with
// anything else.
type Ownership struct {
	Addrs []netip.Addr
	Ports []PortClaim
}

// PortClaim is one owned protocol (TCP or UDP) and port.
type PortClaim struct {
	Proto Protocol
	Port  uint16
}

// PortSet is a set of ports, a bit each (8 KiB): a membership test is one
// load, whatever the number of ports.
type PortSet [65536 / 64]uint64

// Add adds the ports lo to hi, both included.
func (s *PortSet) Add(lo, hi uint16) {
	for p := int(lo); p <= int(hi); p++ {
		s[p/64] |= 1 << (p % 64)
	}
}

// Has reports whether p is in the set.
func (s *PortSet) Has(p uint16) bool { return s[p/64]&(1<<(p%64)) != 0 }

// String is the set in the syntax of the kernel's port lists
// (ip_local_reserved_ports): "1000-1999,8080"; empty for an empty set.
func (s *PortSet) String() string {
	var parts []string
	for p := 0; p < 65536; p++ {
		if !s.Has(uint16(p)) {
			continue
		}
		q := p
		for q+1 < 65536 && s.Has(uint16(q+1)) {
			q++
		}
		if q == p {
			parts = append(parts, strconv.Itoa(p))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", p, q))
		}
		p = q
	}
	return strings.Join(parts, ",")
}
