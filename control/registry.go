package control

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Dataplane is what the server needs of the bridge. The daemon adapts the
// real bridge to it; tests use a fake. The server calls it from one
// goroutine at a time, always in an order that keeps the tables and the
// streams consistent: a stream is added before any table entry points to
// it and removed after the last one is gone; on a grant the ownership is
// widened before the tables steer the new tuple, on a release the tables
// stop steering before the ownership narrows.
//
// An error that wraps ErrBridgeGone tells the application the bridge is
// gone; any other error is reported as internal. Either way the request
// changes nothing.
type Dataplane interface {
	// AddStream attaches a local application's stream (bridge side).
	AddStream(id uint32, s *fabric.BridgeStream, own Ownership) error
	// AddRemoteStream attaches a remote application's stream.
	AddRemoteStream(id uint32, s *fabric.RemoteStream, own Ownership) error
	// SetOwnership replaces what the stream may send.
	SetOwnership(id uint32, own Ownership) error
	// RemoveStream detaches a stream; the server closes it afterwards.
	RemoveStream(id uint32) error
	// SetTables installs a complete new classification (static rules plus
	// every application's listeners and flows).
	SetTables(t *classifier.Tables) error
}

// Ownership is what a stream may send, for the bridge's transmit check: its
// source addresses, and the protocol and source port of every listener and
// flow it holds.
type Ownership struct {
	Addrs []netip.Addr
	Ports []PortClaim
}

// PortClaim is one owned protocol and port.
type PortClaim struct {
	Proto classifier.Protocol
	Port  uint16
}

// registry turns the claims of all applications into classifier tables and
// stream ownership, and keeps them applied to the data plane. All its
// methods are safe for concurrent use; data plane calls happen under its
// lock, so updates reach the bridge in the order they were decided.
type registry struct {
	mu        sync.Mutex
	dp        Dataplane
	ephemeral classifier.PortRange
	firstID   uint32 // dynamic counter ids start here
	static    Static
	apps      map[uint32]*app
	named     map[string]*app // the application that holds its name's static entries
	byPort    map[portKey][]*claim
	usedIDs   [classifier.MaxRuleID + 1]bool // listener and flow counter ids in use (static rules included)
	idCursor  uint32
	streamCur uint32
	portCur   map[classifier.Protocol]uint16
}

type portKey struct {
	proto classifier.Protocol
	port  uint16
}

// app is one registered application: one control connection, one stream.
type app struct {
	name      string
	stream    uint32
	policy    Policy
	flowID    uint32 // the counter id all its flows share
	claims    map[uint64]*claim
	nextClaim uint64
	static    *AppStatic // the configuration's entries bound to this name, while it holds them
}

// claim is one listener or flow an application holds.
type claim struct {
	id       uint64
	app      *app
	proto    classifier.Protocol
	listener bool
	addr     netip.Addr     // listener: zero means both families' wildcard; flow: local address
	port     uint16         // local port
	remote   netip.AddrPort // flows only
	ruleID   uint32         // listeners only
}

// maxStreamID keeps stream ids inside GENEVE's 24-bit VNI.
const maxStreamID = 1<<24 - 1

// Static is the configured part of the classification.
type Static struct {
	// Rules are not bound to any application (pass, drop, ingest, or
	// steer to a fixed stream id).
	Rules []classifier.Rule
	// Apps are bound to an application by name: they are installed, with
	// the application's stream filled in, while an application of that name
	// is registered, and their ports belong to its stream's ownership.
	Apps map[string]AppStatic
}

// AppStatic are the listeners and steer rules the configuration gives one
// application. Their Stream fields are ignored. A rule adds its destination
// port to the application's ownership when it names exactly one port (and
// TCP, UDP or both); rules over port ranges only steer.
type AppStatic struct {
	Listeners []classifier.Listener
	Rules     []classifier.Rule
}

// placeholderStream stands in for an application's stream when static
// entries are validated before the application is there.
const placeholderStream = maxStreamID

func newRegistry(dp Dataplane, ephemeral classifier.PortRange, firstID uint32, static Static) (*registry, error) {
	r := &registry{
		dp:        dp,
		ephemeral: ephemeral,
		firstID:   max(firstID, 1),
		named:     make(map[string]*app),
		apps:      make(map[uint32]*app),
		byPort:    make(map[portKey][]*claim),
		portCur:   make(map[classifier.Protocol]uint16),
	}
	if r.firstID > classifier.MaxRuleID {
		return nil, fmt.Errorf("first dynamic id %d beyond %d", r.firstID, classifier.MaxRuleID)
	}
	if err := r.setStatic(static); err != nil {
		return nil, err
	}
	return r, nil
}

// setStatic replaces the static classification and applies the result.
// Nothing changes when the new entries are invalid, clash with what
// applications hold, or the data plane refuses them.
func (r *registry) setStatic(st Static) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	// Validate every entry, bound or not, as if all applications were
	// there: ids unique, listeners distinct, rules well formed.
	all := classifier.RuleSet{Rules: st.Rules}
	for _, as := range st.Apps {
		for _, l := range as.Listeners {
			l.Stream = placeholderStream
			all.Listeners = append(all.Listeners, l)
		}
		for _, rule := range as.Rules {
			if rule.Action != classifier.ActionSteer {
				return fmt.Errorf("rule id %d: only steer rules can be bound to an application", rule.ID)
			}
			rule.Stream = placeholderStream
			all.Rules = append(all.Rules, rule)
		}
	}
	if err := all.Validate(); err != nil {
		return err
	}
	ids := map[uint32]bool{}
	for _, l := range all.Listeners {
		ids[l.ID] = true
	}
	for _, rule := range all.Rules {
		ids[rule.ID] = true
		if rule.Stream != placeholderStream && r.apps[rule.Stream] != nil &&
			(rule.Action == classifier.ActionSteer || rule.Action == classifier.ActionIngest) {
			return fmt.Errorf("rule id %d names stream %d, which an application holds", rule.ID, rule.Stream)
		}
	}
	for id := range ids {
		if r.usedIDs[id] && !r.static.hasID(id) {
			return fmt.Errorf("id %d is in use by an application's listener or flows (keep static ids below %d)", id, r.firstID)
		}
	}
	for _, a := range r.apps {
		for _, l := range st.Apps[a.name].Listeners {
			for _, c := range r.byPort[portKey{l.Protocol, l.Port}] {
				if c.listener && overlaps(c.addr, l.Addr) && (c.app != r.named[a.name] || r.named[a.name] == nil) {
					return fmt.Errorf("listener id %d: %v port %d is held by application %q", l.ID, l.Protocol, l.Port, c.app.name)
				}
			}
		}
	}
	before := make(map[uint32]Ownership, len(r.apps))
	for id, a := range r.apps {
		before[id] = a.ownership()
	}
	old, oldNamed := r.static, r.named
	r.static = st
	r.named = make(map[string]*app)
	for _, a := range r.apps {
		a.static = nil
	}
	for _, a := range oldNamed { // holders keep their name
		if _, ok := st.Apps[a.name]; ok {
			r.bind(a)
		}
	}
	for _, a := range r.apps {
		if _, ok := st.Apps[a.name]; ok && r.named[a.name] == nil {
			r.bind(a)
		}
	}
	restore := func() {
		r.static, r.named = old, oldNamed
		for _, a := range r.apps {
			a.static = nil
		}
		for _, a := range oldNamed {
			r.bind(a)
		}
		for id := range r.apps {
			r.dp.SetOwnership(id, before[id])
		}
	}
	t, err := r.compile()
	if err != nil {
		restore()
		return err
	}
	// Ownership widens to old and new ports before the tables change and
	// narrows to the new ones after, so no packet of either is refused
	// in between.
	for id, a := range r.apps {
		if err := r.dp.SetOwnership(id, union(before[id], a.ownership())); err != nil {
			restore()
			return dataplaneErr(err)
		}
	}
	if err := r.dp.SetTables(t); err != nil {
		restore()
		return dataplaneErr(err)
	}
	for id, a := range r.apps {
		r.dp.SetOwnership(id, a.ownership())
	}
	for id := range r.usedIDs {
		if r.usedIDs[id] && old.hasID(uint32(id)) {
			r.usedIDs[id] = false
		}
	}
	for id := range ids {
		r.usedIDs[id] = true
	}
	return nil
}

// bind gives a its name's static entries.
func (r *registry) bind(a *app) {
	as := r.static.Apps[a.name]
	a.static = &as
	r.named[a.name] = a
}

// union is the ownership of both x and y.
func union(x, y Ownership) Ownership {
	out := Ownership{Addrs: slices.Clone(x.Addrs), Ports: slices.Clone(x.Ports)}
	for _, a := range y.Addrs {
		if !slices.Contains(out.Addrs, a) {
			out.Addrs = append(out.Addrs, a)
		}
	}
	for _, p := range y.Ports {
		if !slices.Contains(out.Ports, p) {
			out.Ports = append(out.Ports, p)
		}
	}
	return out
}

func (st *Static) hasID(id uint32) bool {
	for _, rule := range st.Rules {
		if rule.ID == id {
			return true
		}
	}
	for _, as := range st.Apps {
		for _, l := range as.Listeners {
			if l.ID == id {
				return true
			}
		}
		for _, rule := range as.Rules {
			if rule.ID == id {
				return true
			}
		}
	}
	return false
}

// compile builds the tables from the static rules and every claim.
func (r *registry) compile() (*classifier.Tables, error) {
	set := classifier.RuleSet{Rules: slices.Clone(r.static.Rules)}
	for _, a := range r.apps {
		if a.static != nil {
			for _, l := range a.static.Listeners {
				l.Stream = a.stream
				set.Listeners = append(set.Listeners, l)
			}
			for _, rule := range a.static.Rules {
				rule.Stream = a.stream
				set.Rules = append(set.Rules, rule)
			}
		}
		for _, c := range a.claims {
			if c.listener {
				addr, need := a.uncovered(c)
				if !need {
					continue // the application's configured listener steers it
				}
				set.Listeners = append(set.Listeners, classifier.Listener{
					ID: c.ruleID, Protocol: c.proto, Addr: addr, Port: c.port, Stream: a.stream,
				})
			} else {
				set.Flows = append(set.Flows, classifier.Flow{
					ID: a.flowID, Protocol: c.proto, Remote: c.remote,
					Local: netip.AddrPortFrom(c.addr, c.port), Stream: a.stream,
				})
			}
		}
	}
	return classifier.Compile(&set)
}

// uncovered says which part of listener claim c needs a table entry of its
// own: the part that none of a's configured listeners (while a holds them)
// already steers to a. need is false when they cover all of it, so the claim
// shares their entries; else addr is what the claim's own entry must listen
// on (c.addr, or one family's wildcard when a configured wildcard covers
// the other). Deciding this when the tables are compiled, not when the
// claim is made, keeps the claim steered if a reload takes the configured
// listener away.
func (a *app) uncovered(c *claim) (addr netip.Addr, need bool) {
	if a.static == nil {
		return c.addr, true
	}
	covered := func(part netip.Addr) bool {
		for _, l := range a.static.Listeners {
			if l.Protocol == c.proto && l.Port == c.port && covers(l.Addr, part) {
				return true
			}
		}
		return false
	}
	if c.addr.IsValid() {
		return c.addr, !covered(c.addr)
	}
	v4, v6 := covered(netip.IPv4Unspecified()), covered(netip.IPv6Unspecified())
	switch {
	case v4 && v6:
		return netip.Addr{}, false
	case v4:
		return netip.IPv6Unspecified(), true
	case v6:
		return netip.IPv4Unspecified(), true
	}
	return c.addr, true
}

// covers reports whether a listener on l receives every packet one on addr
// (valid) would.
func covers(l, addr netip.Addr) bool {
	switch {
	case !l.IsValid():
		return true
	case l.Is4() != addr.Is4():
		return false
	case l.IsUnspecified():
		return true
	}
	return l == addr
}

// ownership is what a's stream may send: its claims' ports and those of
// its static entries.
func (a *app) ownership() Ownership {
	own := Ownership{Addrs: slices.Clone(a.policy.Addrs)}
	add := func(proto classifier.Protocol, port uint16) {
		pc := PortClaim{Proto: proto, Port: port}
		if !slices.Contains(own.Ports, pc) {
			own.Ports = append(own.Ports, pc)
		}
	}
	for _, c := range a.claims {
		add(c.proto, c.port)
	}
	if as := a.static; as != nil {
		for _, l := range as.Listeners {
			add(l.Protocol, l.Port)
		}
		for _, rule := range as.Rules {
			if rule.DstPorts.Lo != rule.DstPorts.Hi || rule.DstPorts.IsAny() {
				continue
			}
			if rule.Protocol != classifier.ProtoUDP {
				add(classifier.ProtoTCP, rule.DstPorts.Lo)
			}
			if rule.Protocol != classifier.ProtoTCP {
				add(classifier.ProtoUDP, rule.DstPorts.Lo)
			}
		}
	}
	slices.SortFunc(own.Ports, func(x, y PortClaim) int {
		if x.Proto != y.Proto {
			return int(x.Proto) - int(y.Proto)
		}
		return int(x.Port) - int(y.Port)
	})
	return own
}

// dataplaneErr marks an error as the bridge's unless it already says what
// it is.
func dataplaneErr(err error) error {
	if errors.Is(err, ErrBridgeGone) {
		return err
	}
	return fmt.Errorf("%w: data plane: %v", ErrInternal, err)
}

// register adds an application: it picks a stream id and a flow counter id
// and calls attach, which creates the stream and adds it to the data
// plane; then the static entries bound to the application's name, if any,
// start steering to it. On any error nothing is left behind.
func (r *registry) register(name string, pol Policy, attach func(id uint32, own Ownership) error) (*app, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, bound := r.static.Apps[name]
	if holder := r.named[name]; bound && holder != nil {
		return nil, fmt.Errorf("%w: application %q is registered already (stream %d) and holds its configured listeners", ErrPortInUse, name, holder.stream)
	}
	id, ok := r.freeStream()
	if !ok {
		return nil, fmt.Errorf("%w: no free stream id", ErrQuota)
	}
	flowID, ok := r.allocID()
	if !ok {
		return nil, fmt.Errorf("%w: no free counter id", ErrQuota)
	}
	a := &app{name: name, stream: id, policy: pol, flowID: flowID, claims: make(map[uint64]*claim)}
	if bound {
		as := r.static.Apps[name]
		a.static = &as
	}
	if err := attach(id, a.ownership()); err != nil {
		r.usedIDs[flowID] = false
		return nil, err
	}
	r.apps[id] = a
	if bound {
		r.named[name] = a
		t, err := r.compile()
		if err == nil {
			err = r.dp.SetTables(t)
		}
		if err != nil {
			delete(r.apps, id)
			delete(r.named, name)
			r.usedIDs[flowID] = false
			r.dp.RemoveStream(id)
			return nil, dataplaneErr(err)
		}
	}
	return a, nil
}

// freeStream picks the next unused stream id after the last one given, so
// that ids are not reused at once (a late packet of an old stream cannot
// reach its successor). Ids that static rules name are never given.
func (r *registry) freeStream() (uint32, bool) {
	for range maxStreamID {
		r.streamCur = r.streamCur%maxStreamID + 1
		id := r.streamCur
		if r.apps[id] != nil || r.staticStream(id) {
			continue
		}
		return id, true
	}
	return 0, false
}

func (r *registry) staticStream(id uint32) bool {
	for _, rule := range r.static.Rules {
		if rule.Stream == id && (rule.Action == classifier.ActionSteer || rule.Action == classifier.ActionIngest) {
			return true
		}
	}
	return false
}

// allocID takes a free listener/flow counter id at or above firstID.
func (r *registry) allocID() (uint32, bool) {
	for range classifier.MaxRuleID - r.firstID + 1 {
		if r.idCursor < r.firstID || r.idCursor >= classifier.MaxRuleID {
			r.idCursor = r.firstID
		} else {
			r.idCursor++
		}
		if !r.usedIDs[r.idCursor] {
			r.usedIDs[r.idCursor] = true
			return r.idCursor, true
		}
	}
	return 0, false
}

// unregister removes everything a holds and detaches its stream. The
// application is gone, so this cannot fail in a way it could act on; data
// plane errors are returned for the log.
func (r *registry) unregister(a *app) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.apps[a.stream] != a {
		return nil
	}
	for _, c := range a.claims {
		r.unindex(c)
	}
	a.claims = map[uint64]*claim{}
	delete(r.apps, a.stream)
	if r.named[a.name] == a {
		delete(r.named, a.name)
	}
	r.usedIDs[a.flowID] = false
	var errs []error
	if t, err := r.compile(); err != nil {
		errs = append(errs, err)
	} else if err := r.dp.SetTables(t); err != nil {
		errs = append(errs, err)
	}
	if err := r.dp.RemoveStream(a.stream); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (r *registry) index(c *claim) {
	k := portKey{c.proto, c.port}
	r.byPort[k] = append(r.byPort[k], c)
	if c.listener {
		r.usedIDs[c.ruleID] = true
	}
}

func (r *registry) unindex(c *claim) {
	k := portKey{c.proto, c.port}
	list := slices.DeleteFunc(r.byPort[k], func(x *claim) bool { return x == c })
	if len(list) == 0 {
		delete(r.byPort, k)
	} else {
		r.byPort[k] = list
	}
	if c.listener {
		r.usedIDs[c.ruleID] = false
	}
}

// overlaps reports whether two listener addresses can both match one packet.
func overlaps(a, b netip.Addr) bool {
	if !a.IsValid() || !b.IsValid() {
		return true
	}
	if a.Is4() != b.Is4() {
		return false
	}
	return a.IsUnspecified() || b.IsUnspecified() || a == b
}

// grant adds c to a and applies it: ownership first, then tables. On
// failure everything is as before.
func (r *registry) grant(a *app, c *claim) error {
	if len(a.claims) >= a.policy.MaxClaims {
		return fmt.Errorf("%w: %d listeners and connections held, the limit", ErrQuota, len(a.claims))
	}
	if c.listener {
		id, ok := r.allocID()
		if !ok {
			return fmt.Errorf("%w: no free listener id", ErrQuota)
		}
		c.ruleID = id
	}
	a.nextClaim++
	c.id = a.nextClaim
	c.app = a
	a.claims[c.id] = c
	r.index(c)
	undo := func() {
		delete(a.claims, c.id)
		r.unindex(c)
	}
	t, err := r.compile()
	if err != nil {
		undo()
		return fmt.Errorf("%w: the claim does not fit the rules: %v", ErrNotPermitted, err)
	}
	if err := r.dp.SetOwnership(a.stream, a.ownership()); err != nil {
		undo()
		return dataplaneErr(err)
	}
	if err := r.dp.SetTables(t); err != nil {
		undo()
		r.dp.SetOwnership(a.stream, a.ownership())
		return dataplaneErr(err)
	}
	return nil
}

// listen claims proto addr:port for a (port 0: a free port of the reserved
// range).
func (r *registry) listen(a *app, proto classifier.Protocol, addr netip.Addr, port uint16) (*claim, error) {
	if addr.IsValid() && !addr.IsUnspecified() && !slices.Contains(a.policy.Addrs, addr) {
		return nil, fmt.Errorf("%w: address %v is not one this application may use", ErrNotPermitted, addr)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if port == 0 {
		p, err := r.freePort(proto)
		if err != nil {
			return nil, err
		}
		port = p
	} else {
		if r.ephemeral.Contains(port) {
			return nil, fmt.Errorf("%w: port %d is in the reserved range %d-%d, which the bridge hands out (ask for port 0)",
				ErrNotPermitted, port, r.ephemeral.Lo, r.ephemeral.Hi)
		}
		if !a.policy.mayListen(port) {
			return nil, fmt.Errorf("%w: port %d is not among this application's ports", ErrNotPermitted, port)
		}
		if owner := r.staticHolder(proto, port, addr, a); owner != "" {
			return nil, fmt.Errorf("%w: %v port %d on %v is held by application %q by configuration", ErrPortInUse, proto, port, anyAddr(addr), owner)
		}
		for _, c := range r.byPort[portKey{proto, port}] {
			if c.listener && overlaps(c.addr, addr) {
				who := fmt.Sprintf("application %q (stream %d)", c.app.name, c.app.stream)
				if c.app == a {
					who = "this application already"
				}
				return nil, fmt.Errorf("%w: %v port %d on %v is held by %s", ErrPortInUse, proto, port, anyAddr(c.addr), who)
			}
		}
	}
	c := &claim{proto: proto, listener: true, addr: addr, port: port}
	if err := r.grant(a, c); err != nil {
		return nil, err
	}
	return c, nil
}

// staticHolder names an application whose configured listener overlaps
// proto addr:port, or returns "". The configured listeners of self, while
// self holds them, do not count: an application may listen where its own
// configuration already steers (a user-space stack must listen to accept),
// and its claim shares the configured entry (see uncovered).
func (r *registry) staticHolder(proto classifier.Protocol, port uint16, addr netip.Addr, self *app) string {
	for name, as := range r.static.Apps {
		if self != nil && r.named[name] == self {
			continue
		}
		for _, l := range as.Listeners {
			if l.Protocol == proto && l.Port == port && overlaps(l.Addr, addr) {
				return name
			}
		}
	}
	return ""
}

func anyAddr(a netip.Addr) string {
	if !a.IsValid() {
		return "any address"
	}
	return a.String()
}

// connect allocates a port for a flow from local to remote and installs the
// flow.
func (r *registry) connect(a *app, proto classifier.Protocol, local netip.Addr, remote netip.AddrPort) (*claim, error) {
	ra := remote.Addr()
	if !remote.IsValid() || remote.Port() == 0 || ra.IsUnspecified() || ra.IsMulticast() || ra.Is4In6() {
		return nil, fmt.Errorf("%w: remote %v is not a unicast address and port", ErrBadRequest, remote)
	}
	if !local.IsValid() {
		for _, x := range a.policy.Addrs {
			if x.Is4() == ra.Is4() {
				local = x
				break
			}
		}
		if !local.IsValid() {
			return nil, fmt.Errorf("%w: this application has no IPv%d address", ErrNotPermitted, family(ra))
		}
	}
	if !slices.Contains(a.policy.Addrs, local) {
		return nil, fmt.Errorf("%w: address %v is not one this application may use", ErrNotPermitted, local)
	}
	if local.Is4() != ra.Is4() {
		return nil, fmt.Errorf("%w: local %v and remote %v are of different families", ErrBadRequest, local, ra)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	port, err := r.freePort(proto)
	if err != nil {
		return nil, err
	}
	c := &claim{proto: proto, addr: local, port: port, remote: remote}
	if err := r.grant(a, c); err != nil {
		return nil, err
	}
	return c, nil
}

func family(a netip.Addr) int {
	if a.Is4() {
		return 4
	}
	return 6
}

// freePort finds a port of the reserved range that no claim of proto uses,
// continuing after the last one given so that a port just released is
// reused as late as possible (its old connection may linger in TIME-WAIT).
func (r *registry) freePort(proto classifier.Protocol) (uint16, error) {
	lo, hi := r.ephemeral.Lo, r.ephemeral.Hi
	if lo == 0 && hi == 0 {
		return 0, fmt.Errorf("%w: the bridge has no reserved port range", ErrNoPorts)
	}
	size := int(hi) - int(lo) + 1
	cur := r.portCur[proto]
	for range size {
		if cur < lo || cur >= hi {
			cur = lo
		} else {
			cur++
		}
		if len(r.byPort[portKey{proto, cur}]) == 0 && r.staticHolder(proto, cur, netip.Addr{}, nil) == "" {
			r.portCur[proto] = cur
			return cur, nil
		}
	}
	return 0, fmt.Errorf("%w: all %d %v ports of %d-%d are held", ErrNoPorts, size, proto, lo, hi)
}

// release gives up one claim: tables first, then ownership. If the tables
// cannot be updated the claim stays.
func (r *registry) release(a *app, id uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := a.claims[id]
	if c == nil {
		return fmt.Errorf("%w: %d", ErrUnknownClaim, id)
	}
	delete(a.claims, id)
	r.unindex(c)
	t, err := r.compile()
	if err == nil {
		err = r.dp.SetTables(t)
	}
	if err != nil {
		// The tables still steer the tuple: keep the claim, so that state
		// and data plane agree. The lease's end removes it in any case.
		a.claims[id] = c
		r.index(c)
		return dataplaneErr(err)
	}
	if err := r.dp.SetOwnership(a.stream, a.ownership()); err != nil {
		return dataplaneErr(err)
	}
	return nil
}

// AppInfo describes one registered application, for metrics and the CLI.
type AppInfo struct {
	Name      string
	Stream    uint32
	Listeners int         // listeners it asked for
	Flows     int         // connections it asked for
	Ports     []PortClaim // every port its stream owns, configured ones included
}

func (r *registry) snapshot() []AppInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]AppInfo, 0, len(r.apps))
	for _, a := range r.apps {
		info := AppInfo{Name: a.name, Stream: a.stream, Ports: a.ownership().Ports}
		for _, c := range a.claims {
			if c.listener {
				info.Listeners++
			} else {
				info.Flows++
			}
		}
		out = append(out, info)
	}
	slices.SortFunc(out, func(x, y AppInfo) int { return int(x.Stream) - int(y.Stream) })
	return out
}
