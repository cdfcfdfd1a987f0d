package control

import (
	"net/netip"
	"slices"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// This file turns the claims into what the data plane enforces: the
// classifier tables that steer to each stream, and each stream's ownership
// for the transmit check.

// union is the ownership of both x and y.
func union(x, y classifier.Ownership) classifier.Ownership {
	out := classifier.Ownership{Addrs: slices.Clone(x.Addrs), Ports: slices.Clone(x.Ports)}
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

// compile builds the tables from the static rules and every claim.
func (r *registry) compile() (*classifier.Tables, error) {
	set := r.ruleSet()
	return classifier.Compile(&set)
}

// ruleSet is what compile compiles. Call with mu held.
func (r *registry) ruleSet() classifier.RuleSet {
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
				if a.instance != "" {
					continue // its group's entry steers it (groupListeners)
				}
				addr, need := a.uncovered(&c)
				if !need {
					continue // the application's configured listener steers it
				}
				set.Listeners = append(set.Listeners, classifier.Listener{
					ID: c.ruleID, Protocol: c.proto, Addr: addr, Port: c.port, Stream: a.stream,
				})
			} else {
				set.Flows = append(set.Flows, a.flow(&c))
			}
		}
	}
	set.Listeners = append(set.Listeners, r.groupListeners()...)
	set.Rules = append(set.Rules, r.blockRules()...)
	return set
}

// uncovered says which part of listener claim c needs a table entry of its
// own: the part that none of a's configured listeners (while a holds them)
// already steers to a. need is false when they cover all of it, so the claim
// shares their entries; else addr is what the claim's own entry must listen
// on (c's address, or one family's wildcard when a configured wildcard covers
// the other). Deciding this when the tables are compiled, not when the
// claim is made, keeps the claim steered if a reload takes the configured
// listener away.
func (a *app) uncovered(c *claim) (addr netip.Addr, need bool) {
	ca := c.addr.ip()
	if a.static == nil {
		return ca, true
	}
	covered := func(part netip.Addr) bool {
		for _, l := range a.static.Listeners {
			if l.Protocol == c.proto && l.Port == c.port && covers(l.Addr, part) {
				return true
			}
		}
		return false
	}
	if ca.IsValid() {
		return ca, !covered(ca)
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
	return ca, true
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

func newApp(name string, stream uint32, pol Policy, flowID uint32) *app {
	return &app{name: name, stream: stream, policy: pol, flowID: flowID, claims: make(map[uint64]claim),
		portRefs: map[classifier.PortClaim]int{}, reuse: map[classifier.Protocol]*portRing{}}
}

// bind gives a the configuration's entries for its name, and their ports.
func (a *app) bind(as AppStatic) {
	a.static = &as
	a.staticPorts = map[classifier.PortClaim]bool{}
	for _, l := range as.Listeners {
		a.staticPorts[classifier.PortClaim{Proto: l.Protocol, Port: l.Port}] = true
	}
	for _, rule := range as.Rules {
		if rule.DstPorts.Lo != rule.DstPorts.Hi || rule.DstPorts.IsAny() {
			continue
		}
		if rule.Protocol != classifier.ProtoUDP {
			a.staticPorts[classifier.PortClaim{Proto: classifier.ProtoTCP, Port: rule.DstPorts.Lo}] = true
		}
		if rule.Protocol != classifier.ProtoTCP {
			a.staticPorts[classifier.PortClaim{Proto: classifier.ProtoUDP, Port: rule.DstPorts.Lo}] = true
		}
	}
}

// unbind takes the configuration's entries away from a.
func (a *app) unbind() { a.static, a.staticPorts = nil, nil }

// flow is flow claim c as the tables hold it.
func (a *app) flow(c *claim) classifier.Flow {
	return classifier.Flow{ID: a.flowID, Protocol: c.proto, Remote: c.peer(),
		Local: netip.AddrPortFrom(c.addr.ip(), c.port), Stream: a.stream}
}

// ownership is what a's stream may send: its claims' ports and those of
// its static entries. It costs O(ports owned); claims change ownership a
// port at a time instead (FlowDataplane.OwnPort).
func (a *app) ownership() classifier.Ownership {
	own := classifier.Ownership{Addrs: slices.Clone(a.policy.Addrs), Ports: make([]classifier.PortClaim, 0, len(a.portRefs)+len(a.staticPorts))}
	for pc := range a.portRefs {
		own.Ports = append(own.Ports, pc)
	}
	for pc := range a.staticPorts {
		if a.portRefs[pc] == 0 {
			own.Ports = append(own.Ports, pc)
		}
	}
	slices.SortFunc(own.Ports, func(x, y classifier.PortClaim) int {
		if x.Proto != y.Proto {
			return int(x.Proto) - int(y.Proto)
		}
		return int(x.Port) - int(y.Port)
	})
	return own
}
