package bridge

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// resolver answers "which Ethernet header does a packet to dst get" from
// the kernel's route, link and neighbour tables, read over netlink and kept
// fresh by netlink notifications. Every change bumps gen, which empties the
// loops' private caches (l2cache), so the hot path takes no lock and makes
// no system call while nothing changes.
//
// A destination is the bridge's when the kernel routes it through the
// served interface (untagged) or through a VLAN device stacked directly on
// it (link type vlan, parent the served interface): then the frame carries
// that device's tag, 802.1Q or 802.1ad, and the packet must fit that
// device's MTU.
type resolver struct {
	h       *netlink.Handle
	ifindex int
	log     *slog.Logger
	gen     atomic.Uint64
	// mtu is the interface's MTU, kept current from link notifications:
	// the TX check reads it once per round.
	mtu atomic.Int32
	// routeGet is the kernel's route lookup (netlink RTM_GETROUTE); tests
	// replace it where the kernel lacks a device they need.
	routeGet func(dst net.IP) ([]netlink.Route, error)

	// cacheSize bounds routes and every queue's l2cache; 0 means
	// DefaultRouteCache.
	cacheSize int

	mu      sync.Mutex
	neigh   map[neighKey]net.HardwareAddr // usable entries, on any link
	vlans   map[int]vlanLink              // VLAN devices on our interface, by ifindex
	routes  map[netip.Addr]nextHop        // dst → next hop, emptied on any route change
	lookups lookupBudget                  // paces route lookups (the system calls)
	done    chan struct{}
	wg      sync.WaitGroup

	counts  RouteCacheStats // under mu, but for Evicted, which the queues add to
	evicted atomic.Uint64
}

// RouteCacheStats count what the bridge's route cache did: the kernel route
// lookups it made, the ones a flood of new destinations made it put off
// (those packets went through the kernel, which routes them itself), and
// the entries it evicted to stay within its bound.
type RouteCacheStats struct {
	Entries  int    // destinations in the shared cache now
	Lookups  uint64 // kernel route lookups made
	Deferred uint64 // lookups put off by the rate limit: the packet went through the kernel
	Evicted  uint64 // entries evicted, from the shared cache and the queues' own
}

// DefaultRouteCache is how many destinations the route cache holds by
// default (Config.RouteCache): the peers of a busy server, at about 100
// bytes each.
const DefaultRouteCache = 4096

// Route lookups (a netlink round trip each, under the resolver's lock) are
// paced so that a flood of packets to new destinations — SYN-ACKs to the
// spoofed sources of a SYN flood — costs bounded CPU: lookupBurst at once,
// then lookupRate per second. A packet whose destination cannot be looked
// up yet goes through the kernel, which routes and resolves it itself, and
// its destination is looked up again on its next packet.
const (
	lookupRate  = 2000
	lookupBurst = 256
)

// lookupBudget is a token bucket of route lookups; the zero value is full.
type lookupBudget struct {
	tokens float64
	last   time.Time
}

func (b *lookupBudget) take(now time.Time) bool {
	if b.last.IsZero() {
		b.tokens = lookupBurst
	} else {
		b.tokens = min(lookupBurst, b.tokens+now.Sub(b.last).Seconds()*lookupRate)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

func (r *resolver) size() int {
	if r.cacheSize > 0 {
		return r.cacheSize
	}
	return DefaultRouteCache
}

// evictOne deletes one entry of m, whichever Go's randomised map iteration
// meets first: random eviction, which a flood of new keys cannot steer and
// which costs nothing to keep track of.
func evictOne[K comparable, V any](m map[K]V) {
	for k := range m {
		delete(m, k)
		return
	}
}

type neighKey struct {
	link int
	addr netip.Addr
}

// vlanLink is a VLAN device stacked on the served interface.
type vlanLink struct {
	tpid, vid uint16 // 0x8100 (802.1Q) or 0x88a8 (802.1ad); VLAN id
	mtu       int
}

type nextHop struct {
	addr netip.Addr
	link int // the device the route leaves through
}

// l2 is how a frame to one destination is framed.
type l2 struct {
	mac [6]byte
	// tag is the VLAN tag to insert (TPID in the high 16 bits, TCI in the
	// low), 0 for none; mtu is then the VLAN device's MTU.
	tag uint32
	mtu int32
}

// usableNUD are neighbour states whose link-layer address may be used.
const usableNUD = netlink.NUD_REACHABLE | netlink.NUD_STALE | netlink.NUD_DELAY | netlink.NUD_PROBE | netlink.NUD_PERMANENT | netlink.NUD_NOARP

// newResolver subscribes to neighbour, route and link changes in ns. The
// initial neighbour table comes in through the subscription's listing; mtu
// is the interface's MTU now.
func newResolver(h *netlink.Handle, ns netns.NsHandle, ifindex, mtu, cacheSize int, log *slog.Logger) (*resolver, error) {
	r := &resolver{
		h: h, ifindex: ifindex, log: log, routeGet: h.RouteGet, cacheSize: cacheSize,
		neigh:  map[neighKey]net.HardwareAddr{},
		vlans:  map[int]vlanLink{},
		routes: map[netip.Addr]nextHop{},
		done:   make(chan struct{}),
	}
	r.mtu.Store(int32(mtu))
	neighs := make(chan netlink.NeighUpdate, 256)
	routes := make(chan netlink.RouteUpdate, 256)
	links := make(chan netlink.LinkUpdate, 64)
	onErr := func(err error) {
		select {
		case <-r.done: // closing: the subscriptions' sockets go away
		default:
			log.Warn("bridge: netlink subscription", "err", err)
		}
	}
	nsCopy := ns
	if err := netlink.NeighSubscribeWithOptions(neighs, r.done, netlink.NeighSubscribeOptions{Namespace: &nsCopy, ListExisting: true, ErrorCallback: onErr}); err != nil {
		return nil, fmt.Errorf("bridge: subscribe to neighbours: %w", err)
	}
	if err := netlink.RouteSubscribeWithOptions(routes, r.done, netlink.RouteSubscribeOptions{Namespace: &nsCopy, ErrorCallback: onErr}); err != nil {
		close(r.done)
		return nil, fmt.Errorf("bridge: subscribe to routes: %w", err)
	}
	if err := netlink.LinkSubscribeWithOptions(links, r.done, netlink.LinkSubscribeOptions{Namespace: &nsCopy, ErrorCallback: onErr}); err != nil {
		close(r.done)
		return nil, fmt.Errorf("bridge: subscribe to links: %w", err)
	}
	// A change between reading the MTU and subscribing would be missed.
	if l, err := h.LinkByIndex(ifindex); err == nil {
		r.mtu.Store(int32(l.Attrs().MTU))
	}
	// VLAN devices on our interface, after subscribing: notifications
	// repeat what the listing saw, never miss what came after it.
	if links, err := h.LinkList(); err == nil {
		for _, l := range links {
			r.applyLink(unix.RTM_NEWLINK, l)
		}
	}
	// Load the table now, so that the first packets find their neighbours;
	// the subscription's listing will repeat it.
	if list, err := h.NeighList(0, netlink.FAMILY_ALL); err == nil {
		for i := range list {
			r.apply(unix.RTM_NEWNEIGH, &list[i])
		}
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			select {
			case u, ok := <-neighs:
				if !ok {
					return
				}
				r.mu.Lock()
				changed := r.apply(u.Type, &u.Neigh)
				r.mu.Unlock()
				// Entries that are not usable (the incomplete and failed
				// ones a flood of new destinations makes the kernel
				// create) change no answer: the queues keep their caches.
				if changed {
					r.gen.Add(1)
				}
			case u, ok := <-links:
				if !ok {
					return
				}
				if a := u.Attrs(); a != nil && a.Index == r.ifindex && u.Header.Type == unix.RTM_NEWLINK {
					if old := r.mtu.Swap(int32(a.MTU)); int(old) != a.MTU {
						log.Info("bridge: interface MTU changed", "interface", a.Name, "from", old, "to", a.MTU)
					}
				}
				r.mu.Lock()
				changed := r.applyLink(u.Header.Type, u.Link)
				r.mu.Unlock()
				if changed {
					r.gen.Add(1)
				}
			case _, ok := <-routes:
				if !ok {
					return
				}
				r.mu.Lock()
				clear(r.routes)
				r.mu.Unlock()
				r.gen.Add(1)
			case <-r.done:
				return
			}
		}
	}()
	return r, nil
}

// apply follows one neighbour entry; it reports whether the usable set
// changed.
func (r *resolver) apply(typ uint16, n *netlink.Neigh) bool {
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return false
	}
	k := neighKey{n.LinkIndex, a.Unmap()}
	old, had := r.neigh[k]
	if typ == unix.RTM_DELNEIGH || n.State&usableNUD == 0 || len(n.HardwareAddr) != 6 {
		delete(r.neigh, k)
		return had
	}
	if had && bytes.Equal(old, n.HardwareAddr) {
		return false
	}
	r.neigh[k] = append(net.HardwareAddr(nil), n.HardwareAddr...)
	return true
}

// applyLink follows VLAN devices on our interface: created, changed (id,
// protocol, MTU) or deleted. It reports whether the set changed.
func (r *resolver) applyLink(typ uint16, l netlink.Link) bool {
	a := l.Attrs()
	if a == nil {
		return false
	}
	old, had := r.vlans[a.Index]
	v, isVLAN := l.(*netlink.Vlan)
	if typ == unix.RTM_DELLINK || !isVLAN || a.ParentIndex != r.ifindex {
		delete(r.vlans, a.Index)
		return had
	}
	tpid := uint16(0x8100)
	if v.VlanProtocol == netlink.VLAN_PROTOCOL_8021AD {
		tpid = 0x88a8
	}
	nv := vlanLink{tpid: tpid, vid: uint16(v.VlanId) & 0xfff, mtu: a.MTU}
	r.vlans[a.Index] = nv
	return !had || old != nv
}

// resolve is the slow path: the next hop from the route table (asked once
// per destination until routes change), then its neighbour entry. ok is false
// when the packet should go to the kernel instead: no route through our
// interface or a VLAN device on it, or no usable neighbour yet.
func (r *resolver) resolve(dst netip.Addr) (out l2, ok bool) {
	out, ok, _ = r.lookup(dst, time.Now())
	return out, ok
}

// lookup is resolve for a queue's cache: keep is false when the answer
// must not be cached, because the route lookup was put off (lookupRate).
// The shared route cache holds at most size() destinations.
func (r *resolver) lookup(dst netip.Addr, now time.Time) (out l2, ok, keep bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	hop, known := r.routes[dst]
	if !known {
		if !r.lookups.take(now) {
			r.counts.Deferred++
			return out, false, false
		}
		r.counts.Lookups++
		hop = nextHop{}
		if rs, err := r.routeGet(dst.AsSlice()); err == nil && len(rs) > 0 && rs[0].Type != unix.RTN_LOCAL {
			rt := rs[0]
			hop.link = rt.LinkIndex
			hop.addr = dst
			if gw, ok := netip.AddrFromSlice(rt.Gw); ok && rt.Gw != nil {
				hop.addr = gw.Unmap()
			}
		}
		if len(r.routes) >= r.size() {
			evictOne(r.routes)
			r.evicted.Add(1)
		}
		r.routes[dst] = hop
	}
	if hop.link == 0 {
		return out, false, true
	}
	if hop.link != r.ifindex {
		v, ok := r.vlans[hop.link]
		if !ok {
			return out, false, true
		}
		out.tag = uint32(v.tpid)<<16 | uint32(v.vid)
		out.mtu = int32(v.mtu)
	}
	hw, ok := r.neigh[neighKey{hop.link, hop.addr}]
	if !ok {
		return out, false, true
	}
	copy(out.mac[:], hw)
	return out, true, true
}

// stats is a snapshot of the route cache's counters.
func (r *resolver) stats() RouteCacheStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.counts
	st.Entries = len(r.routes)
	st.Evicted = r.evicted.Load()
	return st
}

func (r *resolver) close() {
	select {
	case <-r.done:
	default:
		close(r.done)
	}
	r.wg.Wait()
}

// l2cache is one queue's TX side's private view of the resolver: no lock, no
// allocation once a destination has been seen, emptied when the resolver's
// generation moves, and bounded as the resolver's route cache is.
type l2cache struct {
	r   *resolver
	gen uint64
	max int
	m   map[netip.Addr]l2entry
}

type l2entry struct {
	l2 l2
	ok bool
}

func newL2cache(r *resolver) *l2cache {
	return &l2cache{r: r, gen: r.gen.Load(), max: r.size(), m: make(map[netip.Addr]l2entry, 64)}
}

func (c *l2cache) lookup(dst netip.Addr) (l2, bool) {
	if g := c.r.gen.Load(); g != c.gen {
		clear(c.m)
		c.gen = g
	}
	if e, ok := c.m[dst]; ok {
		return e.l2, e.ok
	}
	h, ok, keep := c.r.lookup(dst, time.Now())
	if !keep {
		return h, ok
	}
	if len(c.m) >= c.max {
		evictOne(c.m)
		c.r.evicted.Add(1)
	}
	c.m[dst] = l2entry{h, ok}
	return h, ok
}

// kernelPath hands packets whose neighbour is unknown (or that route
// elsewhere) to the kernel through raw IP sockets: the kernel resolves the
// neighbour, queues the packet meanwhile, and sends it; the resulting
// neighbour entry reaches the resolver as a notification.
type kernelPath struct {
	fd4, fd6 int
}

func newKernelPath() (*kernelPath, error) {
	fd4, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, fmt.Errorf("bridge: raw IPv4 socket: %w", err)
	}
	fd6, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		unix.Close(fd4)
		return nil, fmt.Errorf("bridge: raw IPv6 socket: %w", err)
	}
	return &kernelPath{fd4: fd4, fd6: fd6}, nil
}

// send transmits one verified IP packet through the kernel.
func (k *kernelPath) send(pkt []byte) error {
	if pkt[0]>>4 == 4 {
		sa := &unix.SockaddrInet4{Addr: [4]byte(pkt[16:20])}
		return unix.Sendto(k.fd4, pkt, unix.MSG_DONTWAIT, sa)
	}
	sa := &unix.SockaddrInet6{Addr: [16]byte(pkt[24:40])}
	return unix.Sendto(k.fd6, pkt, unix.MSG_DONTWAIT, sa)
}

func (k *kernelPath) close() error {
	return errors.Join(unix.Close(k.fd4), unix.Close(k.fd6))
}

// dstAddr is the destination address of a verified IP packet.
func dstAddr(pkt []byte) netip.Addr {
	if pkt[0]>>4 == 4 {
		return netip.AddrFrom4([4]byte(pkt[16:20]))
	}
	return netip.AddrFrom16([16]byte(pkt[24:40]))
}
