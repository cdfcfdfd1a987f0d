package control

import (
	"fmt"
	"math/bits"
	"net/netip"
	"slices"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// This file grants and releases the claims of one application: listeners
// and flows, checked against every other application's and the
// configuration's, with ephemeral ports handed out from the reserved range.

// index counts c, a claim of a, in the registry's and a's books.
func (r *registry) index(a *app, c *claim) {
	k := portKey{c.proto, c.port}
	r.byPort[k] = append(r.byPort[k], *c)
	if r.ephemeral.Contains(c.port) && !r.ephemeral.IsAny() {
		r.pools[c.proto].set(c.port, false)
	}
	if c.listener {
		r.usedIDs[c.ruleID] = true
		a.listeners++
	} else {
		a.use.flows++
	}
	pc := classifier.PortClaim{Proto: c.proto, Port: c.port}
	if a.portRefs[pc]++; a.portRefs[pc] == 1 {
		a.use.ports++
	}
}

// unindex takes c, a claim of a, out of the books.
func (r *registry) unindex(a *app, c *claim) {
	k := portKey{c.proto, c.port}
	list := slices.DeleteFunc(r.byPort[k], func(x claim) bool { return x.stream == c.stream && x.id == c.id })
	if len(list) == 0 {
		delete(r.byPort, k)
		if r.ephemeral.Contains(c.port) && !r.ephemeral.IsAny() && r.staticHolder(c.proto, c.port, netip.Addr{}, nil) == "" {
			r.pools[c.proto].set(c.port, true)
		}
	} else {
		r.byPort[k] = list
	}
	if c.listener {
		r.usedIDs[c.ruleID] = false
		a.listeners--
	} else {
		a.use.flows--
	}
	pc := classifier.PortClaim{Proto: c.proto, Port: c.port}
	if a.portRefs[pc]--; a.portRefs[pc] == 0 {
		delete(a.portRefs, pc)
		a.use.ports--
	}
	r.unhold(a, c)
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
	if c.listener {
		if a.portRefs[classifier.PortClaim{Proto: c.proto, Port: c.port}] == 0 && !a.mayTakePort() {
			return a.portQuotaErr()
		}
		id, ok := r.allocID()
		if !ok {
			return fmt.Errorf("%w: no free listener id", ErrQuota)
		}
		c.ruleID = id
	}
	a.nextClaim++
	c.id = a.nextClaim
	c.stream = a.stream
	a.claims[c.id] = *c
	r.index(a, c)
	undo := func() {
		delete(a.claims, c.id)
		r.unindex(a, c)
	}
	if c.listener && a.instance != "" {
		restore, err := r.joinGroup(a, c)
		if err != nil {
			undo()
			return fmt.Errorf("%w: %v", ErrInternal, err)
		}
		unclaim := undo
		undo = func() { restore(); unclaim() }
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
	r.tables.Lock()
	defer r.tables.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	if a.draining {
		return nil, fmt.Errorf("%w: instance %q drains and listens no more", ErrNotPermitted, a.instance)
	}
	if port == 0 {
		if !a.mayTakePort() {
			return nil, a.portQuotaErr()
		}
		p, err := r.freePortFor(a, proto)
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
			if c.listener && overlaps(c.addr.ip(), addr) {
				if r.mayJoin(a, &c, addr) {
					continue // another instance's: a shares the listener
				}
				who := r.holder(c.stream)
				if c.stream == a.stream {
					who = "this application already"
				}
				return nil, fmt.Errorf("%w: %v port %d on %v is held by %s", ErrPortInUse, proto, port, anyAddr(c.addr.ip()), who)
			}
		}
	}
	c := &claim{proto: proto, listener: true, addr: packIP(addr), port: port}
	if err := r.grant(a, c); err != nil {
		return nil, err
	}
	return c, nil
}

// holder names the application of stream, for messages.
func (r *registry) holder(stream uint32) string {
	if a := r.apps[stream]; a != nil {
		return fmt.Sprintf("application %q (stream %d)", a.name, stream)
	}
	return fmt.Sprintf("an application that is leaving (stream %d)", stream)
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
	if r.flowDP == nil {
		r.tables.Lock()
		defer r.tables.Unlock()
		r.mu.Lock()
		defer r.mu.Unlock()
		if err := a.mayAddFlow(); err != nil {
			return nil, err
		}
		port, err := r.flowPort(a, proto, local, remote)
		if err != nil {
			return nil, err
		}
		c := newFlowClaim(proto, local, port, remote)
		if err := r.grant(a, c); err != nil {
			return nil, err
		}
		return c, nil
	}
	return r.connectDelta(a, proto, local, remote)
}

// connectDelta is connect on a FlowDataplane: the claim is decided under
// mu, then applied as deltas outside it, ownership first.
func (r *registry) connectDelta(a *app, proto classifier.Protocol, local netip.Addr, remote netip.AddrPort) (*claim, error) {
	r.tables.RLock()
	defer r.tables.RUnlock()
	r.mu.Lock()
	if err := a.mayAddFlow(); err != nil {
		r.mu.Unlock()
		return nil, err
	}
	port, err := r.flowPort(a, proto, local, remote)
	if err != nil {
		r.mu.Unlock()
		return nil, err
	}
	c := newFlowClaim(proto, local, port, remote)
	a.nextClaim++
	c.id, c.stream = a.nextClaim, a.stream
	a.claims[c.id] = *c
	pc := classifier.PortClaim{Proto: proto, Port: port}
	r.index(a, c)
	f := a.flow(c)
	r.mu.Unlock()
	undo := func() {
		r.mu.Lock()
		delete(a.claims, c.id)
		r.unindex(a, c)
		r.mu.Unlock()
		r.syncPort(a, pc)
	}
	if err := r.syncPort(a, pc); err != nil {
		undo()
		return nil, dataplaneErr(err)
	}
	if err := r.flowDP.AddFlows([]classifier.Flow{f}); err != nil {
		undo()
		return nil, dataplaneErr(err)
	}
	return c, nil
}

// newFlowClaim is a flow's claim, before it is granted.
func newFlowClaim(proto classifier.Protocol, local netip.Addr, port uint16, remote netip.AddrPort) *claim {
	return &claim{proto: proto, addr: packIP(local), port: port, remote: packIP(remote.Addr()), rport: remote.Port()}
}

// syncPort tells the data plane whether the stream owns pc, from the
// claims counted now: under the application's portMu, so that of two
// changes racing for one port the later decision is the one that stays.
// Telling it what it knows already is no error, and one atomic bit.
func (r *registry) syncPort(a *app, pc classifier.PortClaim) error {
	a.portMu.Lock()
	defer a.portMu.Unlock()
	r.mu.Lock()
	static, held := a.staticPorts[pc], a.portRefs[pc] > 0
	r.mu.Unlock()
	if static {
		return nil
	}
	return r.flowDP.OwnPort(a.stream, pc, held)
}

func family(a netip.Addr) int {
	if a.Is4() {
		return 4
	}
	return 6
}

// freePort takes a port of the reserved range that no claim of proto uses,
// continuing after the last one given so that a port just released is
// reused as late as possible (its old connection may linger in TIME-WAIT).
// It costs at most a walk over the pool's 1,024 words, whatever is held.
func (r *registry) freePort(proto classifier.Protocol) (uint16, error) {
	lo, hi := r.ephemeral.Lo, r.ephemeral.Hi
	if lo == 0 && hi == 0 {
		return 0, fmt.Errorf("%w: the bridge has no reserved port range", ErrNoPorts)
	}
	if p, ok := r.pools[proto].next(lo, hi); ok {
		return p, nil
	}
	return 0, fmt.Errorf("%w: all %d %v ports of %d-%d are held", ErrNoPorts, int(hi)-int(lo)+1, proto, lo, hi)
}

// freePortFor is freePort for a: an instance takes a port of its own
// blocks of the reserved range.
func (r *registry) freePortFor(a *app, proto classifier.Protocol) (uint16, error) {
	if a.instance != "" && r.slices != nil {
		return r.instancePort(a, proto)
	}
	return r.freePort(proto)
}

// flowPort picks the local port of a's new flow from local to remote: a
// free port of the reserved range (of an instance's own blocks) while
// there is one and a's ports quota allows one more; else a port a's own
// flows hold already, towards another remote (a flow is told apart by its
// whole tuple, and the port stays a's alone, so the transmit check still
// isolates applications). So an application at its ports quota goes on
// connecting within its own ports, and leaves the rest of the range to the
// others.
func (r *registry) flowPort(a *app, proto classifier.Protocol, local netip.Addr, remote netip.AddrPort) (uint16, error) {
	ring := a.reusable(proto)
	atQuota := !a.mayTakePort()
	sliced := a.instance != "" && r.slices != nil
	if !atQuota {
		if sliced {
			if p, err := r.instancePort(a, proto); err == nil {
				ring.add(p)
				return p, nil
			}
		} else if p, ok := r.pools[proto].next(r.ephemeral.Lo, r.ephemeral.Hi); ok {
			ring.add(p)
			return p, nil
		}
	}
	for tries := 0; tries < maxReuseTries && len(ring.ports) > 0; tries++ {
		ring.cur = (ring.cur + 1) % len(ring.ports)
		q := ring.ports[ring.cur]
		users := r.byPort[portKey{proto, q}]
		mine, clash := len(users) > 0, false
		for _, c := range users {
			if c.stream != a.stream || c.listener {
				mine = false
				break
			}
			clash = clash || c.addr.ip() == local && c.peer() == remote
		}
		if !mine || sliced && !r.usablePort(a, q) {
			ring.drop(ring.cur)
			continue
		}
		if !clash {
			return q, nil
		}
	}
	if atQuota {
		return 0, a.portQuotaErr()
	}
	return r.freePortFor(a, proto) // for its error
}

// maxReuseTries bounds the ports flowPort looks at to share one.
const maxReuseTries = 64

// portPool is the reserved range's ports of one protocol that no claim
// and no configured listener holds, a bit each, with a bit per word of
// them that has any, so that finding the next free port looks at a few
// words whatever is held.
type portPool struct {
	free    classifier.PortSet
	summary [len(classifier.PortSet{}) / 64]uint64
	n       int // free ports
	cur     uint16
}

func (pp *portPool) set(p uint16, free bool) {
	w, bit := p/64, uint64(1)<<(p%64)
	was := pp.free[w]&bit != 0
	if free == was {
		return
	}
	if free {
		pp.free[w] |= bit
		pp.n++
	} else {
		pp.free[w] &^= bit
		pp.n--
	}
	if pp.free[w] != 0 {
		pp.summary[w/64] |= 1 << (w % 64)
	} else {
		pp.summary[w/64] &^= 1 << (w % 64)
	}
}

// next takes the first free port after the last one taken, wrapping
// around lo..hi (no bit outside them is ever set).
func (pp *portPool) next(lo, hi uint16) (uint16, bool) {
	if pp.n == 0 {
		return 0, false
	}
	p := int(pp.cur) + 1
	if p > int(hi) || p < int(lo) {
		p = int(lo)
	}
	q, ok := pp.from(p)
	if !ok {
		q, ok = pp.from(int(lo))
	}
	if ok {
		pp.cur = uint16(q)
	}
	return uint16(q), ok
}

// from finds the first free port at or after p.
func (pp *portPool) from(p int) (int, bool) {
	w := p / 64
	if b := pp.free[w] >> (p % 64); b != 0 {
		return p + bits.TrailingZeros64(b), true
	}
	for sw := (w + 1) / 64; sw < len(pp.summary); sw++ {
		m := pp.summary[sw]
		if sw == (w+1)/64 {
			m &= ^uint64(0) << ((w + 1) % 64)
		}
		if m != 0 {
			w2 := sw*64 + bits.TrailingZeros64(m)
			return w2*64 + bits.TrailingZeros64(pp.free[w2]), true
		}
	}
	return 0, false
}

// portRing lists the reserved ports an application's flows took, for
// flowPort to share; a port that has gone to another owner is dropped
// when it is next looked at.
type portRing struct {
	ports  []uint16
	member map[uint16]bool
	cur    int
}

func (a *app) reusable(proto classifier.Protocol) *portRing {
	ring := a.reuse[proto]
	if ring == nil {
		ring = &portRing{member: map[uint16]bool{}}
		a.reuse[proto] = ring
	}
	return ring
}

func (ring *portRing) add(p uint16) {
	if !ring.member[p] {
		ring.member[p] = true
		ring.ports = append(ring.ports, p)
	}
}

func (ring *portRing) drop(i int) {
	delete(ring.member, ring.ports[i])
	last := len(ring.ports) - 1
	ring.ports[i] = ring.ports[last]
	ring.ports = ring.ports[:last]
}

// resetPools marks free every port of the reserved range that no claim and
// no configured listener holds.
func (r *registry) resetPools() {
	lo, hi := r.ephemeral.Lo, r.ephemeral.Hi
	for proto, pp := range r.pools {
		*pp = portPool{cur: pp.cur}
		if lo == 0 && hi == 0 {
			continue
		}
		for p := int(lo); p <= int(hi); p++ {
			if len(r.byPort[portKey{proto, uint16(p)}]) == 0 && r.staticHolder(proto, uint16(p), netip.Addr{}, nil) == "" {
				pp.set(uint16(p), true)
			}
		}
	}
}

// release gives up one claim: tables first, then ownership. If the tables
// cannot be updated the claim stays.
func (r *registry) release(a *app, id uint64) error {
	r.mu.Lock()
	held, ok := a.claims[id]
	r.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownClaim, id)
	}
	c := &held
	if r.flowDP != nil && !c.listener {
		return r.releaseDelta(a, c)
	}
	r.tables.Lock()
	defer r.tables.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := a.claims[id]; !ok {
		return fmt.Errorf("%w: %d", ErrUnknownClaim, id) // released meanwhile
	}
	if c.listener && a.instance != "" {
		return r.releaseShared(a, c)
	}
	delete(a.claims, id)
	r.unindex(a, c)
	if err := r.apply(); err != nil {
		// The tables still steer the tuple: keep the claim, so that state
		// and data plane agree. The lease's end removes it in any case.
		a.claims[id] = *c
		r.index(a, c)
		return err
	}
	if err := r.dp.SetOwnership(a.stream, a.ownership()); err != nil {
		return dataplaneErr(err)
	}
	return nil
}

// releaseDelta is release of a flow on a FlowDataplane. The claim's port
// returns to the pool only once the data plane no longer steers the flow.
func (r *registry) releaseDelta(a *app, c *claim) error {
	r.tables.RLock()
	if err := r.flowDP.RemoveFlows([]classifier.Flow{a.flow(c)}); err != nil {
		r.tables.RUnlock()
		return dataplaneErr(err)
	}
	r.mu.Lock()
	delete(a.claims, c.id)
	r.unindex(a, c)
	pc := classifier.PortClaim{Proto: c.proto, Port: c.port}
	stale := r.rulesStale
	r.mu.Unlock()
	err := r.syncPort(a, pc)
	r.tables.RUnlock()
	if err != nil {
		return dataplaneErr(err)
	}
	if stale {
		return r.applyStale()
	}
	return nil
}

// applyStale applies the tables if a port block's rule changed since they
// were last applied (unhold): the delta paths change no rules themselves.
func (r *registry) applyStale() error {
	r.tables.Lock()
	defer r.tables.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.rulesStale {
		return nil
	}
	return r.apply()
}
