package bridge

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// resolver answers "which Ethernet address does a packet to dst go to" from
// the kernel's route and neighbour tables, read over netlink and kept fresh
// by netlink notifications. Every change bumps gen, which empties the TX
// loops' private caches (l2cache), so the hot path takes no lock and makes no
// system call while nothing changes.
type resolver struct {
	h       *netlink.Handle
	ifindex int
	log     *slog.Logger
	gen     atomic.Uint64
	// mtu is the interface's MTU, kept current from link notifications:
	// the TX check reads it once per round.
	mtu atomic.Int32

	mu     sync.Mutex
	neigh  map[netip.Addr]net.HardwareAddr // usable entries on our interface
	routes map[netip.Addr]nextHop          // dst → next hop, emptied on any route change
	done   chan struct{}
	wg     sync.WaitGroup
}

type nextHop struct {
	addr netip.Addr
	ours bool // leaves through our interface
}

// usableNUD are neighbour states whose link-layer address may be used.
const usableNUD = netlink.NUD_REACHABLE | netlink.NUD_STALE | netlink.NUD_DELAY | netlink.NUD_PROBE | netlink.NUD_PERMANENT | netlink.NUD_NOARP

// newResolver subscribes to neighbour, route and link changes in ns. The
// initial neighbour table comes in through the subscription's listing; mtu
// is the interface's MTU now.
func newResolver(h *netlink.Handle, ns netns.NsHandle, ifindex, mtu int, log *slog.Logger) (*resolver, error) {
	r := &resolver{
		h: h, ifindex: ifindex, log: log,
		neigh:  map[netip.Addr]net.HardwareAddr{},
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
	// Load the table now, so that the first packets find their neighbours;
	// the subscription's listing will repeat it.
	if list, err := h.NeighList(ifindex, netlink.FAMILY_ALL); err == nil {
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
				r.apply(u.Type, &u.Neigh)
				r.mu.Unlock()
				r.gen.Add(1)
			case u, ok := <-links:
				if !ok {
					return
				}
				if a := u.Attrs(); a != nil && a.Index == r.ifindex && u.Header.Type == unix.RTM_NEWLINK {
					if old := r.mtu.Swap(int32(a.MTU)); int(old) != a.MTU {
						log.Info("bridge: interface MTU changed", "interface", a.Name, "from", old, "to", a.MTU)
					}
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

func (r *resolver) apply(typ uint16, n *netlink.Neigh) {
	if n.LinkIndex != r.ifindex {
		return
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return
	}
	a = a.Unmap()
	if typ == unix.RTM_DELNEIGH || n.State&usableNUD == 0 || len(n.HardwareAddr) != 6 {
		delete(r.neigh, a)
		return
	}
	r.neigh[a] = append(net.HardwareAddr(nil), n.HardwareAddr...)
}

// resolve is the slow path: the next hop from the route table (asked once
// per destination until routes change), then its neighbour entry. ok is false
// when the packet should go to the kernel instead: no route through our
// interface, or no usable neighbour yet.
func (r *resolver) resolve(dst netip.Addr) (mac [6]byte, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	hop, known := r.routes[dst]
	if !known {
		hop = nextHop{}
		if rs, err := r.h.RouteGet(dst.AsSlice()); err == nil && len(rs) > 0 {
			rt := rs[0]
			hop.ours = rt.LinkIndex == r.ifindex && rt.Type != unix.RTN_LOCAL
			hop.addr = dst
			if gw, ok := netip.AddrFromSlice(rt.Gw); ok && rt.Gw != nil {
				hop.addr = gw.Unmap()
			}
		}
		r.routes[dst] = hop
	}
	if !hop.ours {
		return mac, false
	}
	hw, ok := r.neigh[hop.addr]
	if !ok {
		return mac, false
	}
	copy(mac[:], hw)
	return mac, true
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
// generation moves.
type l2cache struct {
	r   *resolver
	gen uint64
	m   map[netip.Addr]l2entry
}

type l2entry struct {
	mac [6]byte
	ok  bool
}

func newL2cache(r *resolver) *l2cache {
	return &l2cache{r: r, gen: r.gen.Load(), m: make(map[netip.Addr]l2entry, 64)}
}

func (c *l2cache) lookup(dst netip.Addr) ([6]byte, bool) {
	if g := c.r.gen.Load(); g != c.gen {
		clear(c.m)
		c.gen = g
	}
	if e, ok := c.m[dst]; ok {
		return e.mac, e.ok
	}
	mac, ok := c.r.resolve(dst)
	c.m[dst] = l2entry{mac, ok}
	return mac, ok
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
