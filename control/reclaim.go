package control

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// This file grants the claims an application asks for again after the
// bridge restarted (Request.Reclaim): its listeners and the flows of its
// open connections, at exactly the ports it had, so that the connections
// its stack kept through the restart are steered to it again.

// reclaimListener is listen for a listener held under an earlier lease. A
// port of the reserved range, which listen hands out but refuses to take
// by number, is granted if it is free.
func (r *registry) reclaimListener(a *app, proto classifier.Protocol, addr netip.Addr, port uint16) (*claim, error) {
	if port == 0 || !r.ephemeral.Contains(port) {
		return r.listen(a, proto, addr, port)
	}
	if addr.IsValid() && !addr.IsUnspecified() && !slices.Contains(a.policy.Addrs, addr) {
		return nil, fmt.Errorf("%w: address %v is not one this application may use", ErrNotPermitted, addr)
	}
	return r.grantReserved(a, &claim{proto: proto, listener: true, addr: packIP(addr), port: port})
}

// reclaimFlow is connect for a flow held under an earlier lease: the same
// local address and port, which must be free.
func (r *registry) reclaimFlow(a *app, proto classifier.Protocol, local netip.Addr, port uint16, remote netip.AddrPort) (*claim, error) {
	ra := remote.Addr()
	switch {
	case !remote.IsValid() || remote.Port() == 0 || ra.IsUnspecified() || ra.IsMulticast() || ra.Is4In6():
		return nil, fmt.Errorf("%w: remote %v is not a unicast address and port", ErrBadRequest, remote)
	case !slices.Contains(a.policy.Addrs, local):
		return nil, fmt.Errorf("%w: address %v is not one this application may use", ErrNotPermitted, local)
	case local.Is4() != ra.Is4():
		return nil, fmt.Errorf("%w: local %v and remote %v are of different families", ErrBadRequest, local, ra)
	}
	return r.grantReserved(a, newFlowClaim(proto, local, port, remote))
}

// grantReserved grants a c, whose port of the reserved range it names.
func (r *registry) grantReserved(a *app, c *claim) (*claim, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.reservedPortFree(a, c.proto, c.port); err != nil {
		return nil, err
	}
	if err := r.grant(a, c); err != nil {
		return nil, err
	}
	return c, nil
}

// reservedPortFree says why port cannot be granted to a again by number,
// if it cannot: it must be of the reserved range and unclaimed. r.mu is
// held.
func (r *registry) reservedPortFree(a *app, proto classifier.Protocol, port uint16) error {
	if !r.ephemeral.Contains(port) {
		return fmt.Errorf("%w: port %d is outside the reserved range %d-%d", ErrNotPermitted, port, r.ephemeral.Lo, r.ephemeral.Hi)
	}
	if held := r.byPort[portKey{proto, port}]; len(held) > 0 {
		return fmt.Errorf("%w: %v port %d was taken by %s meanwhile", ErrPortInUse, proto, port, r.holder(held[0].stream))
	}
	if owner := r.staticHolder(proto, port, netip.Addr{}, a); owner != "" {
		return fmt.Errorf("%w: %v port %d is held by application %q by configuration", ErrPortInUse, proto, port, owner)
	}
	return nil
}
