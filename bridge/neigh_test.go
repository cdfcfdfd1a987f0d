package bridge

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// floodResolver is a resolver over a fake kernel that routes everything
// out of the served interface, on link, and knows no neighbour; it counts
// the route lookups asked of it.
func floodResolver(cacheSize int, lookups *int) *resolver {
	const served = 7
	return &resolver{ifindex: served, cacheSize: cacheSize,
		neigh: map[neighKey]net.HardwareAddr{}, vlans: map[int]vlanLink{}, routes: map[netip.Addr]nextHop{},
		routeGet: func(dst net.IP) ([]netlink.Route, error) {
			*lookups++
			return []netlink.Route{{LinkIndex: served, Type: unix.RTN_UNICAST}}, nil
		}}
}

// spoofed is the i-th random-looking source of a SYN flood, in 2001:db8::/32.
func spoofed(i int) netip.Addr {
	a := [16]byte{0x20, 0x01, 0x0d, 0xb8}
	binary.BigEndian.PutUint64(a[8:], uint64(i)*0x9e3779b97f4a7c15) // odd: distinct for distinct i
	return netip.AddrFrom16(a)
}

// TestRouteCacheBounded: answering a flood of 100,000 new destinations (a
// SYN flood's SYN-ACKs) keeps the shared cache and a queue's own within
// their bound, evicts and counts, and makes no more kernel lookups than
// the rate allows; the ones put off are not cached, so a destination is
// looked up once the flood has passed.
func TestRouteCacheBounded(t *testing.T) {
	const size, flood = 64, 100_000
	var lookups int
	r := floodResolver(size, &lookups)
	c := newL2cache(r)
	start := time.Now()
	for i := range flood {
		if _, ok := c.lookup(spoofed(i)); ok {
			t.Fatalf("destination %d resolved without a neighbour", i)
		}
	}
	elapsed := time.Since(start)
	if len(r.routes) > size || len(c.m) > size {
		t.Fatalf("after %d destinations: %d routes cached, %d in the queue's cache; bound %d", flood, len(r.routes), len(c.m), size)
	}
	st := r.stats()
	if allowed := lookupBurst + int(elapsed.Seconds()*lookupRate) + 1; lookups > allowed || uint64(lookups) != st.Lookups {
		t.Errorf("%d kernel lookups in %v (counted %d), the rate allows %d", lookups, elapsed, st.Lookups, allowed)
	}
	if st.Deferred != uint64(flood-lookups) || st.Evicted == 0 || st.Entries != len(r.routes) {
		t.Errorf("stats %+v after %d lookups of %d destinations", st, lookups, flood)
	}
	t.Logf("%v: %d lookups, %+v", elapsed, lookups, st)

	// The flood is over: a new destination is looked up at once.
	later := time.Now().Add(time.Second)
	legit := netip.MustParseAddr("2001:db8:1::1")
	before := lookups
	if _, _, keep := r.lookup(legit, later); !keep || lookups != before+1 {
		t.Fatalf("after the flood: keep %v, %d lookups", keep, lookups-before)
	}
	if _, known := r.routes[legit]; !known {
		t.Fatal("the destination looked up after the flood is not cached")
	}
}

// TestRouteCacheDefault: a resolver configured with no size holds
// DefaultRouteCache destinations.
func TestRouteCacheDefault(t *testing.T) {
	var lookups int
	r := floodResolver(0, &lookups)
	now := time.Now()
	for i := range DefaultRouteCache + 100 {
		r.lookup(spoofed(i), now.Add(time.Duration(i)*time.Second))
	}
	if len(r.routes) != DefaultRouteCache {
		t.Fatalf("%d routes cached, want %d", len(r.routes), DefaultRouteCache)
	}
}

// TestUnusableNeighboursKeepCaches: the incomplete and failed entries that
// the kernel makes for each new destination of a flood change no answer,
// so they must not empty the queues' caches; a usable entry, a new address
// for it and its loss do.
func TestUnusableNeighboursKeepCaches(t *testing.T) {
	var lookups int
	r := floodResolver(0, &lookups)
	dst := netip.MustParseAddr("2001:db8::7")
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 7}
	n := func(state int, hw net.HardwareAddr) *netlink.Neigh {
		return &netlink.Neigh{LinkIndex: r.ifindex, IP: dst.AsSlice(), State: state, HardwareAddr: hw}
	}
	for _, c := range []struct {
		what    string
		typ     uint16
		neigh   *netlink.Neigh
		changed bool
	}{
		{"incomplete", unix.RTM_NEWNEIGH, n(netlink.NUD_INCOMPLETE, nil), false},
		{"failed, never usable", unix.RTM_NEWNEIGH, n(netlink.NUD_FAILED, nil), false},
		{"reachable", unix.RTM_NEWNEIGH, n(netlink.NUD_REACHABLE, mac), true},
		{"stale, same address", unix.RTM_NEWNEIGH, n(netlink.NUD_STALE, mac), false},
		{"new address", unix.RTM_NEWNEIGH, n(netlink.NUD_REACHABLE, net.HardwareAddr{2, 0, 0, 0, 0, 8}), true},
		{"failed", unix.RTM_NEWNEIGH, n(netlink.NUD_FAILED, nil), true},
		{"deleted, already gone", unix.RTM_DELNEIGH, n(netlink.NUD_FAILED, nil), false},
	} {
		if got := r.apply(c.typ, c.neigh); got != c.changed {
			t.Errorf("%s: changed %v, want %v", c.what, got, c.changed)
		}
	}
}
