package appliance

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/control"
)

// The read-only API: JSON views of the daemon's state under /v1/, served
// on the admin socket and on the metrics address. docs/api.md is its
// reference; the types below are its schema.
//
// Counters come from one collection of the daemon's metrics, the one
// /metrics serves, so the API and Prometheus never disagree and the API
// reaches no further into the data plane than the metrics do.

// AppsResponse is GET /v1/apps.
type AppsResponse struct {
	// Apps are the applications connected to the control plane, by stream.
	Apps []App `json:"apps"`
}

// App is one connected application.
type App struct {
	// Name is the name it registered under.
	Name string `json:"name"`
	// Instance is the name it registered under among the instances of its
	// application (docs/scale-out.md); absent for a sole process.
	Instance string `json:"instance,omitempty"`
	// Stream is its stream id: the id the classifier steers its packets
	// with, and the "stream" label of its metrics.
	Stream uint32 `json:"stream"`
	// Listeners and Flows count what it claimed over the control plane
	// (configured listeners it holds by name are not among them).
	Listeners int `json:"listeners"`
	Flows     int `json:"flows"`
	// Ports are every port its stream owns, configured ones included: a
	// packet it sends from any other source port is rejected.
	Ports []Port `json:"ports"`
}

// Port is a protocol and port number.
type Port struct {
	// Protocol is "tcp" or "udp".
	Protocol string `json:"protocol"`
	Port     uint16 `json:"port"`
}

// FlowsResponse is GET /v1/flows, one page of the claims applications hold.
type FlowsResponse struct {
	// Flows are in the order of (stream, id).
	Flows []Flow `json:"flows"`
	// Next, when not empty, is the ?after= value that gets the next page;
	// it is empty on the last page.
	Next string `json:"next,omitempty"`
}

// Flow is one listener or connection an application claimed.
type Flow struct {
	App    string `json:"app"`
	Stream uint32 `json:"stream"`
	// ID is the claim's id within the application's control session.
	ID uint64 `json:"id"`
	// Kind is "listener" (every packet to Local) or "flow" (one
	// connection: packets from Remote to Local).
	Kind string `json:"kind"`
	// Protocol is "tcp" or "udp".
	Protocol string `json:"protocol"`
	// Local is address:port; a listener on every address has "*:port".
	Local string `json:"local"`
	// Remote is the peer's address:port; flows only.
	Remote string `json:"remote,omitempty"`
	// Rule is a listener's counter id, the "id" label of
	// fabricbridge_rule_packets_total; listeners only.
	Rule uint32 `json:"rule,omitempty"`
}

// RulesResponse is GET /v1/rules.
type RulesResponse struct {
	// Rules are the configured listeners and rules in force (a reload
	// changes them), listeners first, each in configuration order.
	Rules []Rule `json:"rules"`
}

// Rule is one configured listener or rule with its counters.
type Rule struct {
	// ID names its counters (the "id" label); Name is as configured, or
	// "listener N" / "rule N" when the configuration gives none.
	ID   uint32 `json:"id"`
	Name string `json:"name"`
	// Kind is "listener" or "rule".
	Kind string `json:"kind"`
	// Priority orders rules, lower first (ties by id); 0 for listeners.
	Priority uint32 `json:"priority"`
	// Match says what the entry matches; unset fields match anything.
	Match Match `json:"match"`
	// Action is "steer", "ingest", "pass" or "drop"; listeners steer.
	Action string `json:"action"`
	// App is the application a listener or steer rule delivers to;
	// Ingest the ring an ingest rule fills.
	App    string `json:"app,omitempty"`
	Ingest string `json:"ingest,omitempty"`
	// Packets and Bytes are what the classifier matched with this entry
	// since the daemon started, on the configured interface.
	Packets uint64 `json:"packets"`
	Bytes   uint64 `json:"bytes"`
}

// Match is the header fields a rule matches.
type Match struct {
	// VLAN is the 802.1Q id; 0 matches any.
	VLAN uint16 `json:"vlan,omitempty"`
	// IP is 4 or 6; 0 matches both.
	IP uint8 `json:"ip,omitempty"`
	// Protocol is "tcp", "udp" or "any".
	Protocol string `json:"protocol"`
	// Src and Dst are prefixes; empty matches any address.
	Src string `json:"src,omitempty"`
	Dst string `json:"dst,omitempty"`
	// SrcPort and DstPort are "N" or "LO-HI"; empty matches any port.
	SrcPort string `json:"src_port,omitempty"`
	DstPort string `json:"dst_port,omitempty"`
}

// StreamsResponse is GET /v1/streams.
type StreamsResponse struct {
	// Streams are the application streams the bridge serves, by id.
	Streams []Stream `json:"streams"`
}

// Stream is one application stream's counters, as
// fabricbridge_stream_* exports them.
type Stream struct {
	ID uint32 `json:"id"`
	// App is the connected application's name; empty while none holds it.
	App string `json:"app"`
	// Interface is the interface the stream's packets come in on.
	Interface string `json:"interface"`
	// RxPackets and RxBytes were delivered into the stream.
	RxPackets uint64 `json:"rx_packets"`
	RxBytes   uint64 `json:"rx_bytes"`
	// RxDrops are packets for the stream that were dropped, by reason
	// (ring_full: the application did not keep up).
	RxDrops map[string]uint64 `json:"rx_drops"`
	// TxPackets and TxBytes went from the stream to the wire.
	TxPackets uint64 `json:"tx_packets"`
	TxBytes   uint64 `json:"tx_bytes"`
	// TxRejects are packets the stream sent that failed verification, by
	// reason (source_addr, source_port, protocol, mtu, ...).
	TxRejects map[string]uint64 `json:"tx_rejects"`
	// Health is "normal", "sick" (dropped in the last second) or "broken"
	// (the application is gone).
	Health string `json:"health"`
}

// IngestResponse is GET /v1/ingest.
type IngestResponse struct {
	// Rings are the configured ingest rings, in configuration order;
	// empty when the configuration has none.
	Rings []IngestRing `json:"rings"`
	// Engine counts the frames the ingest engine handled, by outcome
	// (received, appended, dropped, no_ring, malformed, refused,
	// kernel_drop); absent without rings.
	Engine map[string]uint64 `json:"engine,omitempty"`
}

// IngestRing is one ingest ring: its configuration and counters.
type IngestRing struct {
	Name string `json:"name"`
	// BufferID is the id ingest rules fill it by (the "buffer_id" label).
	BufferID uint32 `json:"buffer_id"`
	// Socket is where a consumer opens it.
	Socket string `json:"socket"`
	// Buffers of BufferSize bytes each; a buffer holding records is
	// published at the latest WindowSeconds after its first one.
	Buffers       int     `json:"buffers"`
	BufferSize    int64   `json:"buffer_size"`
	WindowSeconds float64 `json:"window_seconds"`
	// LatencyBudgetSeconds is the configured wire-to-consumer budget
	// (consumers measure against it; the daemon cannot see it kept).
	LatencyBudgetSeconds float64 `json:"latency_budget_seconds"`
	// Records and Bytes (payload) were written into the ring; Published
	// counts buffers handed to the consumer.
	Records   uint64 `json:"records"`
	Bytes     uint64 `json:"bytes"`
	Published uint64 `json:"published"`
	// Drops are datagrams the ring dropped, by reason (no_buffer: the
	// consumer holds every buffer; too_big; source_full).
	Drops map[string]uint64 `json:"drops"`
	// Sources is how many distinct senders the ring has seen.
	Sources int `json:"sources"`
	// ConsumerAttached is true while a consumer has the ring open.
	ConsumerAttached bool `json:"consumer_attached"`
}

// Flow pages are bounded so that a box with a million flows answers each
// request in bounded time and memory.
const (
	defaultFlowPage = 100
	maxFlowPage     = 1000
)

// routeReadOnly adds what the metrics address serves to mux: /metrics,
// the health probes and the read-only API. Nothing here changes state, so
// it is safe on an address the network reaches.
func (d *Daemon) routeReadOnly(mux *http.ServeMux) {
	mux.Handle("/metrics", metrics.Handler(d.collectServing))
	mux.HandleFunc("GET /healthz", d.serveHealthz)
	mux.HandleFunc("GET /readyz", d.serveReadyz)
	mux.HandleFunc("GET /v1/apps", d.serveApps)
	mux.HandleFunc("GET /v1/flows", d.serveFlows)
	mux.HandleFunc("GET /v1/groups", d.serveGroups)
	mux.HandleFunc("GET /v1/rules", d.sampled(d.rulesView))
	mux.HandleFunc("GET /v1/streams", d.sampled(d.streamsView))
	mux.HandleFunc("GET /v1/ingest", d.sampled(d.ingestView))
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// sampled serves what view makes of one collection of the daemon's
// metrics.
func (d *Daemon) sampled(view func([]metrics.Sample) any) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s, err := d.samples()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		writeJSON(w, view(s))
	}
}

// samples is one collection of the daemon's metrics, read back.
func (d *Daemon) samples() ([]metrics.Sample, error) {
	w := metrics.NewWriter()
	d.collect(w)
	var b bytes.Buffer
	if _, err := w.WriteTo(&b); err != nil {
		return nil, err
	}
	return metrics.Parse(&b)
}

func (d *Daemon) serveApps(w http.ResponseWriter, r *http.Request) {
	resp := AppsResponse{Apps: []App{}}
	for _, a := range d.Apps() {
		app := App{Name: a.Name, Instance: a.Instance, Stream: a.Stream, Listeners: a.Listeners, Flows: a.Flows, Ports: []Port{}}
		for _, p := range a.Ports {
			app.Ports = append(app.Ports, Port{Protocol: p.Proto.String(), Port: p.Port})
		}
		resp.Apps = append(resp.Apps, app)
	}
	writeJSON(w, resp)
}

// flowCursor is the ?after= token: "stream.id" of the last claim given.
func parseFlowCursor(s string) (control.ClaimCursor, error) {
	if s == "" {
		return control.ClaimCursor{}, nil
	}
	st, id, ok := strings.Cut(s, ".")
	stream, err1 := strconv.ParseUint(st, 10, 32)
	n, err2 := strconv.ParseUint(id, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return control.ClaimCursor{}, fmt.Errorf("after=%q is not a token from a previous page's next", s)
	}
	return control.ClaimCursor{Stream: uint32(stream), ID: n}, nil
}

func (d *Daemon) serveFlows(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := defaultFlowPage
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxFlowPage {
			http.Error(w, fmt.Sprintf("limit=%q: want 1 to %d", v, maxFlowPage), http.StatusBadRequest)
			return
		}
		limit = n
	}
	after, err := parseFlowCursor(q.Get("after"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	resp := FlowsResponse{Flows: []Flow{}}
	if d.server == nil {
		writeJSON(w, resp)
		return
	}
	page, more := d.server.Claims(q.Get("app"), after, limit)
	for _, c := range page {
		f := Flow{App: c.App, Stream: c.Stream, ID: c.ID, Kind: "flow", Protocol: c.Proto.String(), Local: c.Local.String()}
		if c.Listener {
			f.Kind, f.Rule = "listener", c.RuleID
			if !c.Local.Addr().IsValid() {
				f.Local = fmt.Sprintf("*:%d", c.Local.Port())
			}
		} else {
			f.Remote = c.Remote.String()
		}
		resp.Flows = append(resp.Flows, f)
	}
	if more {
		last := page[len(page)-1]
		resp.Next = fmt.Sprintf("%d.%d", last.Stream, last.ID)
	}
	writeJSON(w, resp)
}

func portRange(r config.PortRange) string {
	if !r.IsSet() {
		return ""
	}
	return r.String()
}

func prefix(p config.Prefix) string {
	if !p.IsValid() {
		return ""
	}
	return p.String()
}

func (d *Daemon) rulesView(s []metrics.Sample) any {
	cfg := d.Config()
	names := cfg.RuleNames()
	resp := RulesResponse{Rules: []Rule{}}
	add := func(x Rule) {
		id := strconv.FormatUint(uint64(x.ID), 10)
		x.Name = names[x.ID]
		x.Packets = sum(metrics.Find(s, famRulePackets.Name, metrics.L("id", id)...))
		x.Bytes = sum(metrics.Find(s, famRuleBytes.Name, metrics.L("id", id)...))
		resp.Rules = append(resp.Rules, x)
	}
	for _, l := range cfg.Listeners {
		m := Match{Protocol: l.Protocol.String(), DstPort: strconv.Itoa(int(l.Port))}
		if l.Address.IsValid() {
			m.Dst = l.Address.String()
		}
		add(Rule{ID: l.ID, Kind: "listener", Match: m, Action: "steer", App: l.App})
	}
	for _, x := range cfg.Rules {
		m := Match{VLAN: x.Match.VLAN, IP: uint8(x.Match.IP), Protocol: x.Match.Protocol.String(),
			Src: prefix(x.Match.Src), Dst: prefix(x.Match.Dst), SrcPort: portRange(x.Match.SrcPort), DstPort: portRange(x.Match.DstPort)}
		add(Rule{ID: x.ID, Kind: "rule", Priority: x.Priority, Match: m, Action: x.Action.String(), App: x.App, Ingest: x.Ingest})
	}
	return resp
}

// sum adds samples up: counters the metrics split by a label the API does
// not (the interface, today only ever one).
func sum(s []metrics.Sample) uint64 {
	var n uint64
	for _, x := range s {
		n += uint64(x.Value)
	}
	return n
}

func (d *Daemon) streamsView(s []metrics.Sample) any {
	byID := map[uint32]*Stream{}
	for _, x := range s {
		if !strings.HasPrefix(x.Name, "fabricbridge_stream_") {
			continue
		}
		id, err := strconv.ParseUint(x.Label("stream"), 10, 32)
		if err != nil {
			continue
		}
		st := byID[uint32(id)]
		if st == nil {
			st = &Stream{ID: uint32(id), App: x.Label("app"), Interface: x.Label("interface"),
				RxDrops: map[string]uint64{}, TxRejects: map[string]uint64{}}
			byID[uint32(id)] = st
		}
		v := uint64(x.Value)
		switch x.Name {
		case famStreamRx.Name:
			st.RxPackets += v
		case famStreamRxBytes.Name:
			st.RxBytes += v
		case famStreamRxDrops.Name:
			st.RxDrops[x.Label("reason")] += v
		case famStreamTx.Name:
			st.TxPackets += v
		case famStreamTxBytes.Name:
			st.TxBytes += v
		case famStreamTxRejects.Name:
			st.TxRejects[x.Label("reason")] += v
		case famStreamHealth.Name:
			if x.Value == 1 {
				st.Health = x.Label("state")
			}
		}
	}
	resp := StreamsResponse{Streams: []Stream{}}
	for _, id := range sortedKeys(byID) {
		resp.Streams = append(resp.Streams, *byID[id])
	}
	return resp
}

func (d *Daemon) ingestView(s []metrics.Sample) any {
	cfg := d.Config()
	resp := IngestResponse{Rings: []IngestRing{}}
	for _, g := range cfg.Ingest {
		ring := metrics.L("ring", g.Name)
		one := func(f metrics.Family, more ...metrics.Label) uint64 {
			return sum(metrics.Find(s, f.Name, append(ring, more...)...))
		}
		x := IngestRing{Name: g.Name, BufferID: cfg.IngestID(g.Name), Socket: IngestPath(cfg, g.Name),
			Buffers: g.Buffers, BufferSize: int64(g.BufferSize),
			WindowSeconds:        time.Duration(g.Window).Seconds(),
			LatencyBudgetSeconds: time.Duration(g.LatencyBudget).Seconds(),
			Records:              one(famIngestRecords), Bytes: one(famIngestBytes), Published: one(famIngestPublished),
			Drops:            map[string]uint64{},
			Sources:          int(one(famIngestSources)),
			ConsumerAttached: one(famIngestConsumer) == 1,
		}
		for _, dr := range metrics.Find(s, famIngestDrops.Name, ring...) {
			x.Drops[dr.Label("reason")] += uint64(dr.Value)
		}
		resp.Rings = append(resp.Rings, x)
	}
	if len(cfg.Ingest) > 0 {
		resp.Engine = map[string]uint64{}
		for _, e := range metrics.Find(s, famEngine.Name) {
			resp.Engine[e.Label("outcome")] += uint64(e.Value)
		}
	}
	return resp
}
