package control

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// This file grants and releases the claims of one application: listeners
// and flows, checked against every other application's and the
// configuration's, with ephemeral ports handed out from the reserved range.

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
