package control

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// This file bounds what one application holds, whatever number of control
// connections it opens: its quota counts against its name, and the
// applications the configuration does not name count together against one
// quota (Config.Default). Every count moves by one per claim, release or
// registration, so a quota costs a claim O(1).

// usage is what every stream of one quota holder holds at once. The
// registry keeps one per holder while the holder has a stream.
type usage struct {
	streams   int
	ringBytes int64
	ports     int // distinct ports its claims hold (a port shared by flows counts once)
	flows     int
}

// Defaults of Policy's bounds.
const (
	DefaultMaxPorts     = 256 // without a reserved range; with one, a quarter of it
	DefaultMaxFlows     = 65536
	DefaultMaxStreams   = 16
	DefaultMaxRingBytes = 512 << 20
)

// unlistedKey is the quota holder of every application the configuration
// does not name; no valid name can be it.
const unlistedKey = "\x00unlisted"

// Refusal reasons, for metrics: a request refused for a bound says which
// one; any other refusal is named by its error code (see codes).
const (
	ReasonQuotaPorts     = "quota_ports"      // the application holds its ports quota
	ReasonQuotaFlows     = "quota_flows"      // it holds its connections quota
	ReasonQuotaStreams   = "quota_streams"    // it has as many streams as its quota allows
	ReasonQuotaRingBytes = "quota_ring_bytes" // its streams' rings would exceed its memory quota
	ReasonQuotaSlots     = "quota_slots"      // it asked for rings deeper than its quota
	ReasonQuotaIDs       = "quota_ids"        // the bridge has no free stream or counter id
	ReasonUnlisted       = "unlisted"         // the configuration refuses applications it does not name
)

// RefusalReasons lists every reason Server.Refusals counts, in a stable
// order.
var RefusalReasons = func() []string {
	out := []string{ReasonQuotaPorts, ReasonQuotaFlows, ReasonQuotaStreams, ReasonQuotaRingBytes,
		ReasonQuotaSlots, ReasonQuotaIDs, ReasonUnlisted}
	for _, c := range codes {
		if c.err != ErrQuota {
			out = append(out, c.code)
		}
	}
	return out
}()

// reasonError is a refusal with a finer reason than its error code.
type reasonError struct {
	reason string
	err    error // wraps the code's sentinel
}

func (e *reasonError) Error() string { return e.err.Error() }
func (e *reasonError) Unwrap() error { return e.err }

// quotaErr is a refusal of ErrQuota for reason.
func quotaErr(reason, format string, args ...any) error {
	return &reasonError{reason: reason, err: fmt.Errorf("%w: "+format, append([]any{ErrQuota}, args...)...)}
}

// refusalReason is the metric's reason for a refused request's error.
func refusalReason(err error) string {
	if re, ok := errors.AsType[*reasonError](err); ok {
		return re.reason
	}
	return wireError(err).Code
}

// refusals counts refused requests by reason.
type refusals struct {
	n map[string]*atomic.Uint64 // fixed at creation: RefusalReasons
}

func newRefusals() *refusals {
	r := &refusals{n: make(map[string]*atomic.Uint64, len(RefusalReasons))}
	for _, reason := range RefusalReasons {
		r.n[reason] = new(atomic.Uint64)
	}
	return r
}

func (r *refusals) add(err error) {
	if c := r.n[refusalReason(err)]; c != nil {
		c.Add(1)
	}
}

// Refusals counts the requests the server refused since it started, by
// reason (RefusalReasons: the quota bound, or the error code). A session
// the server ends for a protocol error counts once.
func (s *Server) Refusals() map[string]uint64 {
	out := make(map[string]uint64, len(s.refused.n))
	for reason, c := range s.refused.n {
		out[reason] = c.Load()
	}
	return out
}

// ringBytes is the memory of a local stream of cfg's rings, with fabric's
// defaults (1024 slots of 2048 bytes) where cfg leaves a field 0.
func ringBytes(cfg fabric.Config) int64 {
	or := func(n, def int) int {
		if n == 0 {
			return def
		}
		return n
	}
	slot := or(cfg.SlotSize, 2048)
	return fabric.RingBytes(or(cfg.RxSlots, 1024), slot) + fabric.RingBytes(or(cfg.TxSlots, 1024), slot)
}

// use returns the usage of holder key, created on first use. Call with mu
// held.
func (r *registry) use(key string) *usage {
	u := r.usage[key]
	if u == nil {
		u = &usage{}
		r.usage[key] = u
	}
	return u
}

// admitStream says whether holder key may add a stream of ringBytes under
// pol. Call with mu held.
func (r *registry) admitStream(key string, pol *Policy, ringBytes int64) error {
	u := r.usage[key]
	if u == nil {
		u = &usage{}
	}
	if pol.MaxStreams > 0 && u.streams >= pol.MaxStreams {
		return quotaErr(ReasonQuotaStreams, "%d streams held, the limit", u.streams)
	}
	if pol.MaxRingBytes > 0 && u.ringBytes+ringBytes > pol.MaxRingBytes {
		return quotaErr(ReasonQuotaRingBytes, "%d bytes of rings held, %d more would pass the limit of %d", u.ringBytes, ringBytes, pol.MaxRingBytes)
	}
	return nil
}

// admit checks, before a stream is made, that the application may have
// one more of ringBytes; register checks again when it adds the stream.
func (r *registry) admit(key string, pol Policy, ringBytes int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.admitStream(key, &pol, ringBytes)
}

// dropStream gives a's stream back to its holder's usage. Call with mu
// held, after a's claims are unindexed.
func (r *registry) dropStream(a *app) {
	a.use.streams--
	a.use.ringBytes -= a.ringBytes
	if a.use.streams == 0 {
		delete(r.usage, a.quotaKey)
	}
}

// mayTakePort says whether a may hold one more distinct port. Call with mu
// held.
func (a *app) mayTakePort() bool {
	return a.policy.MaxPorts <= 0 || a.use.ports < a.policy.MaxPorts
}

// portQuotaErr is the refusal of a port beyond a's quota.
func (a *app) portQuotaErr() error {
	return quotaErr(ReasonQuotaPorts, "application %q holds %d ports, its limit", a.name, a.use.ports)
}

// mayAddFlow refuses a flow beyond a's quota. Call with mu held.
func (a *app) mayAddFlow() error {
	if a.policy.MaxFlows > 0 && a.use.flows >= a.policy.MaxFlows {
		return quotaErr(ReasonQuotaFlows, "application %q holds %d connections, its limit", a.name, a.use.flows)
	}
	return nil
}
