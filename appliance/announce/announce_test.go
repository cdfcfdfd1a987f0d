package announce

import (
	"net/netip"
	"strings"
	"testing"
	"time"
)

func TestConfigCheck(t *testing.T) {
	good := Config{
		ASN: 65001, RouterID: netip.MustParseAddr("198.18.0.2"),
		Neighbors: []Neighbor{{Address: netip.MustParseAddr("198.18.0.1"), ASN: 65000}},
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.200.1")},
	}
	if err := good.Check(); err != nil {
		t.Fatalf("a good configuration refused: %v", err)
	}
	for _, c := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"no asn", func(c *Config) { c.ASN = 0 }, "asn is missing"},
		{"v6 router id", func(c *Config) { c.RouterID = netip.MustParseAddr("2001:db8::1") }, "router_id"},
		{"no neighbours", func(c *Config) { c.Neighbors = nil }, "no neighbours"},
		{"twice", func(c *Config) { c.Neighbors = append(c.Neighbors, c.Neighbors[0]) }, "listed twice"},
		{"peer asn", func(c *Config) { c.Neighbors[0].ASN = 0 }, "has no asn"},
		{"v6 address, v4 neighbours", func(c *Config) {
			c.Addresses = append(c.Addresses, netip.MustParseAddr("2001:db8:200::1"))
		}, "no neighbour of its family"},
		{"bfd", func(c *Config) { c.BFD = &BFD{MinTx: time.Millisecond} }, "bfd"},
	} {
		cfg := good
		cfg.Neighbors = append([]Neighbor(nil), good.Neighbors...)
		c.edit(&cfg)
		err := cfg.Check()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one saying %q", c.name, err, c.want)
		}
	}
}

func TestHostPaths(t *testing.T) {
	paths, err := hostPaths([]netip.Addr{netip.MustParseAddr("::ffff:198.18.200.1"), netip.MustParseAddr("2001:db8:200::1")})
	if err != nil {
		t.Fatal(err)
	}
	if got := paths[0].Nlri.String(); got != "198.18.200.1/32" {
		t.Errorf("IPv4 path for %s", got)
	}
	if got := paths[1].Nlri.String(); got != "2001:db8:200::1/128" {
		t.Errorf("IPv6 path for %s", got)
	}
}
