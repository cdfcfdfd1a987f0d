package config

import (
	"fmt"
	"time"
)

// BGP announces the addresses to the routers upstream (package
// appliance/announce), so that several boxes can share them behind ECMP.
// It is off unless ASN is set.
type BGP struct {
	// ASN is this box's autonomous system; the boxes of one cluster
	// usually share one, so that routers see equal paths.
	ASN uint32 `yaml:"asn"`
	// RouterID is the BGP identifier, an IPv4 address unique among the
	// routers' peers (commonly the box's own address on the peering link).
	RouterID Addr `yaml:"router_id"`
	// ListenPort accepts sessions that routers open; 0 does not listen and
	// the box opens every session itself.
	ListenPort uint16        `yaml:"listen_port"`
	Neighbors  []BGPNeighbor `yaml:"neighbors"`
	// Announce are the addresses announced, each one of Addresses; empty
	// announces all of them. A box's own address on the peering link is
	// no service address and is better left out.
	Announce []Addr `yaml:"announce"`
	// HoldTime is BGP's hold time, from 3s; without BFD it is how long
	// routers keep sending to a box that died without closing its sessions.
	HoldTime Duration `yaml:"hold_time"`
	BFD      BFD      `yaml:"bfd"`
	// WithdrawDelay is how long a stopping box keeps serving after it has
	// withdrawn its routes, while the routers move the traffic away.
	WithdrawDelay Duration `yaml:"withdraw_delay"`
}

// BGPNeighbor is one upstream router.
type BGPNeighbor struct {
	Address Addr   `yaml:"address"`
	ASN     uint32 `yaml:"asn"`
}

// BFD detects a dead box in Interval × Multiplier instead of the hold time.
// The router must run BFD on the sessions too.
type BFD struct {
	Enabled    bool     `yaml:"enabled"`
	Interval   Duration `yaml:"interval"`
	Multiplier int      `yaml:"multiplier"`
}

// Defaults of the bgp section.
const (
	DefaultBGPHoldTime      = 9 * time.Second
	DefaultBGPWithdrawDelay = time.Second
	DefaultBFDInterval      = 100 * time.Millisecond
	DefaultBFDMultiplier    = 3
)

func defaultBGP() BGP {
	return BGP{
		HoldTime:      Duration(DefaultBGPHoldTime),
		WithdrawDelay: Duration(DefaultBGPWithdrawDelay),
		BFD:           BFD{Interval: Duration(DefaultBFDInterval), Multiplier: DefaultBFDMultiplier},
	}
}

// asTrans stands in for a four-byte AS number on two-byte sessions (RFC
// 6793); no speaker may have it as its own.
const asTrans = 23456

func checkASN(d *decoder, field string, asn uint32) {
	switch asn {
	case 0:
		d.errorAt(field, "required: an AS number from 1 to 4294967294")
	case asTrans, 1<<32 - 1:
		d.errorAt(field, "%d is reserved and cannot be an AS of a BGP speaker", asn)
	}
}

func (c *Config) checkBGP(d *decoder) {
	b := c.BGP
	if b.ASN == 0 {
		for _, f := range []string{"router_id", "listen_port", "neighbors", "announce", "hold_time", "bfd", "withdraw_delay"} {
			if d.written("bgp." + f) {
				d.errorAt("bgp."+f, "set, but bgp.asn is not: BGP is off")
			}
		}
		return
	}
	checkASN(d, "bgp.asn", b.ASN)
	switch {
	case !b.RouterID.IsValid():
		d.errorAt("bgp", "router_id is required: an IPv4 address that identifies this box to its neighbours")
	case !b.RouterID.Is4() || b.RouterID.IsUnspecified():
		d.errorAt("bgp.router_id", "%s is not a usable IPv4 address (BGP identifiers are IPv4 even on IPv6 sessions)", b.RouterID)
	}
	if len(b.Neighbors) == 0 {
		d.errorAt("bgp", "neighbors is required: the routers to announce the addresses to")
	}
	families := map[bool]bool{} // Is4 -> has a neighbour
	seen := map[Addr]string{}
	for i, n := range b.Neighbors {
		p := fmt.Sprintf("bgp.neighbors[%d]", i)
		switch {
		case !n.Address.IsValid():
			d.errorAt(p, "address is required")
		case n.Address.IsUnspecified() || n.Address.IsMulticast():
			d.errorAt(p+".address", "%s cannot be a neighbour", n.Address)
		case seen[n.Address] != "":
			d.errorAt(p+".address", "%s is already %s", n.Address, seen[n.Address])
		default:
			seen[n.Address] = p
			families[n.Address.Is4()] = true
		}
		checkASN(d, p+".asn", n.ASN)
	}
	announced := map[Addr]bool{}
	for i, a := range b.Announce {
		p := fmt.Sprintf("bgp.announce[%d]", i)
		switch {
		case !c.isAddress(a):
			d.errorAt(p, "%s is not one of addresses", a)
		case announced[a]:
			d.errorAt(p, "%s is listed twice", a)
		case len(b.Neighbors) > 0 && !families[a.Is4()]:
			d.errorAt(p, "%s would never be announced: bgp.neighbors has no neighbour of its IP version", a)
		}
		announced[a] = true
	}
	if len(b.Announce) == 0 && len(b.Neighbors) > 0 {
		for i, a := range c.Addresses {
			if !families[a.Is4()] {
				d.errorAt(fmt.Sprintf("addresses[%d]", i), "%s would never be announced: bgp.neighbors has no neighbour of its IP version (or list the addresses to announce in bgp.announce)", a)
			}
		}
	}
	// BGP also allows 0 (no keepalives at all); GoBGP does not, and a box
	// that routers never time out is what this section exists to avoid.
	if h := time.Duration(b.HoldTime); h < 3*time.Second || h > 65535*time.Second || h%time.Second != 0 {
		d.errorAt("bgp.hold_time", "must be whole seconds from 3s to 65535s, not %s", h)
	}
	if w := time.Duration(b.WithdrawDelay); w > time.Minute {
		d.errorAt("bgp.withdraw_delay", "must be at most 1m, not %s", w)
	}
	if b.BFD.Enabled {
		if iv := time.Duration(b.BFD.Interval); iv < 10*time.Millisecond || iv > 10*time.Second {
			d.errorAt("bgp.bfd.interval", "must be from 10ms to 10s, not %s", iv)
		}
		if m := b.BFD.Multiplier; m < 1 || m > 255 {
			d.errorAt("bgp.bfd.multiplier", "must be from 1 to 255, not %d", m)
		}
	}
}

// AnnouncedAddresses are the addresses the bgp section announces.
func (b *BGP) AnnouncedAddresses(all []Addr) []Addr {
	if len(b.Announce) > 0 {
		return b.Announce
	}
	return all
}
