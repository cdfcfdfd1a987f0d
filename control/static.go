package control

import (
	"fmt"
	"net/netip"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// This file holds the configured part of the classification and replaces
// it on reload, widening ownership across the change so that no packet of
// the old or the new ports is refused in between.

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

// setStatic replaces the static classification and applies the result.
// Nothing changes when the new entries are invalid, clash with what
// applications hold, or the data plane refuses them.
func (r *registry) setStatic(st Static) error {
	r.tables.Lock()
	defer r.tables.Unlock()
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
				if holder := r.named[a.name]; c.listener && overlaps(c.addr.ip(), l.Addr) && (holder == nil || c.stream != holder.stream) {
					return fmt.Errorf("listener id %d: %v port %d is held by %s", l.ID, l.Protocol, l.Port, r.holder(c.stream))
				}
			}
		}
	}
	before := make(map[uint32]classifier.Ownership, len(r.apps))
	for id, a := range r.apps {
		before[id] = a.ownership()
	}
	old, oldNamed := r.static, r.named
	r.static = st
	r.named = make(map[string]*app)
	for _, a := range r.apps {
		a.unbind()
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
			a.unbind()
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
	r.resetPools()
	return nil
}

// bind gives a its name's static entries.
func (r *registry) bind(a *app) {
	a.bind(r.static.Apps[a.name])
	r.named[a.name] = a
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

func (r *registry) staticStream(id uint32) bool {
	for _, rule := range r.static.Rules {
		if rule.Stream == id && (rule.Action == classifier.ActionSteer || rule.Action == classifier.ActionIngest) {
			return true
		}
	}
	return false
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
