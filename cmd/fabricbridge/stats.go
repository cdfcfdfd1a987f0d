package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
)

type statsOptions struct {
	config, metrics, admin string
	interval               time.Duration
	once                   bool
}

func newStatsCommand() *cobra.Command {
	var o statsOptions
	c := &cobra.Command{
		Use:   "stats [flags]",
		Short: "Show a live table of the daemon's counters and rates",
		Long: `Shows the daemon's verdicts, rules, streams (with the instance name of each
application that registered as one), queues, ingest rings and instance groups
(the listeners that instances of one application share, with the instances
taking new connections, those draining, and the digest to compare between
boxes) as a table that refreshes like top: rates are the difference between
two scrapes of its /metrics, read from the metrics address of its
configuration, or through its admin socket when that address is off.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return showStats(c.Context(), o, c.OutOrStdout())
		},
	}
	fs := c.Flags()
	fs.StringVar(&o.config, "config", "", "read the metrics address from this configuration (default "+DefaultConfig+" if it exists)")
	fs.StringVar(&o.metrics, "metrics", "", "the daemon's metrics address host:port (overrides --config)")
	fs.StringVar(&o.admin, "admin", "", "the daemon's admin socket (overrides --config)")
	fs.DurationVar(&o.interval, "interval", time.Second, "refresh interval")
	fs.BoolVar(&o.once, "once", false, "print one table (rates over one interval) and exit")
	return c
}

// showStats shows the daemon's counters as a table that refreshes, like
// top: rates are the difference between two scrapes of /metrics.
func showStats(ctx context.Context, o statsOptions, stdout io.Writer) error {
	if o.interval <= 0 {
		return errors.New("stats: usage: fabricbridge stats [--config FILE | --metrics HOST:PORT | --admin PATH] [--interval D] [--once]")
	}
	target, sock, err := metricsTarget(o.metrics, o.admin, o.config)
	label := strings.TrimSuffix(strings.TrimPrefix(target, "http://"), "/metrics")
	if sock != "" {
		target, label = "http://fabricbridge/metrics", sock // dialled through the socket
	}
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	client := &http.Client{Timeout: 3 * time.Second}
	if sock != "" {
		client.Transport = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}
	}
	prev, err := scrape(ctx, client, target)
	if err != nil {
		if ctx.Err() != nil {
			return nil // stopped (Ctrl-C) during the first scrape
		}
		return fmt.Errorf("stats: %w", err)
	}
	clear := !o.once && isTerminal(stdout)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(o.interval):
		}
		cur, err := scrape(ctx, client, target)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("stats: %w", err)
		}
		if clear {
			io.WriteString(stdout, "\x1b[H\x1b[2J")
		}
		render(stdout, label, prev, cur)
		if o.once {
			return nil
		}
		prev = cur
	}
}

// metricsTarget is where /metrics is: --metrics, else --admin (a Unix
// socket: sock is set), else the configuration's metrics.address, or its
// admin socket when the metrics address is off.
func metricsTarget(addr, admin, path string) (url, sock string, err error) {
	if addr == "" && admin == "" {
		if path == "" {
			path = DefaultConfig
			if _, err := os.Stat(path); err != nil {
				addr = config.DefaultMetrics
			}
		}
		if addr == "" {
			c, err := config.Load(path)
			if err != nil {
				return "", "", err
			}
			addr, admin = string(c.Metrics.Address), c.Control.AdminSocket
		}
	}
	if addr == "" {
		return "", admin, nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", "", fmt.Errorf("metrics address %q: %v", addr, err)
	}
	switch host {
	case "", "0.0.0.0":
		host = "127.0.0.1"
	case "::":
		host = "::1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/metrics", "", nil
}

type snapshot struct {
	at      time.Time
	samples []metrics.Sample
	byKey   map[string]float64
	// groups are the shared listeners from /v1/groups, nil when the daemon
	// does not serve it.
	groups []appliance.Group
}

func scrape(ctx context.Context, c *http.Client, url string) (snapshot, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return snapshot{}, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return snapshot{}, fmt.Errorf("is the daemon running? %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return snapshot{}, fmt.Errorf("%s: %s", url, resp.Status)
	}
	s, err := metrics.Parse(resp.Body)
	if err != nil {
		return snapshot{}, err
	}
	snap := newSnapshot(time.Now(), s)
	if len(metrics.Find(s, "fabricbridge_spread_info")) > 0 {
		snap.groups = scrapeGroups(ctx, c, strings.TrimSuffix(url, "/metrics")+"/v1/groups")
	}
	return snap, nil
}

// scrapeGroups reads the instance names of the shared listeners, which the
// metrics only count. A daemon that does not serve them shows the counts
// alone, so any failure is nil.
func scrapeGroups(ctx context.Context, c *http.Client, url string) []appliance.Group {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var g appliance.GroupsResponse
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&g) != nil {
		return nil
	}
	return g.Groups
}

func newSnapshot(at time.Time, s []metrics.Sample) snapshot {
	snap := snapshot{at: at, samples: s, byKey: map[string]float64{}}
	for _, x := range s {
		snap.byKey[key(x.Name, x.Labels)] = x.Value
	}
	return snap
}

func key(name string, labels []metrics.Label) string {
	var b strings.Builder
	b.WriteString(name)
	for _, l := range labels {
		b.WriteString("\x00" + l.Name + "=" + l.Value)
	}
	return b.String()
}

// get returns a sample's value by name and label pairs in exposition order.
func (s snapshot) get(name string, labels ...string) float64 {
	return s.byKey[key(name, metrics.L(labels...))]
}

// rate is the per-second change of a counter between two snapshots.
func rate(prev, cur snapshot, name string, labels []metrics.Label) float64 {
	dt := cur.at.Sub(prev.at).Seconds()
	k := key(name, labels)
	if dt <= 0 {
		return 0
	}
	d := cur.byKey[k] - prev.byKey[k]
	if d < 0 { // a restarted daemon
		return 0
	}
	return d / dt
}

// sum adds the samples of one name whose labels include the given pairs.
func (s snapshot) sum(name string, labels ...string) float64 {
	var t float64
	for _, x := range metrics.Find(s.samples, name, metrics.L(labels...)...) {
		t += x.Value
	}
	return t
}

func human(v float64) string {
	switch {
	case v >= 1e9:
		return strconv.FormatFloat(v/1e9, 'f', 2, 64) + "G"
	case v >= 1e6:
		return strconv.FormatFloat(v/1e6, 'f', 2, 64) + "M"
	case v >= 1e4:
		return strconv.FormatFloat(v/1e3, 'f', 1, 64) + "k"
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func bits(bytesPerSec float64) string { return human(bytesPerSec*8) + "b/s" }

// render writes one screen; source names where the numbers come from.
func render(w io.Writer, source string, prev, cur snapshot) {
	up := time.Duration(0)
	if st := cur.get("fabricbridge_start_time_seconds"); st > 0 {
		up = cur.at.Sub(time.Unix(0, int64(st*1e9))).Round(time.Second)
	}
	fmt.Fprintf(w, "fabricbridge  %s  up %v  applications %s  reloads %s ok, %s failed  %s\n",
		source, up,
		human(cur.get("fabricbridge_applications_connected")),
		human(cur.get("fabricbridge_reloads_total", "result", "ok")), human(cur.get("fabricbridge_reloads_total", "result", "error")),
		cur.at.Format("15:04:05"))

	for _, x := range metrics.Find(cur.samples, "fabricbridge_attach_mode") {
		ifname := x.Label("interface")
		fell := metrics.Find(cur.samples, "fabricbridge_attach_fallback", metrics.Label{Name: "interface", Value: ifname})
		note := ""
		if m := x.Label("mode"); m == "generic" || m == "afpacket" {
			note = "  (slow path, as configured)"
			if len(fell) > 0 {
				note = "  FELL BACK to a slow path"
			}
		}
		fmt.Fprintf(w, "interface %s  mode %s%s\n", ifname, x.Label("mode"), note)
		for _, f := range fell {
			fmt.Fprintf(w, "  not %s: %s\n", f.Label("from"), f.Label("reason"))
		}
	}

	table(w, "VERDICT", []string{"PACKETS", "PKT/S", "BYTES", "RATE"}, rowsOf(prev, cur, "fabricbridge_xdp_verdict_packets_total", "fabricbridge_xdp_verdict_bytes_total",
		func(x metrics.Sample) string { return x.Label("interface") + " " + x.Label("verdict") }, nil))
	table(w, "RULE", []string{"PACKETS", "PKT/S", "BYTES", "RATE"}, rowsOf(prev, cur, "fabricbridge_rule_packets_total", "fabricbridge_rule_bytes_total",
		func(x metrics.Sample) string { return x.Label("id") + " " + x.Label("name") },
		func(a, b metrics.Sample) int { return cmp.Compare(atoi(a.Label("id")), atoi(b.Label("id"))) }))
	instances := map[string]string{}
	for _, x := range metrics.Find(cur.samples, "fabricbridge_application_instance") {
		instances[x.Label("stream")] = "/" + x.Label("instance")
	}
	streams := rowsOf(prev, cur, "fabricbridge_stream_rx_packets_total", "fabricbridge_stream_rx_bytes_total",
		func(x metrics.Sample) string {
			return x.Label("stream") + " " + x.Label("app") + instances[x.Label("stream")]
		},
		func(a, b metrics.Sample) int { return cmp.Compare(atoi(a.Label("stream")), atoi(b.Label("stream"))) })
	for i := range streams {
		l := streams[i].labels
		st := "?"
		for _, h := range metrics.Find(cur.samples, "fabricbridge_stream_health", metrics.Label{Name: "stream", Value: labelOf(l, "stream")}) {
			if h.Value == 1 {
				st = h.Label("state")
			}
		}
		tx := rate(prev, cur, "fabricbridge_stream_tx_packets_total", l)
		txb := rate(prev, cur, "fabricbridge_stream_tx_bytes_total", l)
		drops := cur.sum("fabricbridge_stream_rx_drops_total", "stream", labelOf(l, "stream"))
		rej := cur.sum("fabricbridge_stream_tx_rejects_total", "stream", labelOf(l, "stream"))
		streams[i].cells = []string{st, human(streams[i].pps), bits(streams[i].bps), human(tx), bits(txb), human(drops), human(rej)}
	}
	table(w, "STREAM", []string{"HEALTH", "RX PKT/S", "RX RATE", "TX PKT/S", "TX RATE", "DROPS", "REJECTS"}, streams)
	queues := rowsOf(prev, cur, "fabricbridge_queue_rx_packets_total", "fabricbridge_queue_rx_bytes_total",
		func(x metrics.Sample) string { return x.Label("interface") + " q" + x.Label("queue") }, nil)
	for i := range queues {
		l := queues[i].labels
		in, q := labelOf(l, "interface"), labelOf(l, "queue")
		tx := rate(prev, cur, "fabricbridge_queue_tx_packets_total", l)
		queues[i].cells = []string{human(queues[i].pps), bits(queues[i].bps), human(tx),
			human(cur.sum("fabricbridge_queue_rx_drops_total", "interface", in, "queue", q)),
			human(cur.get("fabricbridge_queue_fill_ring_empty_total", "interface", in, "queue", q))}
	}
	table(w, "QUEUE", []string{"RX PKT/S", "RX RATE", "TX PKT/S", "DROPS", "FILL EMPTY"}, queues)
	rings := rowsOf(prev, cur, "fabricbridge_ingest_records_total", "fabricbridge_ingest_bytes_total",
		func(x metrics.Sample) string { return x.Label("ring") }, nil)
	for i := range rings {
		r := labelOf(rings[i].labels, "ring")
		consumer := "none"
		if cur.sum("fabricbridge_ingest_consumer_attached", "ring", r) == 1 {
			consumer = "attached"
		}
		rings[i].cells = append(rings[i].cells, human(cur.sum("fabricbridge_ingest_buffers_published_total", "ring", r)),
			human(cur.sum("fabricbridge_ingest_drops_total", "ring", r)), consumer)
	}
	table(w, "INGEST", []string{"RECORDS", "REC/S", "BYTES", "RATE", "BUFFERS", "DROPS", "CONSUMER"}, rings)
	if groups := groupRows(cur); len(groups) > 0 {
		table(w, "GROUP", []string{"INSTANCES", "DRAINING", "DIGEST"}, groups)
		fmt.Fprintf(w, "drains  %s started, %s expired by the deadline\n",
			human(cur.get("fabricbridge_spread_drains_started_total")), human(cur.get("fabricbridge_spread_drains_expired_total")))
	}
}

// groupRows are the shared listeners, one row per fabricbridge_spread_info
// series: the instances by name where /v1/groups gave them, else counted.
func groupRows(cur snapshot) []row {
	named := map[string]appliance.Group{}
	for _, g := range cur.groups {
		named[g.App+" "+g.Listener] = g
	}
	var rows []row
	for _, x := range metrics.Find(cur.samples, "fabricbridge_spread_info") {
		app, listener := x.Label("app"), x.Label("listener")
		name := app + " " + listener
		in := human(cur.get("fabricbridge_spread_instances", "app", app, "listener", listener))
		out := human(cur.get("fabricbridge_spread_draining", "app", app, "listener", listener))
		if g, ok := named[name]; ok {
			in, out = orNone(g.Instances), orNone(g.Draining)
		}
		rows = append(rows, row{name: name, cells: []string{in, out, x.Label("digest")}})
	}
	return rows
}

// orNone is names joined by commas, or "-" for none.
func orNone(names []string) string {
	if len(names) == 0 {
		return "-"
	}
	return strings.Join(names, ",")
}

type row struct {
	name     string
	labels   []metrics.Label
	pps, bps float64
	cells    []string
}

// rowsOf makes one row per sample of a packet counter, with the rates of it
// and its byte counter; the default cells are packets, pkt/s, bytes, rate.
func rowsOf(prev, cur snapshot, pkts, bytes string, name func(metrics.Sample) string, order func(a, b metrics.Sample) int) []row {
	samples := metrics.Find(cur.samples, pkts)
	if order != nil {
		slices.SortStableFunc(samples, order)
	}
	var rows []row
	for _, x := range samples {
		r := row{name: name(x), labels: x.Labels, pps: rate(prev, cur, pkts, x.Labels), bps: rate(prev, cur, bytes, x.Labels)}
		r.cells = []string{human(x.Value), human(r.pps), human(cur.byKey[key(bytes, x.Labels)]), bits(r.bps)}
		rows = append(rows, r)
	}
	return rows
}

func table(w io.Writer, title string, cols []string, rows []row) {
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%s\t%s\t\n", title, strings.Join(cols, "\t"))
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t\n", r.name, strings.Join(r.cells, "\t"))
	}
	tw.Flush()
}

func labelOf(ls []metrics.Label, name string) string {
	for _, l := range ls {
		if l.Name == name {
			return l.Value
		}
	}
	return ""
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
