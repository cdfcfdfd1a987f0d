package config

import (
	"strings"
	"testing"
	"time"
)

const bgpBase = base + "bgp:\n  asn: 65001\n  router_id: 198.18.0.2\n"

func TestBGPErrorsArePrecise(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"off but set", base + "bgp:\n  neighbors: [{address: 198.18.0.1, asn: 65000}]\n", []string{
			"t.yaml:4:3: bgp.neighbors: set, but bgp.asn is not: BGP is off",
		}},
		{"no neighbours", bgpBase, []string{"t.yaml:3:1: bgp: neighbors is required: the routers to announce the addresses to"}},
		{"no router id", base + "bgp:\n  asn: 65001\n  neighbors: [{address: 198.18.0.1, asn: 65000}]\n", []string{
			"t.yaml:3:1: bgp: router_id is required: an IPv4 address that identifies this box to its neighbours",
		}},
		{"v6 router id", base + "bgp:\n  asn: 65001\n  router_id: 2001:db8::2\n  neighbors: [{address: 198.18.0.1, asn: 65000}]\n", []string{
			"t.yaml:5:3: bgp.router_id: 2001:db8::2 is not a usable IPv4 address (BGP identifiers are IPv4 even on IPv6 sessions)",
		}},
		{"as_trans", base + "bgp:\n  asn: 23456\n  router_id: 198.18.0.2\n  neighbors: [{address: 198.18.0.1, asn: 65000}]\n", []string{
			"t.yaml:4:3: bgp.asn: 23456 is reserved and cannot be an AS of a BGP speaker",
		}},
		{"neighbour twice, no asn", bgpBase + "  neighbors:\n    - {address: 198.18.0.1, asn: 65000}\n    - {address: 198.18.0.1}\n", []string{
			"t.yaml:8:7: bgp.neighbors[1].asn: required: an AS number from 1 to 4294967294",
			"t.yaml:8:8: bgp.neighbors[1].address: 198.18.0.1 is already bgp.neighbors[0]",
		}},
		{"address of no neighbour's family", "interfaces: [{name: eth1}]\naddresses: [198.18.0.1, 2001:db8::1]\n" +
			"bgp:\n  asn: 65001\n  router_id: 198.18.0.2\n  neighbors: [{address: 198.18.0.1, asn: 65000}]\n", []string{
			"t.yaml:2:25: addresses[1]: 2001:db8::1 would never be announced: bgp.neighbors has no neighbour of its IP version (or list the addresses to announce in bgp.announce)",
		}},
		{"announce", "interfaces: [{name: eth1}]\naddresses: [198.18.0.1, 2001:db8::1]\n" +
			"bgp:\n  asn: 65001\n  router_id: 198.18.0.2\n  neighbors: [{address: 198.18.0.1, asn: 65000}]\n  announce: [198.18.0.1, 198.18.9.9, 198.18.0.1, 2001:db8::1]\n", []string{
			"t.yaml:7:26: bgp.announce[1]: 198.18.9.9 is not one of addresses",
			"t.yaml:7:38: bgp.announce[2]: 198.18.0.1 is listed twice",
			"t.yaml:7:50: bgp.announce[3]: 2001:db8::1 would never be announced: bgp.neighbors has no neighbour of its IP version",
		}},
		{"hold time", bgpBase + "  neighbors: [{address: 198.18.0.1, asn: 65000}]\n  hold_time: 1s\n", []string{
			"t.yaml:7:3: bgp.hold_time: must be whole seconds from 3s to 65535s, not 1s",
		}},
		{"bfd", bgpBase + "  neighbors: [{address: 198.18.0.1, asn: 65000}]\n  bfd: {enabled: true, interval: 1ms, multiplier: 0}\n", []string{
			"t.yaml:7:24: bgp.bfd.interval: must be from 10ms to 10s, not 1ms",
			"t.yaml:7:39: bgp.bfd.multiplier: must be from 1 to 255, not 0",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("t.yaml", []byte(tc.yaml))
			if err == nil {
				t.Fatalf("accepted:\n%s\nas %+v", tc.yaml, c)
			}
			if got := err.Error(); got != strings.Join(tc.want, "\n") {
				t.Errorf("errors:\n%s\nwant:\n%s", got, strings.Join(tc.want, "\n"))
			}
		})
	}
}

func TestBGPValues(t *testing.T) {
	c, err := Parse("t.yaml", []byte(bgpBase+"  neighbors:\n    - {address: 198.18.0.1, asn: 65000}\n  bfd: {enabled: true}\n"))
	if err != nil {
		t.Fatal(err)
	}
	b := c.BGP
	if b.ASN != 65001 || b.RouterID.String() != "198.18.0.2" || len(b.Neighbors) != 1 || b.Neighbors[0].ASN != 65000 {
		t.Errorf("decoded %+v", b)
	}
	if time.Duration(b.HoldTime) != DefaultBGPHoldTime || time.Duration(b.WithdrawDelay) != DefaultBGPWithdrawDelay ||
		!b.BFD.Enabled || time.Duration(b.BFD.Interval) != DefaultBFDInterval || b.BFD.Multiplier != DefaultBFDMultiplier {
		t.Errorf("defaults not applied: %+v", b)
	}
	if off, err := Parse("t.yaml", []byte(base)); err != nil || off.BGP.ASN != 0 {
		t.Errorf("without a bgp section: %v, asn %d", err, off.BGP.ASN)
	}
}
