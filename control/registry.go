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
func (r *registry) register(name string, pol Policy, attach func(id uint32, own classifier.Ownership) error) (*app, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, bound := r.static.Apps[name]
	if holder := r.named[name]; bound && holder != nil {
		return nil, fmt.Errorf("%w: application %q is registered already (stream %d) and holds its configured listeners", ErrNameTaken, name, holder.stream)
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

// AppInfo describes one registered application, for metrics and the CLI.
type AppInfo struct {
	Name      string
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
