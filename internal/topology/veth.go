package topology

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The only address ranges tests may use (RFC 2544 and RFC 3849): reserved
// for benchmarking and documentation, so they can never reach a real host.
var (
	bench4 = netip.MustParsePrefix("198.18.0.0/15")
	bench6 = netip.MustParsePrefix("2001:db8::/32")
)

// Veth is a veth pair joining two namespaces; A and B are its two ends.
type Veth struct {
	A, B End
}

// End is one side of a Veth as seen from inside its namespace.
type End struct {
	NS    *NS
	Name  string
	Index int // interface index, meaningful only inside NS
	MAC   net.HardwareAddr
	Addr4 netip.Prefix
	Addr6 netip.Prefix
}

// VethOptions shapes a veth pair. The zero value is a 1500-byte MTU, one
// queue each way, and addresses drawn from the process-wide allocator.
type VethOptions struct {
	// MTU of both ends; 0 means 1500.
	MTU int
	// Queues is the number of RX and of TX queues on each end; 0 means 1.
	// More than one lets AF_XDP and XDP tests spread over several queues.
	Queues int
	// A4, A6, B4 and B6 pin the addresses of the ends. Unset ones come from
	// the allocator. Pinned ones must lie inside 198.18.0.0/15 and
	// 2001:db8::/32 respectively; avoiding clashes between them and with
	// allocated ones is the caller's business.
	A4, A6, B4, B6 netip.Prefix
}

// carrierTimeout bounds the wait for both ends to come up. It is generous:
// a veth is up within milliseconds, and if it is not, something is wrong.
const carrierTimeout = 5 * time.Second

// Connect creates a veth pair with one end in a and the other in b, gives each
// end one IPv4 and one IPv6 address, and returns once both report carrier,
// so the link is usable straight away. Removal is registered with
// tb.Cleanup; it also happens anyway when either namespace goes.
//
// IPv6 addresses are added with IFA_F_NODAD: duplicate address detection
// would otherwise hold them tentative for about a second, during which they
// cannot be used as a source.
func Connect(tb TB, a, b *NS, opts VethOptions) *Veth {
	tb.Helper()
	v, err := connect(tb, a, b, opts)
	if err != nil {
		tb.Fatalf("netns: %v", err)
	}
	return v
}

// Pair makes the common topology: two fresh namespaces joined by one veth.
func Pair(tb TB, opts VethOptions) (a, b *NS, v *Veth) {
	tb.Helper()
	a = New(tb)
	b = New(tb)
	return a, b, Connect(tb, a, b, opts)
}

func connect(tb TB, a, b *NS, opts VethOptions) (*Veth, error) {
	mtu, queues := opts.MTU, opts.Queues
	if mtu == 0 {
		mtu = 1500
	}
	if queues == 0 {
		queues = 1
	}
	// 68 is the IPv4 minimum; IPv6 needs 1280, which the kernel enforces by
	// disabling IPv6 on the link, so it is checked here to fail clearly.
	if mtu < 1280 || mtu > 65535 {
		return nil, fmt.Errorf("veth MTU %d outside 1280..65535", mtu)
	}
	if queues < 1 || queues > 256 {
		return nil, fmt.Errorf("veth queue count %d outside 1..256", queues)
	}
	addrs, release, err := addresses(opts)
	if err != nil {
		return nil, err
	}
	ha, hb := a.Handle(), b.Handle()
	b.mu.Lock()
	bfd := b.fd
	b.mu.Unlock()
	if ha == nil || hb == nil || !bfd.IsOpen() {
		release()
		return nil, errors.New("connecting namespaces that have been removed")
	}

	tag := randomHex(3)
	v := &Veth{
		A: End{NS: a, Name: namePrefix + tag + "a", Addr4: addrs[0], Addr6: addrs[1]},
		B: End{NS: b, Name: namePrefix + tag + "b", Addr4: addrs[2], Addr6: addrs[3]},
	}
	attrs := netlink.NewLinkAttrs()
	attrs.Name = v.A.Name
	attrs.MTU = mtu
	attrs.NumTxQueues, attrs.NumRxQueues = queues, queues
	link := netlink.NewVeth(attrs)
	link.PeerName = v.B.Name
	// The peer is born in b, and this end in a, so neither ever appears in
	// the namespace the test runs in, not even briefly.
	link.PeerNamespace = netlink.NsFd(bfd)
	if err := ha.LinkAdd(link); err != nil {
		release()
		return nil, fmt.Errorf("creating veth %s/%s: %w", v.A.Name, v.B.Name, err)
	}
	tb.Cleanup(func() {
		defer release()
		// Deleting one end deletes both. If a is already gone, so is the pair.
		h := a.Handle()
		if h == nil {
			return
		}
		l, err := h.LinkByName(v.A.Name)
		if err == nil {
			err = h.LinkDel(l)
		}
		var notFound netlink.LinkNotFoundError
		if err != nil && !errors.As(err, &notFound) {
			tb.Errorf("netns: removing veth %s: %v", v.A.Name, err)
		}
	})

	for _, e := range []*End{&v.A, &v.B} {
		if err := setUp(e); err != nil {
			return nil, err
		}
	}
	for _, e := range []*End{&v.A, &v.B} {
		if err := waitUp(e, time.Now().Add(carrierTimeout)); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// setUp addresses one end, brings it up, and records its index and MAC.
func setUp(e *End) error {
	h := e.NS.Handle()
	l, err := h.LinkByName(e.Name)
	if err != nil {
		return fmt.Errorf("finding %s in %s: %w", e.Name, e.NS.Name, err)
	}
	for _, p := range []netip.Prefix{e.Addr4, e.Addr6} {
		addr := &netlink.Addr{IPNet: &net.IPNet{
			IP:   p.Addr().AsSlice(),
			Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen()),
		}}
		if p.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := h.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("adding %s to %s in %s: %w", p, e.Name, e.NS.Name, err)
		}
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("bringing up %s in %s: %w", e.Name, e.NS.Name, err)
	}
	e.Index = l.Attrs().Index
	e.MAC = l.Attrs().HardwareAddr
	return nil
}

// waitUp polls until the end reports operational state up, which for a veth
// means both ends are up and the carrier is on.
func waitUp(e *End, deadline time.Time) error {
	h := e.NS.Handle()
	for {
		l, err := h.LinkByIndex(e.Index)
		if err != nil {
			return fmt.Errorf("watching %s in %s: %w", e.Name, e.NS.Name, err)
		}
		if l.Attrs().OperState == netlink.OperUp {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s in %s still %s after %v", e.Name, e.NS.Name, l.Attrs().OperState, carrierTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// addresses returns the four prefixes for a link in the order A4, A6, B4,
// B6: the pinned ones after validation, the rest from a fresh allocator
// slot. release gives the slot back and is safe to call more than once.
func addresses(opts VethOptions) (addrs [4]netip.Prefix, release func(), err error) {
	addrs = [4]netip.Prefix{opts.A4, opts.A6, opts.B4, opts.B6}
	release = func() {}
	allocate := false
	for i, p := range addrs {
		if p == (netip.Prefix{}) {
			allocate = true
			continue
		}
		if err := checkPrefix(p, i%2 == 0); err != nil {
			return addrs, release, err
		}
	}
	if allocate {
		slot, err := slots.get()
		if err != nil {
			return addrs, release, err
		}
		var once sync.Once
		release = func() { once.Do(func() { slots.put(slot) }) }
		for i, p := range slotPrefixes(slot) {
			if addrs[i] == (netip.Prefix{}) {
				addrs[i] = p
			}
		}
	}
	if addrs[0].Addr() == addrs[2].Addr() || addrs[1].Addr() == addrs[3].Addr() {
		release()
		return addrs, func() {}, fmt.Errorf("both ends would have the same address: %v", addrs)
	}
	return addrs, release, nil
}

// checkPrefix is the guard that keeps tests inside the benchmark ranges: p
// must be a valid host address with its whole subnet inside 198.18.0.0/15
// (want4) or 2001:db8::/32.
func checkPrefix(p netip.Prefix, want4 bool) error {
	if !p.IsValid() {
		return fmt.Errorf("invalid address prefix %v", p)
	}
	addr := p.Addr()
	if addr.Is4In6() {
		return fmt.Errorf("address %v: write IPv4 addresses in plain IPv4 form", p)
	}
	bench := bench6
	if want4 {
		bench = bench4
	}
	if addr.Is4() != want4 {
		return fmt.Errorf("address %v: expected an address from %v", p, bench)
	}
	if !bench.Contains(addr) || p.Bits() < bench.Bits() {
		return fmt.Errorf("address %v lies outside %v; tests may only use 198.18.0.0/15 and 2001:db8::/32", p, bench)
	}
	// The all-zeros host is the subnet itself, not an address for an end.
	if p.Bits() < addr.BitLen()-1 && p.Masked().Addr() == addr {
		return fmt.Errorf("address %v is the network address of its subnet", p)
	}
	return nil
}

// maxSlots is how many links may exist at once in one process: 198.18.0.0/15
// holds 512 /24s.
const maxSlots = 512

// slots hands out link numbers. Numbers are returned when a link is removed,
// so a long benchmark that builds and tears down many links does not run out.
// Different test processes may reuse the same numbers; they cannot clash,
// because each process's links live in its own namespaces.
var slots slotAllocator

type slotAllocator struct {
	mu   sync.Mutex
	used [maxSlots]bool
}

// get returns the lowest free slot, so addresses stay small and predictable
// (the first link of a test binary is 198.18.0.1 <-> 198.18.0.2).
func (s *slotAllocator) get() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, u := range s.used {
		if !u {
			s.used[i] = true
			return i, nil
		}
	}
	return 0, fmt.Errorf("all %d veth address slots in use", maxSlots)
}

func (s *slotAllocator) put(i int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.used[i] = false
}

// slotPrefixes maps slot n to 198.18.0.0/15's nth /24 and 2001:db8::/32's
// nth /64, with .1/::1 for end A and .2/::2 for end B, in the order A4, A6,
// B4, B6.
func slotPrefixes(n int) [4]netip.Prefix {
	v4 := func(host byte) netip.Prefix {
		b := bench4.Addr().As4()
		b[1] += byte(n >> 8)
		b[2] = byte(n)
		b[3] = host
		return netip.PrefixFrom(netip.AddrFrom4(b), 24)
	}
	v6 := func(host byte) netip.Prefix {
		b := bench6.Addr().As16()
		b[4] = byte(n >> 8)
		b[5] = byte(n)
		b[15] = host
		return netip.PrefixFrom(netip.AddrFrom16(b), 64)
	}
	return [4]netip.Prefix{v4(1), v6(1), v4(2), v6(2)}
}
