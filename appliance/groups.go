package appliance

import (
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/control"
)

// Instance groups for the operator: the listeners that several instances
// of one application share (docs/scale-out.md), as metrics, as
// GET /v1/groups, and POST /drain?app=&instance= on the admin socket to
// retire one instance without stopping it.

var (
	famSpreadInstances = metrics.Family{Name: "fabricbridge_spread_instances", Type: metrics.Gauge,
		Help: "Instances that take new connections on a listener that several instances of one application share."}
	famSpreadDraining = metrics.Family{Name: "fabricbridge_spread_draining", Type: metrics.Gauge,
		Help: "Instances that drain from a shared listener: they keep their established connections and take no new ones."}
	famSpreadInfo = metrics.Family{Name: "fabricbridge_spread_info", Type: metrics.Gauge,
		Help: "Always 1; digest identifies the shared listener's table (the spread seed and the instances taking new connections): boxes that show the same digest send each new connection to the same instance."}
	famDrainsStarted = metrics.Family{Name: "fabricbridge_spread_drains_started_total", Type: metrics.Counter,
		Help: "Instances that began to drain from a shared listener (their own request, the operator's or the release of the listener)."}
	famDrainsExpired = metrics.Family{Name: "fabricbridge_spread_drains_expired_total", Type: metrics.Counter,
		Help: "Drains ended by spread.drain_deadline rather than by the instance going away."}
	famAppInstance = metrics.Family{Name: "fabricbridge_application_instance", Type: metrics.Gauge,
		Help: "Always 1; the instance name an application registered with, for applications that registered as one instance of several."}
)

// listenerName is a shared listener's "listener" label and API field:
// protocol/address:port, "*" for every address.
func listenerName(g control.GroupInfo) string {
	local := "*:" + strconv.Itoa(int(g.Port))
	if g.Addr.IsValid() {
		local = netip.AddrPortFrom(g.Addr, g.Port).String()
	}
	return g.Proto.String() + "/" + local
}

// collectGroups writes one series of each spread family per shared
// listener, so that the series stay as many as the groups, and the drain
// counters always, so that a rate is defined before the first drain.
func collectGroups(w *metrics.Writer, groups []control.GroupInfo, drains control.DrainStats) {
	for _, g := range groups {
		l := metrics.L("app", g.App, "listener", listenerName(g))
		w.Add(famSpreadInstances, float64(len(g.Instances)), l...)
		w.Add(famSpreadDraining, float64(len(g.Draining)), l...)
		w.Add(famSpreadInfo, 1, append(l, metrics.Label{Name: "digest", Value: g.Digest})...)
	}
	w.AddUint(famDrainsStarted, drains.Started)
	w.AddUint(famDrainsExpired, drains.Expired)
}

// GroupsResponse is GET /v1/groups.
type GroupsResponse struct {
	// Groups are the listeners that several instances of one application
	// share, by application, port, protocol and address.
	Groups []Group `json:"groups"`
	// DrainsStarted and DrainsExpired count drains since the daemon
	// started, as fabricbridge_spread_drains_*_total do.
	DrainsStarted uint64 `json:"drains_started"`
	DrainsExpired uint64 `json:"drains_expired"`
}

// Group is one shared listener.
type Group struct {
	App string `json:"app"`
	// Listener is protocol/address:port, "*" for every address: the
	// "listener" label of fabricbridge_spread_*.
	Listener string `json:"listener"`
	// Instances take new connections; Draining keep only their established
	// ones until they end or spread.drain_deadline passes. Both sorted.
	Instances []string `json:"instances"`
	Draining  []string `json:"draining"`
	// Digest identifies the table that spreads new connections: a hash of
	// spread.seed and Instances. Boxes that show the same digest for a
	// listener send each new connection to the same instance.
	Digest string `json:"digest"`
}

func (d *Daemon) serveGroups(w http.ResponseWriter, r *http.Request) {
	resp := GroupsResponse{Groups: []Group{}}
	if d.server != nil {
		for _, g := range d.server.Groups() {
			resp.Groups = append(resp.Groups, Group{App: g.App, Listener: listenerName(g),
				Instances: nonNil(g.Instances), Draining: nonNil(g.Draining), Digest: g.Digest})
		}
		st := d.server.DrainStats()
		resp.DrainsStarted, resp.DrainsExpired = st.Started, st.Expired
	}
	writeJSON(w, resp)
}

// nonNil makes an empty list [] rather than null in JSON.
func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// drainInstance is POST /drain?app=A&instance=I: instance I of application
// A takes no new connections on the listeners it shares and keeps its
// established ones until they end or spread.drain_deadline passes. The box
// goes on announcing; only that instance retires.
func (d *Daemon) drainInstance(w http.ResponseWriter, app, instance string) {
	if app == "" || instance == "" {
		http.Error(w, "drain: an instance drain needs both app and instance", http.StatusBadRequest)
		return
	}
	if d.server == nil {
		http.Error(w, "drain: the control plane is off; no instance is registered", http.StatusConflict)
		return
	}
	err := d.server.Drain(app, instance)
	switch {
	case errors.Is(err, control.ErrNotRegistered):
		http.Error(w, "drain: "+d.unknownInstance(app, instance), http.StatusNotFound)
		return
	case err != nil:
		http.Error(w, "drain: "+err.Error(), http.StatusInternalServerError)
		return
	}
	deadline := time.Duration(d.Config().Spread.DrainDeadline)
	d.log.Info("instance drained by the operator", "app", app, "instance", instance, "deadline", deadline)
	fmt.Fprintf(w, "draining: instance %s of %s takes no new connections; its established ones stay until they end or %v passes\n",
		instance, app, deadline)
}

// unknownInstance says that app has no instance named instance, and which
// it has.
func (d *Daemon) unknownInstance(app, instance string) string {
	var have []string
	for _, a := range d.Apps() {
		if a.Name == app && a.Instance != "" {
			have = append(have, a.Instance)
		}
	}
	if len(have) == 0 {
		return fmt.Sprintf("application %q has no instance registered", app)
	}
	return fmt.Sprintf("application %q has no instance %q; registered: %s", app, instance, strings.Join(have, ", "))
}
