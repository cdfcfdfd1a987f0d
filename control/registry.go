package control

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

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
	AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error
	// AddRemoteStream attaches a remote application's stream.
	AddRemoteStream(id uint32, s *fabric.RemoteStream, own classifier.Ownership) error
	// SetOwnership replaces what the stream may send.
	SetOwnership(id uint32, own classifier.Ownership) error
	// RemoveStream detaches a stream; the server closes it afterwards.
	RemoveStream(id uint32) error
	// SetTables installs a complete new classification (static rules plus
	// every application's listeners and flows).
	SetTables(t *classifier.Tables) error
}

// FlowDataplane is a Dataplane that also takes flows and ports one at a
// time, so that a flow claim or release costs the same whatever the number
// of flows held: one entry in each realisation of the tables, one port of
// one stream's ownership. The server uses it when the data plane has it;
// otherwise every change goes through SetTables and SetOwnership. The
// server never calls these concurrently with SetTables, and calls them for
// one stream in the order it decided them; calls for different streams
// may run concurrently.
type FlowDataplane interface {
	Dataplane
	// AddFlows makes flows steer to their streams.
	AddFlows(flows []classifier.Flow) error
	// RemoveFlows stops flows steering; a flow not steered is no error.
	RemoveFlows(flows []classifier.Flow) error
	// OwnPort adds port p to what the stream may send (own) or takes it
	// away, leaving the rest of its ownership as it is.
	OwnPort(stream uint32, p classifier.PortClaim, own bool) error
}

// registry turns the claims of all applications into classifier tables and
// stream ownership, and keeps them applied to the data plane. All its
// methods are safe for concurrent use.
//
// Two locks order the work. mu guards the registry's own state and is held
// only for bookkeeping (constant time per claim). tables orders data plane
// calls: changes of the whole state (configuration, listeners, an
// application that comes or goes with configured entries) hold it
// exclusively and call the data plane under mu, so they reach the bridge in
// the order they were decided; flow claims and releases on a FlowDataplane
// hold it shared and call the data plane outside mu, so that applications
// claim concurrently, each one's claims in its own session's order.
type registry struct {
	tables    sync.RWMutex
	mu        sync.Mutex
	dp        Dataplane
	flowDP    FlowDataplane // dp, when it takes flows one at a time
	ephemeral classifier.PortRange
	firstID   uint32 // dynamic counter ids start here
	static    Static
	apps      map[uint32]*app
	named     map[string]*app                // the application that holds its name's static entries
	byPort    map[portKey][]claim            // copies of the claims on each port
	usedIDs   [classifier.MaxRuleID + 1]bool // listener and flow counter ids in use (static rules included)
	idCursor  uint32
	streamCur uint32
	pools     map[classifier.Protocol]*portPool
	usage     map[string]*usage // by quota holder (quotaKey)

	// Instances (groups.go, slices.go).
	spread     SpreadConfig
	settled    time.Time           // the end of the settle time (SpreadConfig.Settle)
	instances  map[string]*app     // by instanceKey
	groups     map[groupKey]*group // the listeners instances share
	slices     *portSlices         // nil without instances or reserved range
	rulesStale bool                // a block's hold ended since the tables were applied
	drains     DrainStats
	drainTimer *time.Timer
	stopped    bool             // no more drain timers
	now        func() time.Time // the drain deadlines' clock
	log        *slog.Logger
}

type portKey struct {
	proto classifier.Protocol
	port  uint16
}

// app is one registered application: one control connection, one stream.
type app struct {
	name      string
	instance  string // its name among the application's instances; "": the sole one
	draining  bool   // an instance that drains listens no more
	stream    uint32
	policy    Policy
	flowID    uint32           // the counter id all its flows share
	claims    map[uint64]claim // by id; values, so that a million flows are no million objects for the collector
	nextClaim uint64
	static    *AppStatic // the configuration's entries bound to this name, while it holds them
	// portRefs counts the claims on each port; with the static entries'
	// ports (staticPorts) they are the stream's ownership.
	portRefs    map[classifier.PortClaim]int
	staticPorts map[classifier.PortClaim]bool
	listeners   int                               // listener claims held
	reuse       map[classifier.Protocol]*portRing // reserved ports its flows hold, to share when the range runs out
	quotaKey    string                            // whose quota it counts against: its name, or unlistedKey
	use         *usage                            // that holder's usage, shared by all its streams
	ringBytes   int64                             // its stream's ring memory
	// portMu orders the delta path's ownership changes: a release that
	// narrows a port and a claim that takes the same port again (the pool
	// hands out the lowest free one) must reach the data plane in the
	// order of their decisions, or the stream loses a port it holds.
	portMu sync.Mutex
}

// claim is one listener or flow an application holds. It holds no
// pointer (its application is named by stream, its addresses are bytes),
// so that the collector neither scans the maps that hold claims by value
// nor marks an object a claim.
type claim struct {
	id       uint64
	stream   uint32 // its application's
	ruleID   uint32 // listeners only
	port     uint16 // local port
	rport    uint16 // flows only: the remote port
	proto    classifier.Protocol
	listener bool
	addr     ipBytes // listener: invalid means both families' wildcard; flow: local address
	remote   ipBytes // flows only
}

// peer is a flow's remote address and port.
func (c *claim) peer() netip.AddrPort { return netip.AddrPortFrom(c.remote.ip(), c.rport) }

// ipBytes is a netip.Addr (without zone) as bytes: a netip.Addr holds a
// pointer.
type ipBytes struct {
	b   [16]byte
	fam uint8 // 0: the invalid Addr, 4 or 6
}

func packIP(a netip.Addr) ipBytes {
	switch {
	case !a.IsValid():
		return ipBytes{}
	case a.Is4():
		return ipBytes{b: a.As16(), fam: 4}
	}
	return ipBytes{b: a.As16(), fam: 6}
}

func (p ipBytes) ip() netip.Addr {
	switch p.fam {
	case 4:
		return netip.AddrFrom16(p.b).Unmap()
	case 6:
		return netip.AddrFrom16(p.b)
	}
	return netip.Addr{}
}

// maxStreamID keeps stream ids inside GENEVE's 24-bit VNI.
const maxStreamID = 1<<24 - 1

func newRegistry(dp Dataplane, ephemeral classifier.PortRange, firstID uint32, static Static, spread SpreadConfig, log *slog.Logger) (*registry, error) {
	if spread.Seed == 0 {
		spread.Seed = DefaultSpreadSeed
	}
	if spread.DrainDeadline == 0 {
		spread.DrainDeadline = DefaultDrainDeadline
	}
	if spread.Settle == 0 {
		spread.Settle = DefaultSettle
	}
	r := &registry{
		spread:    spread,
		instances: make(map[string]*app),
		groups:    make(map[groupKey]*group),
		now:       time.Now,
		log:       log,
		dp:        dp,
		ephemeral: ephemeral,
		firstID:   max(firstID, 1),
		named:     make(map[string]*app),
		apps:      make(map[uint32]*app),
		byPort:    make(map[portKey][]claim),
		pools:     map[classifier.Protocol]*portPool{classifier.ProtoTCP: {}, classifier.ProtoUDP: {}},
		usage:     make(map[string]*usage),
	}
	r.flowDP, _ = dp.(FlowDataplane)
	if r.firstID > classifier.MaxRuleID {
		return nil, fmt.Errorf("first dynamic id %d beyond %d", r.firstID, classifier.MaxRuleID)
	}
	if err := r.setStatic(static); err != nil {
		return nil, err
	}
	r.settled = r.now().Add(spread.Settle)
	return r, nil
}

// dataplaneErr marks an error as the bridge's unless it already says what
// it is.
func dataplaneErr(err error) error {
	if errors.Is(err, ErrBridgeGone) {
		return err
	}
	return fmt.Errorf("%w: data plane: %v", ErrInternal, err)
}

// register adds an application, or one instance of it (instance not
// empty): it checks the quota of holder key (the name, or unlistedKey) for
// one more stream of ringBytes, picks a stream id and a flow counter id and
// calls attach, which creates the stream and adds it to the data plane;
// then the static entries bound to the application's name, if any, start
// steering to it, and an instance gets its blocks of the reserved range.
// On any error nothing is left behind.
func (r *registry) register(name, instance, key string, pol Policy, ringBytes int64, attach func(id uint32, own classifier.Ownership) error) (*app, error) {
	r.tables.Lock()
	defer r.tables.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	_, bound := r.static.Apps[name]
	if holder := r.named[name]; bound && holder != nil {
		return nil, fmt.Errorf("%w: application %q is registered already (stream %d) and holds its configured listeners", ErrNameTaken, name, holder.stream)
	}
	if other := r.instances[name+"/"+instance]; instance != "" && other != nil {
		return nil, fmt.Errorf("%w: instance %q of application %q is registered already (stream %d); every instance needs a name of its own", ErrNameTaken, instance, name, other.stream)
	}
	if err := r.admitStream(key, &pol, ringBytes); err != nil {
		return nil, err
	}
	id, ok := r.freeStream()
	if !ok {
		return nil, quotaErr(ReasonQuotaIDs, "no free stream id")
	}
	flowID, ok := r.allocID()
	if !ok {
		return nil, quotaErr(ReasonQuotaIDs, "no free counter id")
	}
	a := newApp(name, id, pol, flowID)
	a.instance = instance
	a.quotaKey, a.ringBytes = key, ringBytes
	if bound {
		a.bind(r.static.Apps[name])
	}
	if err := attach(id, a.ownership()); err != nil {
		r.usedIDs[flowID] = false
		return nil, err
	}
	r.apps[id] = a
	a.use = r.use(key)
	a.use.streams++
	a.use.ringBytes += ringBytes
	if bound || instance != "" {
		if bound {
			r.named[name] = a
		}
		restore := func() {}
		var err error
		if instance != "" {
			r.instances[instanceKey(a)] = a
			restore, err = r.reslice()
		}
		if err == nil {
			if err = r.apply(); err != nil {
				restore()
			}
		}
		if err != nil {
			delete(r.apps, id)
			r.dropStream(a)
			delete(r.named, name)
			delete(r.instances, instanceKey(a))
			r.usedIDs[flowID] = false
			r.dp.RemoveStream(id)
			return nil, err
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
//
// On a FlowDataplane its flows go as deltas, in chunks, while other
// applications go on claiming; their ports return to the pool only once
// the data plane no longer steers them, so that a new owner's flow cannot
// be removed with the old one's.
func (r *registry) unregister(a *app) error {
	r.tables.RLock()
	r.mu.Lock()
	if r.apps[a.stream] != a {
		r.mu.Unlock()
		r.tables.RUnlock()
		return nil
	}
	delete(r.apps, a.stream)
	if r.named[a.name] == a {
		delete(r.named, a.name)
	}
	var errs []error
	if a.instance != "" {
		delete(r.instances, instanceKey(a))
		r.leaveGroups(a)
		if _, err := r.reslice(); err != nil {
			errs = append(errs, err)
		}
		r.scheduleDrains()
	}
	whole := r.flowDP == nil || a.listeners > 0 || a.static != nil || a.instance != ""
	r.mu.Unlock()
	// a is out of r.apps: nothing but this reads or writes its claims now.
	if r.flowDP != nil {
		flows := make([]classifier.Flow, 0, len(a.claims)-a.listeners)
		for _, c := range a.claims {
			if !c.listener {
				flows = append(flows, a.flow(&c))
			}
		}
		if err := r.flowDP.RemoveFlows(flows); err != nil {
			errs = append(errs, err)
		}
	}
	r.releaseAll(a)
	r.tables.RUnlock()
	if whole {
		r.tables.Lock()
		r.mu.Lock()
		if err := r.apply(); err != nil {
			errs = append(errs, err)
		}
		r.mu.Unlock()
		r.tables.Unlock()
	}
	r.mu.Lock()
	r.usedIDs[a.flowID] = false
	r.dropStream(a)
	r.mu.Unlock()
	if err := r.dp.RemoveStream(a.stream); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// releaseChunk bounds the claims unindexed per hold of mu when an
// application goes, so that others' claims interleave.
const releaseChunk = 1024

// releaseAll forgets a's claims, a chunk at a time.
func (r *registry) releaseAll(a *app) {
	claims := make([]claim, 0, len(a.claims))
	for _, c := range a.claims {
		claims = append(claims, c)
	}
	a.claims = map[uint64]claim{}
	for len(claims) > 0 {
		n := min(len(claims), releaseChunk)
		r.mu.Lock()
		for i := range claims[:n] {
			r.unindex(a, &claims[i])
		}
		r.mu.Unlock()
		claims = claims[n:]
	}
}

// AppInfo describes one registered application, for metrics and the CLI.
type AppInfo struct {
	Name      string
	Instance  string // "" unless it registered as an instance
	Stream    uint32
	Listeners int                    // listeners it asked for
	Flows     int                    // connections it asked for
	Ports     []classifier.PortClaim // every port its stream owns, configured ones included
}

func (r *registry) snapshot() []AppInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]AppInfo, 0, len(r.apps))
	for _, a := range r.apps {
		info := AppInfo{Name: a.name, Instance: a.instance, Stream: a.stream, Ports: a.ownership().Ports,
			Listeners: a.listeners, Flows: len(a.claims) - a.listeners}
		out = append(out, info)
	}
	slices.SortFunc(out, func(x, y AppInfo) int { return int(x.Stream) - int(y.Stream) })
	return out
}
