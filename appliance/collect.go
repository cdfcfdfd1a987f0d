package appliance

import (
	"strconv"
	"sync"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
)

var (
	famStart = metrics.Family{Name: "fabricbridge_start_time_seconds", Type: metrics.Gauge,
		Help: "When the daemon started, in seconds since the Unix epoch."}
	famReloads = metrics.Family{Name: "fabricbridge_reloads_total", Type: metrics.Counter,
		Help: "Configuration reloads by result (ok, error)."}
	famStatic = metrics.Family{Name: "fabricbridge_static_rules", Type: metrics.Gauge,
		Help: "Static listeners and rules in the configuration in force, by kind."}
	famApps = metrics.Family{Name: "fabricbridge_applications_connected", Type: metrics.Gauge,
		Help: "Applications connected to the control plane."}
	famAppClaims = metrics.Family{Name: "fabricbridge_application_claims", Type: metrics.Gauge,
		Help: "Listeners and flows each connected application holds."}
	famGeneveReceived = metrics.Family{Name: "fabricbridge_geneve_received_total", Type: metrics.Counter,
		Help: "GENEVE data packets of remote applications accepted into their streams."}
	famGeneveRefused = metrics.Family{Name: "fabricbridge_geneve_refused_total", Type: metrics.Counter,
		Help: "GENEVE datagrams refused, by reason (wrong_vni: no stream has that VNI; wrong_source: not from the stream's registered peer; malformed: not GENEVE or not IP inside; bad_credit: an impossible credit update; overflow: the peer sent beyond its credit; dead: data for a stream already broken or closing)."}
	famGeneveUnreachable = metrics.Family{Name: "fabricbridge_geneve_unreachable_total", Type: metrics.Counter,
		Help: "ICMP port unreachable received for a remote application's address; its streams broke."}
)

var (
	famRouteCache = metrics.Family{Name: "fabricbridge_route_cache_entries", Type: metrics.Gauge,
		Help: "Destinations whose next hop the bridge keeps (interfaces[].route_cache bounds them)."}
	famRouteEvictions = metrics.Family{Name: "fabricbridge_route_cache_evictions_total", Type: metrics.Counter,
		Help: "Destinations evicted from the bridge's route caches to stay within interfaces[].route_cache."}
	famRouteLookups = metrics.Family{Name: "fabricbridge_route_lookups_total", Type: metrics.Counter,
		Help: "Kernel route lookups for new destinations, by result (done; deferred: over the rate limit, the packet went through the kernel)."}
)

func collectRoutes(w *metrics.Writer, st bridge.RouteCacheStats, labels ...metrics.Label) {
	w.Add(famRouteCache, float64(st.Entries), labels...)
	w.AddUint(famRouteEvictions, st.Evicted, labels...)
	w.AddUint(famRouteLookups, st.Lookups, append(labels, metrics.Label{Name: "result", Value: "done"})...)
	w.AddUint(famRouteLookups, st.Deferred, append(labels, metrics.Label{Name: "result", Value: "deferred"})...)
}

var famControlRefused = metrics.Family{Name: "fabricbridge_control_refusals_total", Type: metrics.Counter,
	Help: "Control requests refused, by reason: the quota bound (quota_ports, quota_flows, quota_streams, quota_ring_bytes, quota_slots, quota_ids), unlisted (control.refuse_unlisted), or the error code (docs/control.md)."}

// collectControl writes the control server's refusals, every reason
// always, so that a rate is defined before the first refusal.
func collectControl(w *metrics.Writer, refused map[string]uint64) {
	for _, r := range control.RefusalReasons {
		w.AddUint(famControlRefused, refused[r], metrics.L("reason", r)...)
	}
}

var famConfigRefused = metrics.Family{Name: "fabricbridge_config_refusals_total", Type: metrics.Counter,
	Help: "Configuration files a reload refused, by reason (too_big, not_text, too_deep, syntax, documents, too_long, aliases, too_many_errors, value, unreadable)."}

// reasonCounts counts events by reason; the zero value is ready.
type reasonCounts struct {
	mu sync.Mutex
	n  map[string]uint64
}

func (c *reasonCounts) add(reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]uint64{}
	}
	c.n[reason]++
}

// collect writes one sample per reason seen, in the order of reasons.
func (c *reasonCounts) collect(w *metrics.Writer, f metrics.Family, reasons []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range reasons {
		w.AddUint(f, c.n[r], metrics.L("reason", r)...)
	}
}

// configReasons are the values of config.Reason.
var configReasons = []string{config.ReasonTooBig, config.ReasonNotText, config.ReasonTooDeep, config.ReasonSyntax,
	config.ReasonDocuments, config.ReasonTooLong, config.ReasonAliasBomb, config.ReasonTooMany, config.ReasonValue, config.ReasonUnreadable}

// collectGeneve writes the counters of the remote transport's endpoint:
// refusals above all, which show a misconfigured or hostile peer.
func collectGeneve(w *metrics.Writer, c fabric.RemoteCounters) {
	w.AddUint(famGeneveReceived, c.Received)
	for _, r := range []struct {
		reason string
		n      uint64
	}{
		{"wrong_vni", c.WrongVNI}, {"wrong_source", c.WrongSource}, {"malformed", c.Malformed},
		{"bad_credit", c.BadCredits}, {"overflow", c.Overflow}, {"dead", c.Dead},
	} {
		w.AddUint(famGeneveRefused, r.n, metrics.L("reason", r.reason)...)
	}
	w.AddUint(famGeneveUnreachable, c.Unreachable)
}

// collect writes every metric of the daemon for one scrape.
func (d *Daemon) collect(w *metrics.Writer) {
	w.Add(famStart, float64(d.started.UnixNano())/1e9)
	w.AddUint(famReloads, d.reloadsOK.Load(), metrics.L("result", "ok")...)
	w.AddUint(famReloads, d.reloadsKO.Load(), metrics.L("result", "error")...)
	d.refused.collect(w, famConfigRefused, configReasons)
	cfg := d.Config()
	w.Add(famStatic, float64(len(cfg.Listeners)), metrics.L("kind", "listener")...)
	w.Add(famStatic, float64(len(cfg.Rules)), metrics.L("kind", "rule")...)
	apps := d.Apps()
	w.Add(famApps, float64(len(apps)))
	d.collectAnnounce(w)
	if d.server != nil {
		collectControl(w, d.server.Refusals())
		collectGroups(w, d.server.Groups(), d.server.DrainStats())
	}
	byStream := map[uint32]string{}
	for _, a := range apps {
		byStream[a.Stream] = a.Name
		s := strconv.FormatUint(uint64(a.Stream), 10)
		w.Add(famAppClaims, float64(a.Listeners), metrics.L("app", a.Name, "stream", s, "kind", "listener")...)
		w.Add(famAppClaims, float64(a.Flows), metrics.L("app", a.Name, "stream", s, "kind", "flow")...)
		if a.Instance != "" {
			w.Add(famAppInstance, 1, metrics.L("app", a.Name, "stream", s, "instance", a.Instance)...)
		}
	}
	names := cfg.RuleNames()
	d.plane.Collect(w, func(id uint32) string {
		if n, ok := names[id]; ok {
			return n
		}
		return "application claim"
	}, byStream)
	d.ingest.Collect(w)
	if d.remote != nil {
		collectGeneve(w, d.remote.Counters())
	}
}
