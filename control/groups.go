package control

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
)

// This file lets the instances of one application share a listener. The
// instances that listen on one proto/addr/port form a group; the group's
// maglev.Chain, over the sorted names of the instances that take new
// connections, becomes the listener's classifier.Spread. Joining, leaving
// and draining are membership changes: the chain advances to the new
// table, so a slot that changes hands keeps its old owner as previous
// owner, and an instance that is gone for good is forgotten.

// SpreadConfig shapes the listeners that instances share. Every box of a
// cluster must have the same Seed, or the boxes build different tables and
// a connection that ECMP moves between boxes lands on the wrong instance.
type SpreadConfig struct {
	// Seed feeds the Maglev tables, the flow hash and the port slices.
	// Zero: DefaultSpreadSeed.
	Seed uint64
	// DrainDeadline is how long a draining instance keeps its established
	// connections on a shared listener before it is forgotten. Zero:
	// DefaultDrainDeadline.
	DrainDeadline time.Duration
	// Settle is how long after the server starts the instances that come
	// back to it (after a restart of this box) are taken as one set, not
	// as a sequence of joins. Zero: DefaultSettle; negative: none.
	Settle time.Duration
}

// Defaults of SpreadConfig.
const (
	DefaultSpreadSeed    uint64 = 0x6661627269632d31 // "fabric-1"
	DefaultDrainDeadline        = 30 * time.Second
	// DefaultSettle covers instances' reconnection to a restarted bridge
	// (a remote one retries every 250 ms at most) with room to spare.
	DefaultSettle = 2 * time.Second
)

// groupKey names a shared listener: the application and exactly the
// proto/addr/port its instances listen on.
type groupKey struct {
	app   string
	proto classifier.Protocol
	port  uint16
	addr  ipBytes
}

// group is one shared listener. Groups are copied on change (see
// changeGroup), so a failed data plane update restores the old pointer.
type group struct {
	key     groupKey
	members map[string]member // by instance name, draining ones included
	table   []string          // the names of chain's current table, sorted
	chain   *maglev.Chain
	// spread is chain in stream ids; nil while the group is one instance
	// with no previous owner, which is then a plain listener.
	spread *classifier.Spread
}

// member is one instance's place in a group.
type member struct {
	app      *app
	claim    uint64 // its listener claim in app.claims
	draining bool
	deadline time.Time // while draining
}

// DrainStats counts drains since the server started: a drain is one
// instance leaving one shared listener's table while it keeps its
// established connections.
type DrainStats struct {
	Started uint64 // by Client.Drain, Server.Drain or a shared listener's release
	Expired uint64 // ended by the drain deadline rather than the lease
}

// GroupInfo describes one shared listener, for metrics and the CLI.
type GroupInfo struct {
	App       string
	Proto     classifier.Protocol
	Addr      netip.Addr // invalid: any address of either family
	Port      uint16
	Instances []string // the instances that take new connections, sorted
	Draining  []string // the instances that keep only their established ones, sorted
	// Digest identifies the current table: a hash of the seed and
	// Instances. Boxes that show the same digest send every new connection
	// of the listener to the same instance.
	Digest string
}

// tableNames are the instances that take new connections: the members that
// do not drain, or, while every member drains, all of them, since nobody
// else could take the listener's packets.
func (g *group) tableNames() []string {
	var current, all []string
	for name, m := range g.members {
		all = append(all, name)
		if !m.draining {
			current = append(current, name)
		}
	}
	if len(current) == 0 {
		current = all
	}
	slices.Sort(current)
	return current
}

// clone is g with its own members map.
func (g *group) clone() *group {
	out := *g
	out.members = make(map[string]member, len(g.members))
	for name, m := range g.members {
		out.members[name] = m
	}
	return &out
}

// changeGroup applies change to (a copy of) the group of key, or to a new
// one, then advances its chain to its new table, forgets the instances
// that left it and rebuilds its Spread. A group left with no member goes.
// restore puts the group back as it was; call it, under mu, when the data
// plane refuses the result. Call with mu held.
func (r *registry) changeGroup(key groupKey, change func(g *group)) (restore func(), err error) {
	old := r.groups[key]
	g := &group{key: key, members: map[string]member{}}
	if old != nil {
		g = old.clone()
	}
	change(g)
	restore = func() {
		if old == nil {
			delete(r.groups, key)
		} else {
			r.groups[key] = old
		}
	}
	if len(g.members) == 0 {
		delete(r.groups, key)
		return restore, nil
	}
	var gone []string // members that left for good: nothing of theirs to find
	if old != nil {
		for name := range old.members {
			if _, ok := g.members[name]; !ok {
				gone = append(gone, name)
			}
		}
	}
	if names := g.tableNames(); !slices.Equal(names, g.table) {
		t, err := maglev.New(names, r.spread.Seed, maglev.DefaultSize)
		if err != nil {
			return nil, err
		}
		switch {
		case g.chain == nil || r.settling():
			// A box that has just started learns its instances one
			// registration at a time; taken as joins, they would pass
			// slots from hand to hand and lose the previous owners that
			// the other boxes' tables, and the instances, still have.
			// Until the set has settled the chain starts afresh: the
			// current table, with the draining instances as the previous
			// owners of the slots they would hold.
			if g.chain, err = r.freshChain(g, t); err != nil {
				return nil, err
			}
		default:
			if g.chain, err = g.chain.AdvanceWithout(t, gone...); err != nil {
				return nil, err
			}
		}
		g.table = names
	} else {
		for _, name := range gone {
			g.chain = g.chain.Forget(name)
		}
	}
	g.spread = g.buildSpread(r.spread.Seed)
	r.groups[key] = g
	return restore, nil
}

// settling reports whether the server is within its settle time.
func (r *registry) settling() bool { return r.now().Before(r.settled) }

// freshChain is a chain at t, whose draining members are the previous
// owners of the slots they hold in a table that includes them.
func (r *registry) freshChain(g *group, t *maglev.Table) (*maglev.Chain, error) {
	all := slices.Sorted(maps.Keys(g.members))
	if len(all) == t.Size() || slices.Equal(all, t.Instances()) {
		return maglev.NewChain(t), nil
	}
	withDraining, err := maglev.New(all, r.spread.Seed, t.Size())
	if err != nil {
		return nil, err
	}
	return maglev.NewChain(withDraining).Advance(t)
}

// buildSpread is g's chain in stream ids, or nil for a group of one
// instance that no slot remembers another owner for: a plain listener,
// which costs the data plane nothing extra.
func (g *group) buildSpread(seed uint64) *classifier.Spread {
	stream := make(map[string]uint32, len(g.members))
	for name, m := range g.members {
		stream[name] = m.app.stream
	}
	slots := make([]classifier.Slot, g.chain.Table().Size())
	previous := false
	for s := range slots {
		cur, prev := g.chain.Lookup(uint64(s)) // slot s: hash s modulo the size
		slots[s] = classifier.Slot{Current: stream[cur], Previous: stream[prev]}
		previous = previous || slots[s].Previous != 0
	}
	if len(g.members) == 1 && !previous {
		return nil
	}
	return &classifier.Spread{Seed: seed, Slots: slots}
}

// groupOf is the key of the group that listener claim c of instance a
// belongs to.
func groupOf(a *app, c *claim) groupKey {
	return groupKey{app: a.name, proto: c.proto, port: c.port, addr: c.addr}
}

// mayJoin reports whether instance a may share the listener that claim c
// (which overlaps what a asks for, at addr) holds: c is another instance's
// of the same application, on exactly the same address.
func (r *registry) mayJoin(a *app, c *claim, addr netip.Addr) bool {
	holder := r.apps[c.stream]
	return a.instance != "" && holder != nil && holder != a && holder.instance != "" &&
		holder.name == a.name && c.addr == packIP(addr)
}

// joinGroup makes listener claim c of instance a a member of its group.
// Call with mu held.
func (r *registry) joinGroup(a *app, c *claim) (restore func(), err error) {
	return r.changeGroup(groupOf(a, c), func(g *group) {
		g.members[a.instance] = member{app: a, claim: c.id}
	})
}

// groupListeners are the shared listeners' table entries.
func (r *registry) groupListeners() []classifier.Listener {
	out := make([]classifier.Listener, 0, len(r.groups))
	for _, g := range r.groups {
		var id uint32
		for _, m := range g.members {
			if c, ok := m.app.claims[m.claim]; ok && (id == 0 || c.ruleID < id) {
				id = c.ruleID
			}
		}
		first := g.members[g.table[0]]
		l := classifier.Listener{ID: id, Protocol: g.key.proto, Addr: g.key.addr.ip(), Port: g.key.port,
			Stream: first.app.stream, Spread: g.spread}
		if g.spread == nil {
			c := first.app.claims[first.claim]
			addr, need := first.app.uncovered(&c)
			if !need {
				continue // the instance's configured listener steers it
			}
			l.Addr = addr
		}
		out = append(out, l)
	}
	return out
}

// releaseShared is release of listener claim c of instance a. While
// another instance of the group takes new connections, it drains a from
// this listener only: a keeps the claim, its port and its established
// connections until the drain ends. Otherwise a leaves at once, as an
// exclusive listener would. Call with tables and mu held.
func (r *registry) releaseShared(a *app, c *claim) error {
	key := groupOf(a, c)
	g := r.groups[key]
	m, ok := g.members[a.instance]
	if !ok || m.claim != c.id {
		return fmt.Errorf("%w: listener claim %d is in no group", ErrInternal, c.id)
	}
	if m.draining {
		return fmt.Errorf("%w: %d was released already and drains", ErrUnknownClaim, c.id)
	}
	others := false
	for name, o := range g.members {
		others = others || name != a.instance && !o.draining
	}
	if others {
		restore, err := r.changeGroup(key, func(g *group) { r.startDrain(g, a.instance) })
		if err != nil {
			return fmt.Errorf("%w: %v", ErrInternal, err)
		}
		if err := r.apply(); err != nil {
			restore()
			return err
		}
		r.drains.Started++
		r.scheduleDrains()
		return nil
	}
	restore, err := r.changeGroup(key, func(g *group) { delete(g.members, a.instance) })
	if err != nil {
		return fmt.Errorf("%w: %v", ErrInternal, err)
	}
	delete(a.claims, c.id)
	r.unindex(a, c)
	if err := r.apply(); err != nil {
		a.claims[c.id] = *c
		r.index(a, c)
		restore()
		return err
	}
	if err := r.dp.SetOwnership(a.stream, a.ownership()); err != nil {
		return dataplaneErr(err)
	}
	return nil
}

// startDrain marks g's member name draining until the deadline.
func (r *registry) startDrain(g *group, name string) {
	m := g.members[name]
	m.draining, m.deadline = true, r.now().Add(r.spread.DrainDeadline)
	g.members[name] = m
}

// apply compiles the tables and installs them. Call with tables and mu
// held.
func (r *registry) apply() error {
	t, err := r.compile()
	if err == nil {
		err = r.dp.SetTables(t)
	}
	if err != nil {
		return dataplaneErr(err)
	}
	r.rulesStale = false
	return nil
}

// drain takes instance a out of the tables of every listener it shares:
// it gets no new connections there and keeps its established ones until
// its lease ends or the drain deadline passes. It listens no more.
func (r *registry) drain(a *app) error {
	if a.instance == "" {
		return fmt.Errorf("%w: only an instance of an application can drain (register with an instance name)", ErrNotPermitted)
	}
	r.tables.Lock()
	defer r.tables.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.apps[a.stream] != a {
		return fmt.Errorf("%w: the instance has gone", ErrNotRegistered)
	}
	var restores []func()
	undo := func() {
		for _, restore := range slices.Backward(restores) {
			restore()
		}
	}
	started := 0
	for key, g := range r.groups {
		if m, ok := g.members[a.instance]; !ok || m.app != a || m.draining {
			continue
		}
		restore, err := r.changeGroup(key, func(g *group) { r.startDrain(g, a.instance) })
		if err != nil {
			undo()
			return fmt.Errorf("%w: %v", ErrInternal, err)
		}
		restores = append(restores, restore)
		started++
	}
	if started > 0 {
		if err := r.apply(); err != nil {
			undo()
			return err
		}
	}
	a.draining = true
	r.drains.Started += uint64(started)
	r.scheduleDrains()
	return nil
}

// scheduleDrains sets the timer for the earliest drain deadline. Call with
// mu held.
func (r *registry) scheduleDrains() {
	var next time.Time
	for _, g := range r.groups {
		for _, m := range g.members {
			if m.draining && (next.IsZero() || m.deadline.Before(next)) {
				next = m.deadline
			}
		}
	}
	if next.IsZero() || r.stopped {
		return
	}
	wait := max(next.Sub(r.now()), 0)
	if r.drainTimer == nil {
		r.drainTimer = time.AfterFunc(wait, func() { r.expireDrains(r.now()) })
	} else {
		r.drainTimer.Reset(wait)
	}
}

// expireDrains ends the drains whose deadline is at or before now: each
// such instance leaves its group, is forgotten as previous owner, and
// gives its listener claim up.
func (r *registry) expireDrains(now time.Time) {
	r.tables.Lock()
	defer r.tables.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	type gone struct {
		a *app
		c claim
	}
	var left []gone
	var restores []func()
	for key, g := range r.groups {
		var names []string
		for name, m := range g.members {
			if m.draining && !m.deadline.After(now) {
				names = append(names, name)
				left = append(left, gone{m.app, m.app.claims[m.claim]})
			}
		}
		if len(names) == 0 {
			continue
		}
		restore, err := r.changeGroup(key, func(g *group) {
			for _, name := range names {
				delete(g.members, name)
			}
		})
		if err != nil {
			r.log.Warn("a drain could not end", "app", key.app, "port", key.port, "error", err)
			continue
		}
		restores = append(restores, restore)
	}
	if len(left) == 0 {
		r.scheduleDrains()
		return
	}
	for i := range left {
		delete(left[i].a.claims, left[i].c.id)
		r.unindex(left[i].a, &left[i].c)
	}
	if err := r.apply(); err != nil {
		for i := range left {
			left[i].a.claims[left[i].c.id] = left[i].c
			r.index(left[i].a, &left[i].c)
		}
		for _, restore := range slices.Backward(restores) {
			restore()
		}
		r.log.Warn("ending drains failed; retrying in a second", "error", err)
		if !r.stopped && r.drainTimer != nil {
			r.drainTimer.Reset(time.Second)
		}
		return
	}
	for i := range left {
		a := left[i].a
		if r.apps[a.stream] == a {
			r.dp.SetOwnership(a.stream, a.ownership())
		}
	}
	r.drains.Expired += uint64(len(left))
	r.scheduleDrains()
}

// leaveGroups takes instance a, whose lease ended, out of every group: its
// connections ended with it, so no slot keeps it as previous owner. Call
// with mu held; the caller applies the tables.
func (r *registry) leaveGroups(a *app) {
	for key, g := range r.groups {
		if m, ok := g.members[a.instance]; !ok || m.app != a {
			continue
		}
		if _, err := r.changeGroup(key, func(g *group) { delete(g.members, a.instance) }); err != nil {
			// Only a table for more instances than it has room for fails,
			// and one fewer always fits.
			r.log.Warn("an instance could not leave its group", "app", a.name, "instance", a.instance, "error", err)
		}
	}
}

// stopDrains stops the drain timer for good.
func (r *registry) stopDrains() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = true
	if r.drainTimer != nil {
		r.drainTimer.Stop()
	}
}

// groupsInfo lists the shared listeners.
func (r *registry) groupsInfo() []GroupInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]GroupInfo, 0, len(r.groups))
	for _, g := range r.groups {
		info := GroupInfo{App: g.key.app, Proto: g.key.proto, Addr: g.key.addr.ip(), Port: g.key.port,
			Instances: slices.Clone(g.table), Digest: spreadDigest(r.spread.Seed, g.table)}
		for name, m := range g.members {
			if m.draining {
				info.Draining = append(info.Draining, name)
			}
		}
		slices.Sort(info.Draining)
		out = append(out, info)
	}
	slices.SortFunc(out, func(x, y GroupInfo) int {
		if x.App != y.App {
			return strings.Compare(x.App, y.App)
		}
		if x.Port != y.Port {
			return int(x.Port) - int(y.Port)
		}
		if x.Proto != y.Proto {
			return int(x.Proto) - int(y.Proto)
		}
		return x.Addr.Compare(y.Addr)
	})
	return out
}

// spreadDigest identifies a table by what it is built from: the seed and
// the sorted instance names.
func spreadDigest(seed uint64, sorted []string) string {
	h := sha256.New()
	h.Write(binary.LittleEndian.AppendUint64(nil, seed))
	for _, name := range sorted {
		h.Write([]byte(name))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}
