package userstack

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// EventKind says what happened between a stack and its bridge.
type EventKind int

const (
	// BridgeLost: the control connection or the stream ended (Event.Err
	// says why). The stack lives on and attaches again as soon as a bridge
	// answers: connections keep their state and TCP sends again what is
	// lost meanwhile, Accept keeps waiting, Dial waits for the bridge
	// within its context.
	BridgeLost EventKind = iota + 1
	// BridgeBack: registered again, the stream attached and the claims
	// made again; Event.Down is how long the bridge was away.
	BridgeBack
	// ClaimLost: a listener or flow could not be claimed again after the
	// bridge came back, most likely because another application took its
	// port meanwhile (Event.Err names it). Its packets no longer reach
	// this stack.
	ClaimLost
	// BridgeRefused: a bridge answered but would not register the stack
	// again (Event.Err says why: the application is no longer permitted,
	// its name is in use...) a few times in a row. The stack tries again
	// every refusedBackoff from then on; the event comes again only when
	// the reason changes.
	BridgeRefused
	// DrainFailed: a bridge would not drain a stack that drains
	// (Stack.Drain), while another did or when it came back (Event.Err
	// says why). It may send the stack new connections.
	DrainFailed
	// BridgeUnresponsive: a bridge of several (Options.Bridges) stopped
	// answering on its control connection, which stays open: its process
	// hangs or is stopped. Packets leave through another bridge that
	// answers until it does again.
	BridgeUnresponsive
	// BridgeResponsive: a bridge that was unresponsive answers again and
	// sends again if it is the first; Event.Down is how long it did not.
	BridgeResponsive
)

func (k EventKind) String() string {
	switch k {
	case BridgeLost:
		return "bridge lost"
	case BridgeBack:
		return "bridge back"
	case ClaimLost:
		return "claim lost"
	case BridgeRefused:
		return "bridge refused"
	case DrainFailed:
		return "drain failed"
	case BridgeUnresponsive:
		return "bridge unresponsive"
	case BridgeResponsive:
		return "bridge responsive"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is a change in a stack's attachment to its bridge (see
// Options.Events).
type Event struct {
	Kind EventKind
	Err  error         // BridgeLost: why; ClaimLost: which claim and why
	Down time.Duration // BridgeBack, BridgeResponsive: since the bridge was lost, unresponsive
	// Bridge names the bridge of a stack opened with several
	// (Options.Bridges): its control socket or address. Empty with one.
	Bridge string
}

func (e Event) String() string {
	var s string
	switch {
	case e.Kind == BridgeBack, e.Kind == BridgeResponsive:
		s = fmt.Sprintf("%v after %v", e.Kind, e.Down.Round(time.Millisecond))
	case e.Err != nil:
		s = fmt.Sprintf("%v: %v", e.Kind, e.Err)
	default:
		s = e.Kind.String()
	}
	if e.Bridge != "" {
		s = e.Bridge + ": " + s
	}
	return s
}

// ErrBridgeUnavailable is what Dial, Listen and ListenPacket report when
// the bridge did not come back within their context (Listen and
// ListenPacket: controlTimeout).
var ErrBridgeUnavailable = errors.New("userstack: bridge unavailable")

// Reconnection backoff: the first attempt follows the loss at once, and
// the ceiling is what a restarted bridge may wait before a stack is back.
// A local attempt costs a failed connect(2) on a Unix socket, so local
// stacks try often; remote ones spare the network and the bridge.
const (
	backoffMin       = 5 * time.Millisecond
	backoffMaxLocal  = 20 * time.Millisecond
	backoffMaxRemote = 250 * time.Millisecond
	// refusedBackoff spaces the attempts a bridge keeps answering with a
	// refusal, which it logs: one a second is enough to notice a change of
	// its configuration. The first refusedQuickly go at the usual pace: a
	// bridge that has not yet seen the old control connection end refuses
	// the name until it does.
	refusedBackoff = time.Second
	refusedQuickly = 3
)

// refusal reports whether err is a bridge's answer that registering again
// now would only repeat, rather than the absence of a bridge.
func refusal(err error) bool {
	if errors.Is(err, errBridgeMismatch) {
		return true
	}
	switch control.ErrorCode(err) {
	case "", "bridge_gone", "internal":
		return false
	}
	return true
}

// attached is what one registration with a bridge gave.
type attached struct {
	client    *control.Client
	link      Link
	closeLink func() error
	reg       control.Registration
	maxPacket int // the stream's largest packet
	rxDepth   int // the stream's receive ring depth (0: it does not drop)
}

func (at attached) close() {
	if at.client == nil {
		return
	}
	at.client.Close()
	at.closeLink()
}

// heldClaim is a claim as the stack holds it, across bridges: what to ask
// again for, and its id at the current bridge.
type heldClaim struct {
	proto  string
	addr   netip.Addr
	port   uint16
	remote netip.AddrPort // a flow's peer; invalid for a listener

	bridgeID uint64 // 0 while no bridge holds it
	gen      uint64 // the attachment it was granted under
}

func (h *heldClaim) String() string {
	if h.remote.IsValid() {
		return fmt.Sprintf("%s flow %v to %v", h.proto, netip.AddrPortFrom(h.addr, h.port), h.remote)
	}
	a := "any address"
	if h.addr.IsValid() {
		a = h.addr.String()
	}
	return fmt.Sprintf("%s listener on port %d of %s", h.proto, h.port, a)
}

// attachment keeps a stack attached to a bridge: it holds the current
// control connection and stream, notices when either ends, and registers
// again, with backoff, until a bridge answers. It is the stack's claimer:
// the claims it hands out have ids of its own, which stay valid across
// bridges, and it asks each new bridge for all of them again.
type attachment struct {
	dial    func(ctx context.Context) (attached, error)
	backoff time.Duration // the ceiling between attempts
	link    *relink
	events  func(Event)

	ctx    context.Context // ends with Close
	cancel context.CancelFunc
	done   chan struct{} // the monitor has returned

	// claimMu is held for reading around each claim's grant and release,
	// and for writing while a new bridge is given the claims again, so
	// that none is granted by a bridge that is already gone without the
	// book knowing it.
	claimMu sync.RWMutex

	mu     sync.Mutex
	cur    attached      // zero while the bridge is away
	gen    uint64        // counts attachments
	up     chan struct{} // closed once a bridge is attached; a new one when it is lost
	lostAt time.Time
	lost   error // why the last bridge was lost
	book   map[uint64]*heldClaim
	nextID uint64
	loss   chan uint64 // generations whose stream failed
	// draining: Stack.Drain was called; every bridge that attaches from
	// then on is asked to drain the stack once it holds the claims again.
	draining bool

	mtu atomic.Pointer[func(int)] // the stack's MTU follower (followMTU)
}

// newAttachment registers with a bridge through dial and watches the
// attachment from then on. It returns the first registration too, which
// the watcher may replace at any time after.
func newAttachment(ctx context.Context, dial func(context.Context) (attached, error), backoff time.Duration, events func(Event)) (*attachment, attached, error) {
	at, err := dial(ctx)
	if err != nil {
		return nil, attached{}, err
	}
	return startAttachment(dial, backoff, events, at), at, nil
}

// startAttachment watches the attachment at (none: the zero value, and the
// watcher registers in the background until a bridge answers).
func startAttachment(dial func(context.Context) (attached, error), backoff time.Duration, events func(Event), at attached) *attachment {
	a := &attachment{dial: dial, backoff: backoff, events: events, cur: at, up: make(chan struct{}), book: make(map[uint64]*heldClaim), loss: make(chan uint64, 1), done: make(chan struct{})}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	a.link = newRelink(at.link, a.linkFailed)
	pending := at.client == nil
	if !pending {
		a.gen = 1
		close(a.up)
		a.watchMTU(at, false)
	} else {
		a.lostAt = time.Now()
		a.lost = fmt.Errorf("%w: not registered yet", control.ErrBridgeGone)
	}
	go a.run(pending)
	return a
}

// linkFailed is the relink's report that stream l failed.
func (a *attachment) linkFailed(l Link, _ error) {
	a.mu.Lock()
	gen := a.gen
	mine := a.cur.link == l
	a.mu.Unlock()
	if mine {
		select {
		case a.loss <- gen:
		default:
		}
	}
}

func (a *attachment) emit(e Event) {
	if a.events != nil {
		a.events(e)
	}
}

// run watches the attachment and attaches again when it is lost, until
// Close; pending: attach first.
func (a *attachment) run(pending bool) {
	defer close(a.done)
	if pending && !a.reattach() {
		return
	}
	for {
		a.mu.Lock()
		c, gen := a.cur.client, a.gen
		a.mu.Unlock()
		if c == nil {
			return // closed
		}
		var why error
		select {
		case <-a.ctx.Done():
			return
		case <-c.Done():
			why = c.Err()
		case g := <-a.loss:
			if g != gen {
				continue
			}
			why = fmt.Errorf("%w: stream: %v", control.ErrBridgeGone, a.streamErr())
		}
		if a.ctx.Err() != nil {
			return
		}
		a.detach(why)
		if !a.reattach() {
			return
		}
	}
}

func (a *attachment) streamErr() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e, ok := a.cur.link.(interface{ Err() error }); ok {
		return e.Err()
	}
	return nil
}

// detach lets the lost bridge go: its claims went with the lease.
func (a *attachment) detach(why error) {
	a.mu.Lock()
	at := a.cur
	a.cur = attached{}
	a.up = make(chan struct{})
	a.lostAt = time.Now()
	a.lost = why
	a.mu.Unlock()
	a.link.set(nil)
	at.close()
	a.emit(Event{Kind: BridgeLost, Err: why})
}

// reattach dials with backoff until a bridge takes the stack again; false
// once Close ended the attempts.
func (a *attachment) reattach() bool {
	wait := backoffMin
	refused, refusals := "", 0
	for {
		ctx, cancel := context.WithTimeout(a.ctx, controlTimeout)
		at, err := a.dial(ctx)
		if err == nil {
			ok := a.resume(ctx, at)
			cancel()
			return ok
		}
		cancel()
		next := wait
		if !refusal(err) {
			refusals = 0
		} else if refusals++; refusals >= refusedQuickly {
			next = refusedBackoff
			if err.Error() != refused {
				refused = err.Error()
				a.emit(Event{Kind: BridgeRefused, Err: err})
			}
		}
		select {
		case <-a.ctx.Done():
			return false
		case <-time.After(next):
		}
		wait = min(2*wait, a.backoff)
	}
}

// resume installs a new registration and asks its bridge for every claim
// the stack holds. The events go out once claims may be made again, so
// that a handler can make some.
func (a *attachment) resume(ctx context.Context, at attached) bool {
	a.watchMTU(at, true) // a new bridge may have another MTU
	events := a.reclaim(ctx, at)
	if events == nil {
		return false
	}
	for _, e := range events {
		a.emit(e)
	}
	return true
}

// reclaim is resume's part under claimMu; nil once Close has begun.
func (a *attachment) reclaim(ctx context.Context, at attached) []Event {
	a.claimMu.Lock()
	defer a.claimMu.Unlock()
	a.mu.Lock()
	if a.ctx.Err() != nil {
		a.mu.Unlock()
		at.close()
		return nil
	}
	a.gen++
	gen := a.gen
	a.cur = at
	ids := make([]uint64, 0, len(a.book))
	for id := range a.book {
		ids = append(ids, id)
	}
	a.mu.Unlock()
	a.link.set(at.link)
	slices.Sort(ids) // in the order they were made
	var events []Event
	for _, id := range ids {
		a.mu.Lock()
		h := a.book[id] // Release, which deletes, waits for claimMu
		a.mu.Unlock()
		cl, err := at.client.Reclaim(ctx, h.proto, h.addr, h.port, h.remote)
		if errors.Is(err, control.ErrBridgeGone) {
			break // gone again: the monitor sees it, the next bridge is asked
		}
		a.mu.Lock()
		h.bridgeID, h.gen = cl.ID, gen
		a.mu.Unlock()
		if err != nil {
			events = append(events, Event{Kind: ClaimLost, Err: fmt.Errorf("userstack: %v: %w", h, err)})
		}
	}
	// After the claims, not before: a bridge takes no listener from an
	// instance that drains, and the established connections need theirs.
	a.mu.Lock()
	draining := a.draining
	a.mu.Unlock()
	if draining {
		if err := at.client.Drain(ctx); err != nil && !errors.Is(err, control.ErrBridgeGone) {
			events = append(events, Event{Kind: DrainFailed, Err: fmt.Errorf("userstack: %w", err)})
		}
	}
	a.mu.Lock()
	close(a.up)
	down := time.Since(a.lostAt)
	a.mu.Unlock()
	return append(events, Event{Kind: BridgeBack, Down: down})
}

// client waits for an attached bridge, within ctx.
func (a *attachment) client(ctx context.Context) (*control.Client, uint64, error) {
	for {
		a.mu.Lock()
		c, gen, up, lost := a.cur.client, a.gen, a.up, a.lost
		a.mu.Unlock()
		if c != nil {
			return c, gen, nil
		}
		select {
		case <-up:
		case <-a.ctx.Done():
			return nil, 0, ErrClosed
		case <-ctx.Done():
			return nil, 0, fmt.Errorf("%w, reconnecting (%w): %w", ErrBridgeUnavailable, lost, ctx.Err())
		}
	}
}

// grant runs r at the current bridge and records what it granted, under an
// id of the attachment's own.
func (a *attachment) grant(ctx context.Context, r claimRequest) (control.Claim, error) {
	for {
		c, gen, err := a.client(ctx)
		if err != nil {
			return control.Claim{}, err
		}
		cl, err := a.grantAt(c, gen, r)
		if errors.Is(err, errStale) {
			continue
		}
		if errors.Is(err, control.ErrBridgeGone) && ctx.Err() == nil {
			// The bridge went during the call: wait for the next one.
			select {
			case <-c.Done():
			case <-ctx.Done():
			}
			continue
		}
		return cl, err
	}
}

// errStale: the bridge that grantAt was to ask is no longer the current one.
var errStale = errors.New("userstack: bridge replaced")

// grantAt is one attempt of grant at c, the client of attachment gen.
func (a *attachment) grantAt(c *control.Client, gen uint64, r claimRequest) (control.Claim, error) {
	a.claimMu.RLock()
	defer a.claimMu.RUnlock()
	a.mu.Lock()
	stale := gen != a.gen
	a.mu.Unlock()
	if stale {
		return control.Claim{}, errStale
	}
	cl, err := r.ask(c)
	if err == nil {
		held := r.held(cl)
		held.bridgeID, held.gen = cl.ID, gen
		a.mu.Lock()
		a.nextID++
		cl.ID = a.nextID
		a.book[cl.ID] = &held
		a.mu.Unlock()
	}
	return cl, err
}

// current is the attached bridge's client and its generation; nil while
// the bridge is away.
func (a *attachment) current() (*control.Client, uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cur.client, a.gen
}

// adopt books h, a claim another bridge granted, and asks this bridge for
// exactly it (Reclaim) if one is attached; a bridge that is away is asked
// when it is back, as for every claim in the book. The claim stays booked
// when the bridge refuses it (err), so that its next registration asks
// again.
func (a *attachment) adopt(ctx context.Context, h heldClaim) (uint64, error) {
	a.claimMu.RLock()
	defer a.claimMu.RUnlock()
	a.mu.Lock()
	c, gen := a.cur.client, a.gen
	a.nextID++
	id := a.nextID
	held := h
	a.book[id] = &held
	a.mu.Unlock()
	if c == nil {
		return id, nil
	}
	cl, err := c.Reclaim(ctx, h.proto, h.addr, h.port, h.remote)
	if errors.Is(err, control.ErrBridgeGone) {
		return id, nil // its next registration asks again
	}
	a.mu.Lock()
	held.bridgeID, held.gen = cl.ID, gen
	a.mu.Unlock()
	return id, err
}

// Listen implements claimer.
func (a *attachment) Listen(ctx context.Context, proto string, addr netip.Addr, port uint16) (control.Claim, error) {
	return a.grant(ctx, listenRequest(ctx, proto, addr, port))
}

// Connect implements claimer.
func (a *attachment) Connect(ctx context.Context, proto string, local netip.Addr, remote netip.AddrPort) (control.Claim, error) {
	return a.grant(ctx, connectRequest(ctx, proto, local, remote))
}

// claimRequest asks a bridge for a claim (ask) and says what the stack
// holds of what it granted (held), to ask other bridges for it again.
type claimRequest struct {
	ask  func(*control.Client) (control.Claim, error)
	held func(control.Claim) heldClaim
}

func listenRequest(ctx context.Context, proto string, addr netip.Addr, port uint16) claimRequest {
	return claimRequest{
		ask:  func(c *control.Client) (control.Claim, error) { return c.Listen(ctx, proto, addr, port) },
		held: func(cl control.Claim) heldClaim { return heldClaim{proto: proto, addr: addr, port: cl.Port} },
	}
}

func connectRequest(ctx context.Context, proto string, local netip.Addr, remote netip.AddrPort) claimRequest {
	return claimRequest{
		ask: func(c *control.Client) (control.Claim, error) { return c.Connect(ctx, proto, local, remote) },
		held: func(cl control.Claim) heldClaim {
			return heldClaim{proto: proto, addr: cl.Addr, port: cl.Port, remote: remote}
		},
	}
}

// Release implements claimer. A claim granted by a bridge that has gone
// went with it.
func (a *attachment) Release(ctx context.Context, id uint64) error {
	a.claimMu.RLock()
	defer a.claimMu.RUnlock()
	a.mu.Lock()
	h := a.book[id]
	delete(a.book, id)
	c, gen := a.cur.client, a.gen
	a.mu.Unlock()
	if h == nil {
		return fmt.Errorf("%w: %d", control.ErrUnknownClaim, id)
	}
	if c == nil || h.gen != gen || h.bridgeID == 0 {
		return nil
	}
	return c.Release(ctx, h.bridgeID)
}

// drain marks the attachment draining and asks the bridge attached now,
// if any, to drain the stack; sent says whether one was asked. A bridge
// that is away, or goes during the call, is asked when it is back.
func (a *attachment) drain(ctx context.Context) (sent bool, err error) {
	// Not while reclaim gives a new bridge the claims: that bridge would
	// refuse the listeners of an instance that drains.
	a.claimMu.RLock()
	defer a.claimMu.RUnlock()
	a.mu.Lock()
	a.draining = true
	c := a.cur.client
	a.mu.Unlock()
	if c == nil {
		return false, nil
	}
	err = c.Drain(ctx)
	if errors.Is(err, control.ErrBridgeGone) {
		return false, nil
	}
	return true, err
}

// Close stops reattaching and lets the bridge go, if one is attached.
func (a *attachment) Close() error {
	a.cancel()
	a.mu.Lock()
	at := a.cur
	a.cur = attached{}
	a.mu.Unlock()
	at.close()
	<-a.done
	return nil
}
