package userstack

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netns"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv6"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/waiter"

	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Options say how to reach the bridge: exactly one of Control, Remote and
// Bridges is set.
type Options struct {
	// App is the application's name, as the bridge's configuration knows it.
	App string
	// Control is the path of the bridge's control socket, for an
	// application on the bridge's own host: the stream is shared memory.
	Control string
	// Remote reaches a bridge on another node: control over TCP, packets
	// over GENEVE.
	Remote *RemoteOptions
	// Bridges registers the application with every bridge of a scale-out
	// group (docs/scale-out.md), in order of preference for sending
	// (bridges.go). One entry is the same as Control or Remote.
	Bridges []Bridge
	// Instance names this process among its application's instances, the
	// same at every bridge (control.Request.Instance). Empty: with one
	// bridge none is sent, as before instances existed; with several,
	// the host's name and the process id.
	Instance string
	// RxSlots and TxSlots ask for ring depths (local streams only); 0 takes
	// the bridge's default.
	RxSlots, TxSlots int
	// MTU caps the packet size below what the bridge and the stream allow;
	// 0 takes theirs.
	MTU int
	// NoGRO turns off receive coalescing (see LinkEndpoint).
	NoGRO bool
	// NoAckDelay sends every pure ACK at once instead of letting it wait
	// up to 1 ms for data to carry it (see LinkConfig).
	NoAckDelay bool
	// Spin is how long the receive loop keeps polling an empty local
	// stream before it sleeps until the bridge signals. Zero, the default,
	// sleeps at once: where cores are shared, a spinning loop holds the
	// CPU that the bridge's loops and the peer need next, which measured
	// costs more than the wake-up it saves (docs/performance.md#the-receive-loop).
	// Give a few tens of µs when the application has cores to itself.
	Spin time.Duration
	// Events, if set, is told when the bridge goes away and when it is
	// back (see EventKind). It is called from one goroutine, in order,
	// and should return quickly: with one bridge, reattaching waits for it
	// (with several, events are queued).
	Events func(Event)

	// ping stands in for control.Client.Ping in the probes of a stack of
	// several bridges (bridges.go), for tests that make a bridge hang.
	ping func(ctx context.Context, bridge string, c *control.Client) error
}

// RemoteOptions reach a bridge on another node.
type RemoteOptions struct {
	// Control is the bridge's control address (host:port).
	Control string
	// Secret is shared with the bridge (see package control).
	Secret []byte
	// TLS, if set, wraps the control connection in TLS (for a bridge that
	// requires mutual TLS too; give it the client certificate).
	TLS *tls.Config
	// Local is where this application's GENEVE endpoint binds. The zero
	// value takes the control connection's local address and any port.
	Local netip.AddrPort
	// Transport tunes the remote transport.
	Transport fabric.RemoteConfig
}

// resetGrace is how long Close waits for the bridge to send the resets of
// aborted connections before the stream goes.
const resetGrace = 20 * time.Millisecond

// controlTimeout bounds the control requests of calls that take no
// context (Listen, ListenPacket, the releases in Close).
const controlTimeout = 10 * time.Second

// claimer is the part of the control client a Stack needs; tests can stand
// in for the bridge with something simpler.
type claimer interface {
	Listen(ctx context.Context, proto string, addr netip.Addr, port uint16) (control.Claim, error)
	Connect(ctx context.Context, proto string, local netip.Addr, remote netip.AddrPort) (control.Claim, error)
	Release(ctx context.Context, id uint64) error
}

// Stack is one application's TCP/IP stack over its stream, with the
// standard library's network interfaces on top. Listen, Dial and
// ListenPacket tell the bridge which tuples to steer here before anything
// is sent; closing what they return gives the tuples back.
type Stack struct {
	ns     *stack.Stack
	ep     *LinkEndpoint // NIC 1's
	addrs  []netip.Addr
	claims claimer
	// bridges is the stack's bridges when there are several; nil with one.
	bridges *bridgeSet
	// single is the one bridge's state otherwise (Bridges).
	single struct {
		name   string
		a      *attachment
		counts *bridgeCounters
	}

	datagramsMu sync.Mutex
	datagrams   map[*waiter.Queue]struct{} // UDP endpoints' queues (wakeDatagramReaders)

	linger lingerer // closed TCP connections that still hold their claim (lingerThenDrop)

	closeOnce sync.Once
	closed    atomic.Bool
	closers   []func() error // control connection first, then the link
	err       error
}

// Open connects to the bridge, registers the application, attaches its
// stream and starts a stack on it. The stack outlives the bridge: when the
// control connection or the stream ends, it registers again under the same
// name, with backoff, asks the new bridge for its listeners and the flows
// of its open connections again, and carries on over the new stream (see
// EventKind for what the stack does meanwhile).
//
// With several Options.Bridges it does so with each of them, and needs only
// one to answer now: it registers with the others in the background
// (bridges.go).
func Open(ctx context.Context, opts Options) (*Stack, error) {
	set := 0
	for _, v := range []bool{opts.Control != "", opts.Remote != nil, len(opts.Bridges) > 0} {
		if v {
			set++
		}
	}
	if set != 1 {
		return nil, errors.New("userstack: set exactly one of Options.Control, Options.Remote and Options.Bridges")
	}
	for i, b := range opts.Bridges {
		if (b.Control == "") == (b.Remote == nil) {
			return nil, fmt.Errorf("userstack: bridge %d: set exactly one of Control and Remote", i+1)
		}
	}
	if len(opts.Bridges) > 1 {
		return openBridges(ctx, opts)
	}
	if len(opts.Bridges) == 1 {
		opts.Control, opts.Remote, opts.Bridges = opts.Bridges[0].Control, opts.Bridges[0].Remote, nil
	}
	dial, closeTransport, backoff := localDialer(opts), func() error { return nil }, backoffMaxLocal
	if opts.Remote != nil {
		rd := &remoteDialer{opts: opts}
		dial, closeTransport, backoff = rd.dial, rd.close, backoffMaxRemote
	}
	counts := new(bridgeCounters)
	events := func(e Event) {
		counts.count(e)
		if opts.Events != nil {
			opts.Events(e)
		}
	}
	a, first, err := newAttachment(ctx, dial, backoff, events)
	if err != nil {
		closeTransport()
		return nil, err
	}
	// The ring the bridge made, whatever was asked: windows must fit it.
	cfg := LinkConfig{MTU: mtuOf(first.reg.MTU, opts.MTU, first.maxPacket), MaxPacket: first.maxPacket, NoGRO: opts.NoGRO, NoAckDelay: opts.NoAckDelay, RxDepth: first.rxDepth}
	s, err := newStack(a.link, cfg, first.reg.Addrs, a, a.Close, a.link.Close, closeTransport)
	if err != nil {
		a.Close()
		a.link.Close()
		closeTransport()
		return nil, err
	}
	s.single.name, s.single.a, s.single.counts = Bridge{Control: opts.Control, Remote: opts.Remote}.String(), a, counts
	s.followMTU(a, opts.MTU)
	return s, nil
}

// localDialer registers with the bridge on this host and attaches its
// shared-memory stream.
func localDialer(opts Options) func(context.Context) (attached, error) {
	return func(ctx context.Context) (attached, error) {
		c, err := control.DialLocal(ctx, opts.Control, opts.App)
		if err != nil {
			return attached{}, err
		}
		c.SetInstance(opts.Instance)
		reg, st, err := c.RegisterLocal(ctx, opts.RxSlots, opts.TxSlots)
		if err != nil {
			c.Close()
			return attached{}, err
		}
		st.SetRecvSpin(opts.Spin)
		return attached{client: c, link: st, closeLink: st.Close, reg: reg, maxPacket: st.MaxPayload(), rxDepth: st.RecvDepth()}, nil
	}
}

// remoteDialer registers with a bridge on another node. Its GENEVE
// endpoint is made at the first registration and serves every later one.
type remoteDialer struct {
	opts Options
	r    *fabric.Remote
	// ns is the network namespace of the thread that called Open. Later
	// registrations dial from a goroutine of their own, whose thread may
	// be in another (an application that opened its stack inside
	// netns.Set, as the tests' remote hosts do).
	ns     netns.NsHandle
	pinned bool
}

// pinNetns makes the calling thread's network namespace the one every
// registration dials from.
func (d *remoteDialer) pinNetns() {
	var err error
	if d.ns, err = netns.Get(); err != nil {
		d.ns = netns.None()
	}
	d.pinned = true
}

func (d *remoteDialer) dial(ctx context.Context) (at attached, err error) {
	if !d.pinned {
		d.pinNetns()
		return d.dialHere(ctx)
	}
	if nerr := inNetns(d.ns, func() { at, err = d.dialHere(ctx) }); nerr != nil {
		return attached{}, fmt.Errorf("%w: the application's network namespace: %v", control.ErrBridgeGone, nerr)
	}
	return at, err
}

// inNetns runs fn on a thread in ns (none: wherever it runs).
func inNetns(ns netns.NsHandle, fn func()) error {
	if !ns.IsOpen() {
		fn()
		return nil
	}
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	if orig.Equal(ns) {
		runtime.UnlockOSThread()
		fn()
		return nil
	}
	if err := netns.Set(ns); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	fn()
	if err := netns.Set(orig); err != nil {
		return err // the thread stays locked and ends with its goroutine
	}
	runtime.UnlockOSThread()
	return nil
}

func (d *remoteDialer) dialHere(ctx context.Context) (attached, error) {
	ro := d.opts.Remote
	var nd net.Dialer
	conn, err := nd.DialContext(ctx, "tcp", ro.Control)
	if err != nil {
		return attached{}, control.Unreachable(ro.Control, err)
	}
	if ro.TLS != nil {
		tc := tls.Client(conn, ro.TLS)
		if err := tc.HandshakeContext(ctx); err != nil {
			conn.Close()
			return attached{}, fmt.Errorf("userstack: TLS to the bridge: %w", err)
		}
		conn = tc
	}
	c, err := control.DialRemoteConn(ctx, conn, d.opts.App, ro.Secret)
	if err != nil {
		return attached{}, err
	}
	c.SetInstance(d.opts.Instance)
	fail := func(err error) (attached, error) {
		c.Close()
		return attached{}, err
	}
	if d.r == nil {
		local := ro.Local
		if !local.IsValid() {
			ta, ok := c.LocalAddr().(*net.TCPAddr)
			if !ok {
				return fail(fmt.Errorf("userstack: control connection's local address %v is not TCP", c.LocalAddr()))
			}
			local = netip.AddrPortFrom(ta.AddrPort().Addr().Unmap(), 0)
		}
		if d.r, err = fabric.ListenRemote(local, ro.Transport); err != nil {
			return fail(err)
		}
	}
	reg, err := c.RegisterRemote(ctx, d.r.LocalAddr())
	if err != nil {
		return fail(err)
	}
	rs, err := d.r.Register(reg.Stream, reg.Geneve)
	if err != nil {
		return fail(err)
	}
	return attached{client: c, link: rs, closeLink: rs.Close, reg: reg, maxPacket: rs.MaxPayload()}, nil
}

func (d *remoteDialer) close() error {
	if d.ns.IsOpen() {
		d.ns.Close()
	}
	if d.r == nil {
		return nil
	}
	return d.r.Close()
}

// mtuOf is the smallest positive of the bridge's MTU, the caller's cap and
// what the stream carries.
func mtuOf(bridge, capped, stream int) int {
	m := stream
	for _, v := range []int{bridge, capped} {
		if v > 0 && v < m {
			m = v
		}
	}
	return m
}

// newStack starts a stack over link. closers run in order on Close.
func newStack(link Link, cfg LinkConfig, addrs []netip.Addr, claims claimer, closers ...func() error) (*Stack, error) {
	if len(addrs) == 0 {
		return nil, errors.New("userstack: the bridge gave this application no address")
	}
	ep, err := NewLinkEndpoint(link, cfg)
	if err != nil {
		return nil, err
	}
	s := &Stack{ep: ep, addrs: slices.Clone(addrs), claims: claims, closers: closers, datagrams: make(map[*waiter.Queue]struct{})}
	ep.afterICMPError = s.wakeDatagramReaders
	if s.ns, err = newNetstack(ep, addrs, receiveBufferMax(cfg.RxDepth, int(ep.MTU()))); err != nil {
		return nil, err
	}
	return s, nil
}

// wakeDatagramReaders wakes every UDP endpoint's readers after an ICMP
// error reached the stack. gVisor records the error on the connected
// endpoint it concerns (a Read then returns it, ECONNREFUSED for a port
// unreachable) but does not wake a Read already waiting, which would
// sleep on until data or its deadline came; a kernel socket's waiting
// read returns the error at once. Readers with nothing pending read
// again and go back to sleep. ICMP errors are rare, and each costs one
// wake-up per open UDP endpoint.
func (s *Stack) wakeDatagramReaders() {
	s.datagramsMu.Lock()
	defer s.datagramsMu.Unlock()
	for wq := range s.datagrams {
		wq.Notify(waiter.ReadableEvents)
	}
}

func (s *Stack) addDatagramQueue(wq *waiter.Queue) {
	s.datagramsMu.Lock()
	s.datagrams[wq] = struct{}{}
	s.datagramsMu.Unlock()
}

func (s *Stack) removeDatagramQueue(wq *waiter.Queue) {
	s.datagramsMu.Lock()
	delete(s.datagrams, wq)
	s.datagramsMu.Unlock()
}

// Addrs are the addresses the stack sends from.
func (s *Stack) Addrs() []netip.Addr { return slices.Clone(s.addrs) }

// LinkStats are the counters of the stack's link endpoint; with several
// bridges, the sums over their NICs.
func (s *Stack) LinkStats() LinkStats {
	var t LinkStats
	for _, ep := range s.linkEndpoints() {
		t.add(ep.Stats())
	}
	return t
}

// Bridges is the state of each of the stack's bridges, in the order they
// were given.
func (s *Stack) Bridges() []BridgeState {
	if s.bridges != nil {
		return s.bridges.states()
	}
	if s.single.a == nil {
		return nil // a stack of the tests', over a bare link
	}
	c, _ := s.single.a.current()
	st := s.ep.Stats()
	return []BridgeState{{
		Name: s.single.name, Up: c != nil, Sending: c != nil,
		Losses: s.single.counts.losses.Load(), ClaimFailures: s.single.counts.claimFailures.Load(),
		DrainFailures: s.single.counts.drainFailures.Load(), TxPackets: st.TxPackets, Link: st,
	}}
}

// takeUnreach takes the errno noted for flow k by whichever NIC's receive
// loop saw the ICMP error (unreach6.go).
func (s *Stack) takeUnreach(k flowKey) (syscall.Errno, bool) {
	if s.bridges == nil {
		return s.ep.unreach.take(k)
	}
	var errno syscall.Errno
	found := false
	for _, ep := range s.bridges.endpoints() {
		if e, ok := ep.unreach.take(k); ok && !found {
			errno, found = e, true
		}
	}
	return errno, found
}

// Close aborts every connection (peers get a reset), ends the control
// connection, whereupon the bridge releases everything this stack held,
// and closes the stream.
func (s *Stack) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		// Abort every connection while the bridge still lets the resets
		// out, and give it a moment to take them from the ring: peers
		// learn at once that the application is gone instead of timing out.
		eps := s.ns.RegisteredEndpoints()
		s.ns.Close()
		for _, e := range eps {
			e.Wait()
		}
		if len(eps) > 0 {
			time.Sleep(resetGrace)
		}
		var errs []error
		for _, c := range s.closers {
			if err := c(); err != nil {
				errs = append(errs, err)
			}
		}
		// The links are closed: let each receive loop finish the packet it
		// may be delivering and end. gVisor's Wait holds the stack's lock
		// while it waits for them, and a loop whose last packet needs that
		// lock (a route for a reset, say) would wait for it for ever.
		for _, ep := range s.linkEndpoints() {
			ep.Wait()
		}
		s.ns.Wait()
		s.err = errors.Join(errs...)
	})
	return s.err
}

// linkEndpoints are the stack's NICs' endpoints.
func (s *Stack) linkEndpoints() []*LinkEndpoint {
	if s.bridges != nil {
		return s.bridges.endpoints()
	}
	return []*LinkEndpoint{s.ep}
}

// lease is one claim at the bridge, given back when its last holder lets
// go: a listener and each connection it accepted hold the listener's claim,
// so connections outlive their listener, as with kernel sockets.
type lease struct {
	s    *Stack
	id   uint64
	refs atomic.Int32
}

func (s *Stack) newLease(id uint64) *lease {
	l := &lease{s: s, id: id}
	l.refs.Store(1)
	return l
}

func (l *lease) hold() { l.refs.Add(1) }

func (l *lease) drop() {
	if l.refs.Add(-1) != 0 || l.s.closed.Load() {
		return // others hold it, or the whole lease is gone with the stack
	}
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	l.s.claims.Release(ctx, l.id) // a bridge that is gone has released it already
}

// endpoint parsing

type netKind struct {
	proto  string // "tcp" or "udp"
	family int    // 0 (either), 4 or 6
}

func parseNetwork(network string) (netKind, error) {
	switch network {
	case "tcp", "udp":
		return netKind{network, 0}, nil
	case "tcp4", "udp4":
		return netKind{network[:3], 4}, nil
	case "tcp6", "udp6":
		return netKind{network[:3], 6}, nil
	}
	return netKind{}, net.UnknownNetworkError(network)
}

// parseAddr splits host:port; an empty host is the invalid Addr. Names are
// not resolved: the stack has no resolver of its own.
func parseAddr(address string) (netip.Addr, uint16, error) {
	host, port, err := net.SplitHostPort(address)
	if err != nil {
		return netip.Addr{}, 0, err
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.Addr{}, 0, fmt.Errorf("port %q is not a number from 0 to 65535", port)
	}
	if host == "" {
		return netip.Addr{}, uint16(p), nil
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}, 0, fmt.Errorf("%q is not an IP address (this stack resolves no names)", host)
	}
	if a.Zone() != "" {
		return netip.Addr{}, 0, fmt.Errorf("%q: zones are not supported", host)
	}
	return a.Unmap(), uint16(p), nil
}

func (s *Stack) has(family int) bool {
	for _, a := range s.addrs {
		if (family == 4) == a.Is4() {
			return true
		}
	}
	return false
}

// localFor resolves a listening address: which address to claim at the
// bridge and which network protocol the stack endpoint uses. An empty host
// listens on both families when the stack has both (an IPv6 endpoint that
// also takes IPv4, as Linux does).
func (s *Stack) localFor(k netKind, a netip.Addr) (netip.Addr, tcpip.NetworkProtocolNumber, error) {
	if a.IsValid() {
		if (k.family == 4 && !a.Is4()) || (k.family == 6 && a.Is4()) {
			return a, 0, fmt.Errorf("address %v is not IPv%d", a, k.family)
		}
		if !a.IsUnspecified() && !slices.Contains(s.addrs, a) {
			return a, 0, fmt.Errorf("address %v is not one of this stack's %v", a, s.addrs)
		}
		return a, protoOf(a), nil
	}
	fam := k.family
	if fam == 0 {
		switch {
		case s.has(4) && s.has(6):
			return netip.Addr{}, ipv6.ProtocolNumber, nil
		case s.has(4):
			fam = 4
		default:
			fam = 6
		}
	}
	if !s.has(fam) {
		return a, 0, fmt.Errorf("this stack has no IPv%d address", fam)
	}
	if fam == 4 {
		return netip.IPv4Unspecified(), ipv4.ProtocolNumber, nil
	}
	return netip.IPv6Unspecified(), ipv6.ProtocolNumber, nil
}

func protoOf(a netip.Addr) tcpip.NetworkProtocolNumber {
	if a.Is4() {
		return ipv4.ProtocolNumber
	}
	return ipv6.ProtocolNumber
}

// fullAddr is a tcpip address; the unspecified and invalid addresses both
// bind to any.
func fullAddr(a netip.Addr, port uint16) tcpip.FullAddress {
	f := tcpip.FullAddress{NIC: nicID, Port: port}
	if a.IsValid() && !a.IsUnspecified() {
		f.Addr = tcpip.AddrFromSlice(a.AsSlice())
	}
	return f
}

func opError(op string, k netKind, addr net.Addr, err error) error {
	return &net.OpError{Op: op, Net: k.proto, Addr: addr, Err: err}
}

func tcpAddr(a netip.Addr, port uint16) *net.TCPAddr {
	if !a.IsValid() {
		a = netip.IPv6Unspecified()
	}
	return net.TCPAddrFromAddrPort(netip.AddrPortFrom(a, port))
}

func udpAddr(a netip.Addr, port uint16) *net.UDPAddr {
	if !a.IsValid() {
		a = netip.IPv6Unspecified()
	}
	return net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, port))
}

// tcpipErr wraps a gVisor error for net.OpError.
type tcpipErr struct{ e tcpip.Error }

func (e tcpipErr) Error() string { return e.e.String() }
func (e tcpipErr) Timeout() bool {
	_, ok := e.e.(*tcpip.ErrTimeout)
	return ok
}

// ErrClosed is returned by operations on a closed Stack.
var ErrClosed = errors.New("userstack: stack closed")

func (s *Stack) checkOpen() error {
	if s.closed.Load() {
		return ErrClosed
	}
	return nil
}
