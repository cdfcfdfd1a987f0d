package userstack

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"

	"github.com/fabricbridge/fabricbridge/control"
)

// A stack of several bridges (Options.Bridges) is registered with every
// bridge box of a scale-out group, so that whichever box the routers' ECMP
// picks for a packet can steer it here:
//
//   - Receive: every bridge's stream is a NIC of its own, all NICs carry
//     the application's addresses, and gVisor's endpoints are bound to no
//     NIC, so a connection's packets reach the same endpoint through any
//     bridge.
//   - Transmit: every NIC sends through one bridge, the first of the list
//     that is attached (txPath); when it goes, the next attached one takes
//     over, and when it is back it sends again. Established connections
//     move with it: their packets leave through whichever bridge is first.
//     A bridge that is attached but does not answer its probes (probe) is
//     passed over while another answers.
//   - Claims go to every bridge. The first attached bridge grants a claim
//     as with one bridge (it picks a Dial's port, or a Listen's port 0);
//     the others are asked for exactly that claim by number
//     (control.Client.Reclaim), the way a bridge that restarted is asked
//     again for the claims of connections that outlived it. A bridge that
//     is away is asked when it is back. A bridge that refuses (a port its
//     other applications hold) does not fail the call while the first
//     granted it: the refusal is a ClaimLost event and counted
//     (BridgeState.ClaimFailures).
//   - Each bridge is kept attached on its own as a single bridge is
//     (reconnect.go); Open needs one of them to answer, and registers with
//     the others in the background from then on.

// Bridge is one bridge of Options.Bridges: exactly one of Control (the
// bridge on this host: shared memory) and Remote (another node: GENEVE).
type Bridge struct {
	Control string
	Remote  *RemoteOptions
}

// String names the bridge in events and states: its control socket or
// address.
func (b Bridge) String() string {
	if b.Remote != nil {
		return b.Remote.Control
	}
	return b.Control
}

// BridgeState is one bridge of a stack, as Stack.Bridges reports it.
type BridgeState struct {
	Name string
	// Up: registered, the stream attached.
	Up bool
	// Sending: the stack's packets leave through this bridge.
	Sending bool
	// Responsive: the bridge answered its last probe (false also while a
	// bridge that was lost has not answered since it is back).
	Responsive bool
	// Losses counts the times the bridge went away; ClaimFailures the
	// claims it refused (ClaimLost events); DrainFailures the times it
	// would not drain the stack (DrainFailed events); Unresponsive the
	// times it stopped answering its probes (BridgeUnresponsive events),
	// each a switch of the sending bridge away from it while another
	// answered.
	Losses, ClaimFailures, DrainFailures, Unresponsive uint64
	// TxPackets counts the packets sent through this bridge.
	TxPackets uint64
	// Link is the counters of the bridge's NIC: its Rx* count what arrived
	// through this bridge, its Tx* what the stack's routes handed this NIC
	// (which leaves through the sending bridge). Zero until the bridge
	// first registered.
	Link LinkStats
}

// errBridgeMismatch: a bridge of the list gives the application other
// addresses than the first one it registered with. The boxes of a group
// must agree, or connections through one box would use addresses the other
// does not steer.
var errBridgeMismatch = errors.New("userstack: the bridges disagree")

// openGrace is how long Open waits for the other bridges once one has
// answered; those that have not by then register in the background.
const openGrace = time.Second

// bridgeCounters are one bridge's counts for BridgeState.
type bridgeCounters struct {
	losses, claimFailures, drainFailures, unresponsive atomic.Uint64
}

// count notes e in c.
func (c *bridgeCounters) count(e Event) {
	switch e.Kind {
	case BridgeLost:
		c.losses.Add(1)
	case ClaimLost:
		c.claimFailures.Add(1)
	case DrainFailed:
		c.drainFailures.Add(1)
	case BridgeUnresponsive:
		c.unresponsive.Add(1)
	}
}

// defaultInstance names this process among its application's instances
// when Options.Instance is empty: unique on the host while it runs, and the
// same at every bridge. Characters control's names do not allow become '-'.
func defaultInstance() string {
	host, _ := os.Hostname()
	host = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' {
			return r
		}
		return '-'
	}, host)
	pid := fmt.Sprintf("-%d", os.Getpid())
	if host == "" {
		host = "instance"
	}
	return host[:min(len(host), 64-len(pid))] + pid
}

// bridgeSet is the claimer of a stack of several bridges and the keeper of
// their NICs.
type bridgeSet struct {
	names    []string
	atts     []*attachment
	counts   []bridgeCounters
	tx       txPath
	closing  chan struct{} // closed by Close
	ready    chan struct{} // closed once Open has built the stack, or failed
	capMTU   int
	noGRO    bool
	noDelack bool
	events   eventQueue
	closeFns []func() error

	mu      sync.Mutex
	s       *Stack          // nil until built
	eps     []*LinkEndpoint // by bridge; nil until its first registration
	mtus    []int           // by bridge: its MTU (0: not known yet)
	nextNIC tcpip.NICID
	rcvMax  int           // the TCP receive buffer's bound (receiveBufferMax)
	wake    chan struct{} // closed, and replaced, when a bridge attaches

	claimsMu  sync.Mutex
	claims    map[uint64][]uint64 // the set's claim id -> each bridge's (0: none)
	nextClaim uint64
}

// openBridges opens a stack registered with every bridge of opts.Bridges.
func openBridges(ctx context.Context, opts Options) (*Stack, error) {
	n := len(opts.Bridges)
	b := &bridgeSet{
		names: make([]string, n), atts: make([]*attachment, n), counts: make([]bridgeCounters, n),
		closing: make(chan struct{}), ready: make(chan struct{}), capMTU: opts.MTU, noGRO: opts.NoGRO, noDelack: opts.NoAckDelay,
		eps: make([]*LinkEndpoint, n), mtus: make([]int, n), nextNIC: nicID, wake: make(chan struct{}),
		claims: make(map[uint64][]uint64),
	}
	b.tx.init(n)
	if opts.Instance == "" {
		opts.Instance = defaultInstance()
	}
	dials := make([]func(context.Context) (attached, error), n)
	var closeTransports []func() error
	for i, br := range opts.Bridges {
		b.names[i] = br.String()
		o := opts
		o.Control, o.Remote, o.Bridges = br.Control, br.Remote, nil
		if br.Remote == nil {
			dials[i] = localDialer(o)
		} else {
			rd := &remoteDialer{opts: o}
			// The dials run on goroutines of their own, whose threads
			// need not be in the caller's network namespace.
			rd.pinNetns()
			dials[i] = rd.dial
			closeTransports = append(closeTransports, rd.close)
		}
	}
	closeAll := func() {
		for _, c := range closeTransports {
			c()
		}
	}
	first, errs := firstRound(ctx, dials)
	home := slices.IndexFunc(first, func(at attached) bool { return at.client != nil })
	if home < 0 {
		closeAll()
		return nil, errors.Join(errs...)
	}
	addrs := first[home].reg.Addrs
	for i, at := range first {
		if at.client != nil && !sameAddrs(at.reg.Addrs, addrs) {
			at.close()
			first[i] = attached{} // it tries again, and is refused, in the background
		}
	}
	b.events.init(opts.Events, b.closing) // ends with closeAttachments
	for i := range b.atts {
		join := func(ctx context.Context) (attached, error) {
			at, err := dials[i](ctx)
			if err == nil {
				if err = b.join(ctx, i, at); err != nil {
					at.close()
				}
			}
			return at, err
		}
		b.atts[i] = startAttachment(join, backoffOf(opts.Bridges[i]), b.eventsOf(i), first[i])
		b.tx.links[i] = b.atts[i].link
		f := b.mtuFollower(i)
		b.atts[i].mtu.Store(&f)
	}
	b.closeFns = append(b.closeFns, b.startProbes(opts.ping), b.closeAttachments, b.closeLinks)
	b.closeFns = append(b.closeFns, closeTransports...)

	s, err := b.build(first, home, opts)
	close(b.ready)
	if err != nil {
		for _, c := range b.closeFns {
			c()
		}
		return nil, err
	}
	return s, nil
}

// build makes the stack over the bridges that answered in the first round:
// NIC 1 for home's stream, one more for each other's.
func (b *bridgeSet) build(first []attached, home int, opts Options) (*Stack, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, at := range first {
		if at.client != nil {
			b.mtus[i] = at.reg.MTU
		}
	}
	at := first[home]
	cfg := LinkConfig{MTU: b.mtuLocked(at.maxPacket), MaxPacket: at.maxPacket, NoGRO: opts.NoGRO, NoAckDelay: opts.NoAckDelay, RxDepth: at.rxDepth}
	s, err := newStack(nicLink{rx: b.atts[home].link, tx: &b.tx}, cfg, at.reg.Addrs, b)
	if err != nil {
		return nil, err
	}
	b.s, s.bridges = s, b
	b.eps[home] = s.ep
	b.rcvMax = receiveBufferMax(at.rxDepth, int(s.ep.MTU()))
	b.nextNIC++
	for i, at := range first {
		if at.client != nil && i != home {
			if err := b.addNICLocked(i, at); err != nil {
				s.ns.Close() // the receive loops end as closeFns close the links
				return nil, err
			}
		}
	}
	b.applyMTULocked()
	s.closers = b.closeFns
	return s, nil
}

// firstRound registers with every bridge at once. Once one has answered,
// the others get openGrace more.
func firstRound(ctx context.Context, dials []func(context.Context) (attached, error)) ([]attached, []error) {
	rest, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		i   int
		at  attached
		err error
	}
	results := make(chan result, len(dials))
	for i, dial := range dials {
		go func() {
			at, err := dial(rest)
			results <- result{i, at, err}
		}()
	}
	first := make([]attached, len(dials))
	var errs []error
	var grace <-chan time.Time
	for range dials {
		var r result
		select {
		case r = <-results:
		case <-grace:
			cancel()
			r = <-results
		}
		if r.err != nil {
			errs = append(errs, r.err)
			continue
		}
		first[r.i] = r.at
		if grace == nil {
			grace = time.After(openGrace)
		}
	}
	return first, errs
}

func backoffOf(br Bridge) time.Duration {
	if br.Remote != nil {
		return backoffMaxRemote
	}
	return backoffMaxLocal
}

func sameAddrs(a, b []netip.Addr) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.SortFunc(a, netip.Addr.Compare)
	slices.SortFunc(b, netip.Addr.Compare)
	return slices.Equal(a, b)
}

// join readies the stack for bridge i's registration at, before its claims
// are asked again: its NIC, at its first registration.
func (b *bridgeSet) join(ctx context.Context, i int, at attached) error {
	select {
	case <-b.ready:
	case <-ctx.Done():
		return ctx.Err()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.s == nil || b.s.closed.Load() {
		return ErrClosed
	}
	if !sameAddrs(at.reg.Addrs, b.s.addrs) {
		return fmt.Errorf("%w: this bridge gives the application %v, the first gave %v", errBridgeMismatch, at.reg.Addrs, b.s.addrs)
	}
	if b.eps[i] != nil {
		return nil
	}
	return b.addNICLocked(i, at)
}

// addNICLocked gives bridge i its NIC. b.mu is held.
func (b *bridgeSet) addNICLocked(i int, at attached) error {
	b.mtus[i] = at.reg.MTU
	cfg := LinkConfig{MTU: b.mtuLocked(at.maxPacket), MaxPacket: at.maxPacket, NoGRO: b.noGRO, NoAckDelay: b.noDelack, RxDepth: at.rxDepth}
	ep, err := NewLinkEndpoint(nicLink{rx: b.atts[i].link, tx: &b.tx}, cfg)
	if err != nil {
		return err
	}
	ep.afterICMPError = b.s.wakeDatagramReaders
	ep.conns = b.s.ns // for the second chance, as NIC 1's (newNetstack)
	nic := b.nextNIC
	if err := addNIC(b.s.ns, nic, ep, b.s.addrs); err != nil {
		return err
	}
	// A connection accepted through this NIC routes through it: a default
	// route of its own, after NIC 1's, which routes everything else.
	if b.s.has(4) {
		b.s.ns.AddRoute(tcpip.Route{Destination: header.IPv4EmptySubnet, NIC: nic})
	}
	if b.s.has(6) {
		b.s.ns.AddRoute(tcpip.Route{Destination: header.IPv6EmptySubnet, NIC: nic})
	}
	b.nextNIC++
	b.eps[i] = ep
	b.applyMTULocked()
	// Windows must fit the smallest ring that drops (a local stream's),
	// whichever bridge came first.
	if m := receiveBufferMax(at.rxDepth, int(ep.MTU())); m < b.rcvMax {
		if err := b.s.ns.SetTransportProtocolOption(tcp.ProtocolNumber, receiveBufferOption(m)); err != nil {
			return fmt.Errorf("userstack: bounding TCP receive buffers: %v", err)
		}
		b.rcvMax = m
	}
	return nil
}

// mtuLocked is the MTU every NIC uses: the smallest of the bridges' (known
// so far), the caller's cap and every NIC's largest packet (and
// maxPacket's, a NIC about to be made), since any NIC's packets may leave
// through any bridge. b.mu is held.
func (b *bridgeSet) mtuLocked(maxPacket int) int {
	m := maxPacket
	for i, ep := range b.eps {
		if ep != nil {
			m = min(m, ep.maxPacket)
		}
		m = mtuOf(b.mtus[i], 0, m)
	}
	return mtuOf(m, b.capMTU, m)
}

func (b *bridgeSet) applyMTULocked() {
	m := b.mtuLocked(math.MaxInt32)
	for _, ep := range b.eps {
		if ep != nil {
			ep.SetMTU(uint32(m))
		}
	}
}

// mtuFollower is bridge i's part in followMTU.
func (b *bridgeSet) mtuFollower(i int) func(int) {
	return func(mtu int) {
		b.mu.Lock()
		defer b.mu.Unlock()
		b.mtus[i] = mtu
		if b.s != nil {
			b.applyMTULocked()
		}
	}
}

// eventsOf is bridge i's event handler: it counts, wakes claims waiting
// for a bridge, and tells the caller which bridge it was.
func (b *bridgeSet) eventsOf(i int) func(Event) {
	return func(e Event) {
		b.counts[i].count(e)
		if e.Kind == BridgeBack {
			b.mu.Lock()
			close(b.wake)
			b.wake = make(chan struct{})
			b.mu.Unlock()
		}
		e.Bridge = b.names[i]
		b.events.push(e)
	}
}

// eventQueue hands a stack's events to the caller's handler on a goroutine
// of its own, one at a time and in order. The bridges' goroutines, and a
// claim that a bridge refused, only queue them: a handler may make claims,
// whose refusals are events again.
type eventQueue struct {
	fn   func(Event)
	mu   sync.Mutex
	q    []Event
	kick chan struct{}
}

func (e *eventQueue) init(fn func(Event), done <-chan struct{}) {
	if fn == nil {
		return
	}
	e.fn, e.kick = fn, make(chan struct{}, 1)
	go e.run(done)
}

func (e *eventQueue) push(ev Event) {
	if e.fn == nil {
		return
	}
	e.mu.Lock()
	e.q = append(e.q, ev)
	e.mu.Unlock()
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

// run calls the handler until done, and for what was queued by then.
func (e *eventQueue) run(done <-chan struct{}) {
	for {
		if e.drain() > 0 {
			continue
		}
		select {
		case <-e.kick:
		case <-done:
			e.drain()
			return
		}
	}
}

// drain hands the handler what is queued and says how much that was.
func (e *eventQueue) drain() int {
	e.mu.Lock()
	q := e.q
	e.q = nil
	e.mu.Unlock()
	for _, ev := range q {
		e.fn(ev)
	}
	return len(q)
}

// lead is the first attached bridge, the one that grants claims, waiting
// for one within ctx.
func (b *bridgeSet) lead(ctx context.Context) (int, *control.Client, uint64, error) {
	for {
		b.mu.Lock()
		wake := b.wake
		b.mu.Unlock()
		for i, a := range b.atts {
			if c, gen := a.current(); c != nil {
				return i, c, gen, nil
			}
		}
		select {
		case <-wake:
		case <-b.closing:
			return 0, nil, 0, ErrClosed
		case <-ctx.Done():
			return 0, nil, 0, fmt.Errorf("%w, none of %d: %w", ErrBridgeUnavailable, len(b.atts), ctx.Err())
		}
	}
}

// claim has the lead grant a claim, then every other bridge adopt it.
func (b *bridgeSet) claim(ctx context.Context, r claimRequest) (control.Claim, error) {
	for {
		i, c, gen, err := b.lead(ctx)
		if err != nil {
			return control.Claim{}, err
		}
		cl, err := b.atts[i].grantAt(c, gen, r)
		if errors.Is(err, errStale) {
			continue
		}
		if errors.Is(err, control.ErrBridgeGone) && ctx.Err() == nil {
			select { // the next attached bridge leads once this one is detached
			case <-c.Done():
			case <-ctx.Done():
			}
			continue
		}
		if err != nil {
			return cl, err
		}
		ids := make([]uint64, len(b.atts))
		ids[i] = cl.ID
		held := r.held(cl)
		for j, a := range b.atts {
			if j == i {
				continue
			}
			var err error
			if ids[j], err = a.adopt(ctx, held); err != nil {
				b.eventsOf(j)(Event{Kind: ClaimLost, Err: fmt.Errorf("userstack: %v: %w", &held, err)})
			}
		}
		b.claimsMu.Lock()
		b.nextClaim++
		cl.ID = b.nextClaim
		b.claims[cl.ID] = ids
		b.claimsMu.Unlock()
		return cl, nil
	}
}

// Listen implements claimer.
func (b *bridgeSet) Listen(ctx context.Context, proto string, addr netip.Addr, port uint16) (control.Claim, error) {
	return b.claim(ctx, listenRequest(ctx, proto, addr, port))
}

// Connect implements claimer.
func (b *bridgeSet) Connect(ctx context.Context, proto string, local netip.Addr, remote netip.AddrPort) (control.Claim, error) {
	return b.claim(ctx, connectRequest(ctx, proto, local, remote))
}

// Release implements claimer: every bridge gives the claim back.
func (b *bridgeSet) Release(ctx context.Context, id uint64) error {
	b.claimsMu.Lock()
	ids, ok := b.claims[id]
	delete(b.claims, id)
	b.claimsMu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %d", control.ErrUnknownClaim, id)
	}
	var errs []error
	for j, bid := range ids {
		if bid != 0 {
			if err := b.atts[j].Release(ctx, bid); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", b.names[j], err))
			}
		}
	}
	return errors.Join(errs...)
}

func (b *bridgeSet) closeAttachments() error {
	close(b.closing)
	for _, a := range b.atts {
		a.Close()
	}
	return nil
}

func (b *bridgeSet) closeLinks() error {
	for _, a := range b.atts {
		a.link.Close()
	}
	return nil
}

func (b *bridgeSet) states() []BridgeState {
	b.mu.Lock()
	eps := slices.Clone(b.eps)
	b.mu.Unlock()
	sending := b.tx.sending()
	out := make([]BridgeState, len(b.atts))
	for i, a := range b.atts {
		c, _ := a.current()
		out[i] = BridgeState{
			Name: b.names[i], Up: c != nil, Sending: i == sending,
			Responsive: !b.tx.unresponsive[i].Load(),
			Losses:     b.counts[i].losses.Load(), ClaimFailures: b.counts[i].claimFailures.Load(),
			DrainFailures: b.counts[i].drainFailures.Load(), Unresponsive: b.counts[i].unresponsive.Load(),
			TxPackets: b.tx.sent[i].Load(),
		}
		if eps[i] != nil {
			out[i].Link = eps[i].Stats()
		}
	}
	return out
}

// endpoints are the NICs' link endpoints made so far.
func (b *bridgeSet) endpoints() []*LinkEndpoint {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(b.eps), func(ep *LinkEndpoint) bool { return ep == nil })
}

// txPath sends every NIC's packets through the first bridge of the list
// whose stream is attached and that answers its probes; the first attached
// one when none answers, since a bridge slow to answer may still send.
// Its lock keeps each stream's Send single-producer, as Link requires,
// across the NICs.
type txPath struct {
	mu           sync.Mutex
	links        []*relink
	sent         []atomic.Uint64
	unresponsive []atomic.Bool // by bridge: its last probe went unanswered
}

func (t *txPath) init(n int) {
	t.links = make([]*relink, n)
	t.sent = make([]atomic.Uint64, n)
	t.unresponsive = make([]atomic.Bool, n)
}

// Send implements Link's Send. With no stream attached anywhere it drops
// the packets as relink does, for the same reason.
func (t *txPath) Send(pkts [][]byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	i := t.sending()
	if i < 0 {
		return len(pkts), nil
	}
	n, err := t.links[i].Send(pkts)
	t.sent[i].Add(uint64(n))
	return n, err
}

// sending is the bridge the next packets leave through; -1: none is
// attached.
func (t *txPath) sending() int {
	first := -1
	for i, r := range t.links {
		if l, _, closed := r.current(); l == nil || closed {
			continue
		}
		if !t.unresponsive[i].Load() {
			return i
		}
		if first < 0 {
			first = i
		}
	}
	return first
}

// nicLink is the Link of one bridge's NIC: it receives from that bridge's
// stream and sends through the txPath. It is a MarkedLink, so that the
// stack takes part in the second chance of a listener it shares: without
// it, a drained instance's connections, or those of an instance that joined,
// would be reset by the instance whose slot they now hash to.
type nicLink struct {
	rx *relink
	tx *txPath
}

func (l nicLink) Recv(bufs [][]byte) (int, error) { return l.rx.Recv(bufs) }
func (l nicLink) Send(pkts [][]byte) (int, error) { return l.tx.Send(pkts) }

func (l nicLink) RecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	return l.rx.RecvMeta(bufs, meta)
}

// SendMeta hands packets back to the bridge they arrived through, whose
// tables know the slot's previous owner; under the txPath's lock, which
// keeps that stream's Send single-producer.
func (l nicLink) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	l.tx.mu.Lock()
	defer l.tx.mu.Unlock()
	return l.rx.SendMeta(pkts, meta)
}
