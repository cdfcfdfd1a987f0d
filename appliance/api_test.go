package appliance

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/deploy"
	fingest "github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// apiClients are HTTP clients for the two places the API is served: the
// admin socket and the metrics address (in the bridge's namespace).
func apiClients(t *testing.T, tp *topo, d *Daemon) map[string]*http.Client {
	t.Helper()
	admin := d.Config().Control.AdminSocket
	unixTr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", admin)
	}}
	tcpTr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (conn net.Conn, err error) {
		err = tp.bridge.Do(func() (err error) {
			conn, err = (&net.Dialer{}).DialContext(ctx, "tcp", d.MetricsAddr().String())
			return err
		})
		return conn, err
	}}
	t.Cleanup(unixTr.CloseIdleConnections)
	t.Cleanup(tcpTr.CloseIdleConnections)
	return map[string]*http.Client{
		"admin":   {Transport: unixTr, Timeout: 5 * time.Second},
		"metrics": {Transport: tcpTr, Timeout: 5 * time.Second},
	}
}

// get fetches path and returns the status and body.
func get(t *testing.T, c *http.Client, method, path string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://fabricbridge"+path, nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// getJSON fetches path and decodes it into v, refusing unknown fields:
// what the daemon sends must be what the documented types say.
func getJSON(t *testing.T, c *http.Client, path string, v any) {
	t.Helper()
	code, body := get(t, c, "GET", path)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", path, code, body)
	}
	dec := json.NewDecoder(strings.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("GET %s: %v\n%s", path, err, body)
	}
}

// busyDaemon is a daemon with something in every part the API and the
// metrics show: a connected application with a listener and five flows, a
// configured listener, a drop rule, an ingest rule and ring with a
// consumer, and traffic counted by each.
type busyDaemon struct {
	tp       *topo
	d        *Daemon
	reg      control.Registration
	listener control.Claim
	flows    []control.Claim
}

func startBusyDaemon(t *testing.T) *busyDaemon {
	t.Helper()
	tp := newTopo(t)
	c := tp.config(t, `ingest:
  - {name: trigger, buffers: 16, buffer_size: 64K, window: 1ms}
listeners:
  - {id: 4, name: web, protocol: tcp, port: 8080, app: raw}
applications: [{name: raw}]
rules:
  - {id: 3, name: blocked, match: {protocol: udp, dst_port: 6666}, action: drop}
  - {id: 2, priority: 5, match: {ip: 4, protocol: udp, src: 198.18.0.0/15, dst_port: 9000-9003}, action: ingest, ingest: trigger}
`)
	b := &busyDaemon{tp: tp, d: tp.start(t, c, io.Discard)}
	t.Cleanup(func() { b.d.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := control.DialLocal(ctx, c.Control.Socket, "raw")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	reg, stream, err := cl.RegisterLocal(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stream.Close() })
	b.reg = reg
	local := tp.v.A.Addr4.Addr()
	if b.listener, err = cl.Listen(ctx, "udp", local, 5000); err != nil {
		t.Fatal(err)
	}
	// Five flows, so that pages of two take three requests.
	for i := range 5 {
		f, err := cl.Connect(ctx, "tcp", local, netip.AddrPortFrom(tp.v.B.Addr4.Addr(), uint16(7000+i)))
		if err != nil {
			t.Fatal(err)
		}
		b.flows = append(b.flows, f)
	}
	cons, err := fingest.Open(IngestPath(c, "trigger"), fingest.ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cons.Close() })

	if _, err := tp.outside.Ping(local, 1, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	tp.sendUDP(t, 5000, 7)
	tp.sendUDP(t, 6666, 11)
	tp.sendUDP(t, 9001, 13)
	// The ingest ring publishes within its window, the stream at once.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		s, _ := b.d.samples()
		if value(t, s, "fabricbridge_ingest_records_total", "ring", "trigger") == 13 &&
			value(t, s, "fabricbridge_stream_rx_packets_total", "stream", fmt.Sprint(reg.Stream)) == 7 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return b
}

// TestReadOnlyAPI decodes every endpoint of a busy daemon on both
// addresses against the daemon's own state and the traffic sent. Then it
// takes the control plane away and sees readiness go.
func TestReadOnlyAPI(t *testing.T) {
	b := startBusyDaemon(t)
	tp, d, reg, c := b.tp, b.d, b.reg, b.d.Config()
	local := tp.v.A.Addr4.Addr()
	for where, hc := range apiClients(t, tp, d) {
		t.Run(where, func(t *testing.T) {
			if code, body := get(t, hc, "GET", "/healthz"); code != 200 || body != "ok\n" {
				t.Errorf("/healthz: %d %q", code, body)
			}
			if code, body := get(t, hc, "GET", "/readyz"); code != 200 || !strings.HasPrefix(body, "ready: data path ") {
				t.Errorf("/readyz: %d %q", code, body)
			}

			var apps AppsResponse
			getJSON(t, hc, "/v1/apps", &apps)
			want := AppsResponse{}
			for _, a := range d.Apps() {
				x := App{Name: a.Name, Stream: a.Stream, Listeners: a.Listeners, Flows: a.Flows}
				for _, p := range a.Ports {
					x.Ports = append(x.Ports, Port{p.Proto.String(), p.Port})
				}
				want.Apps = append(want.Apps, x)
			}
			if !reflect.DeepEqual(apps, want) || len(apps.Apps) != 1 || apps.Apps[0].Name != "raw" || apps.Apps[0].Flows != 5 || apps.Apps[0].Listeners != 1 {
				t.Errorf("/v1/apps:\n got %+v\nwant %+v", apps, want)
			}

			// Every claim exactly once across pages, in (stream, id) order.
			var got []Flow
			path := "/v1/flows?limit=2&app=raw"
			for pages := 0; ; pages++ {
				if pages > 3 {
					t.Fatalf("more than 3 pages of 2 for 6 claims")
				}
				var page FlowsResponse
				getJSON(t, hc, path, &page)
				if len(page.Flows) > 2 {
					t.Fatalf("page of %d, limit 2", len(page.Flows))
				}
				got = append(got, page.Flows...)
				if page.Next == "" {
					break
				}
				path = "/v1/flows?limit=2&app=raw&after=" + page.Next
			}
			wantFlows := []Flow{{App: "raw", Stream: reg.Stream, ID: b.listener.ID, Kind: "listener", Protocol: "udp",
				Local: netip.AddrPortFrom(local, 5000).String(), Rule: got[0].Rule}}
			for i, f := range b.flows {
				wantFlows = append(wantFlows, Flow{App: "raw", Stream: reg.Stream, ID: f.ID, Kind: "flow", Protocol: "tcp",
					Local:  netip.AddrPortFrom(f.Addr, f.Port).String(),
					Remote: netip.AddrPortFrom(tp.v.B.Addr4.Addr(), uint16(7000+i)).String()})
			}
			if !reflect.DeepEqual(got, wantFlows) || got[0].Rule == 0 {
				t.Errorf("/v1/flows:\n got %+v\nwant %+v", got, wantFlows)
			}
			var none FlowsResponse
			getJSON(t, hc, "/v1/flows?app=nobody", &none)
			if len(none.Flows) != 0 || none.Next != "" {
				t.Errorf("/v1/flows?app=nobody: %+v", none)
			}
			for _, bad := range []string{"limit=0", "limit=1001", "limit=x", "after=3", "after=a.b"} {
				if code, _ := get(t, hc, "GET", "/v1/flows?"+bad); code != http.StatusBadRequest {
					t.Errorf("/v1/flows?%s: %d, want 400", bad, code)
				}
			}

			var rules RulesResponse
			getJSON(t, hc, "/v1/rules", &rules)
			if len(rules.Rules) != 3 {
				t.Fatalf("/v1/rules: %+v", rules)
			}
			wantRules := []Rule{
				{ID: 4, Name: "web", Kind: "listener", Match: Match{Protocol: "tcp", DstPort: "8080"}, Action: "steer", App: "raw"},
				{ID: 3, Name: "blocked", Kind: "rule", Match: Match{Protocol: "udp", DstPort: "6666"}, Action: "drop", Packets: 11, Bytes: rules.Rules[1].Bytes},
				{ID: 2, Name: "rule 2", Kind: "rule", Priority: 5, Match: Match{IP: 4, Protocol: "udp", Src: "198.18.0.0/15", DstPort: "9000-9003"},
					Action: "ingest", Ingest: "trigger", Packets: 13, Bytes: rules.Rules[2].Bytes},
			}
			if !reflect.DeepEqual(rules.Rules, wantRules) || rules.Rules[1].Bytes < 11*17 {
				t.Errorf("/v1/rules:\n got %+v\nwant %+v", rules.Rules, wantRules)
			}

			var streams StreamsResponse
			getJSON(t, hc, "/v1/streams", &streams)
			if len(streams.Streams) != 1 {
				t.Fatalf("/v1/streams: %+v", streams)
			}
			st := streams.Streams[0]
			if st.ID != reg.Stream || st.App != "raw" || st.Interface != tp.v.A.Name || st.RxPackets != 7 || st.RxBytes < 7*17 ||
				st.Health != "normal" || st.RxDrops["ring_full"] != 0 || len(st.TxRejects) == 0 || st.TxPackets != 0 {
				t.Errorf("/v1/streams: %+v", st)
			}

			var ing IngestResponse
			getJSON(t, hc, "/v1/ingest", &ing)
			if len(ing.Rings) != 1 {
				t.Fatalf("/v1/ingest: %+v", ing)
			}
			if r := ing.Rings[0]; r.Name != "trigger" || r.BufferID != 1 || r.Socket != IngestPath(c, "trigger") ||
				r.Buffers != 16 || r.BufferSize != 64<<10 || r.WindowSeconds != 0.001 || r.LatencyBudgetSeconds <= 0 ||
				r.Records != 13 || r.Bytes != 13*17 || r.Published == 0 || r.Sources != 1 || !r.ConsumerAttached ||
				r.Drops["no_buffer"] != 0 || len(r.Drops) != 3 || ing.Engine["appended"] != 13 {
				t.Errorf("/v1/ingest: %+v", ing)
			}

			if code, _ := get(t, hc, "POST", "/v1/apps"); code != http.StatusMethodNotAllowed {
				t.Errorf("POST /v1/apps: %d, want 405", code)
			}
		})
	}
	// Captures are packets, the applications' data: never on the network.
	hc := apiClients(t, tp, d)
	if code, _ := get(t, hc["metrics"], "GET", "/capture?stream=raw"); code != http.StatusNotFound {
		t.Errorf("/capture on the metrics address: %d, want 404", code)
	}
	if code, body := get(t, hc["admin"], "GET", "/capture?stream=nobody"); code != http.StatusNotFound || !strings.Contains(body, "no stream") {
		t.Errorf("/capture on the admin socket: %d %q", code, body)
	}
	s := tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_ready"); v != 1 {
		t.Errorf("fabricbridge_ready %v while ready", v)
	}

	// Without its control listener the box cannot take applications: not
	// ready, and not alive either, since the loop is gone for good.
	d.unixLn.Close()
	for !strings.Contains(fmt.Sprint(d.live.failures()), "unix") {
		time.Sleep(10 * time.Millisecond)
	}
	code, body := get(t, hc["metrics"], "GET", "/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "control plane not listening on unix") {
		t.Errorf("/readyz without the control listener: %d %q", code, body)
	}
	if code, body := get(t, hc["admin"], "GET", "/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "control listener unix ended") {
		t.Errorf("/healthz without the control listener: %d %q", code, body)
	}
	s = tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_ready"); v != 0 {
		t.Errorf("fabricbridge_ready %v while not ready", v)
	}
}

// TestDeployMetricsExported: every metric that deploy's Grafana dashboard
// and Prometheus alerting rules name is exported by a running daemon.
func TestDeployMetricsExported(t *testing.T) {
	b := startBusyDaemon(t)
	exported := map[string]bool{}
	for _, s := range b.tp.scrape(t, b.d) {
		exported[s.Name] = true
	}
	names, err := deploy.MetricNames()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range slices.Sorted(maps.Keys(names)) {
		if !exported[n] {
			t.Errorf("%s names %s, which the daemon does not export", names[n], n)
		}
	}
}

// TestHealthzCatchesAWedgedDaemon: a collection that never returns makes
// /healthz fail within the probe timeout, and further probes start no
// further collections.
func TestHealthzCatchesAWedgedDaemon(t *testing.T) {
	var l liveness
	block := make(chan struct{})
	defer close(block)
	var calls atomic.Int32
	wedged := func(*metrics.Writer) { calls.Add(1); <-block }
	start := time.Now()
	for range 2 {
		if err := l.probe(wedged); err == nil || !strings.Contains(err.Error(), "holds a lock") {
			t.Fatalf("probe of a wedged collection: %v", err)
		}
	}
	if time.Since(start) > 3*probeTimeout {
		t.Errorf("two probes took %v", time.Since(start))
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("%d collections started, want 1", n)
	}
	if err := (&liveness{}).probe(func(*metrics.Writer) {}); err != nil {
		t.Errorf("probe of a live collection: %v", err)
	}
}
