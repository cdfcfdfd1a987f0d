package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/configs"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// The demo's traffic, matching configs/demo.yaml.
const (
	triggerPortLo = 9000
	triggerPorts  = 4
	blockedPort   = 6666
	httpPort      = 80
	// triggerHits is the number of hit energies in each trigger datagram.
	triggerHits = 8
	// triggerThreshold is the reference trigger's summed energy per window.
	triggerThreshold = 20000
)

// demoOptions size the traffic.
type demoOptions struct {
	Requests        int // HTTP requests
	TriggerPerPort  int // UDP datagrams to each trigger port
	Blocked         int // UDP datagrams to the dropped port
	Pings           int
	Attach          config.Attach
	ResponseBytes   int
	ProgressTimeout time.Duration
}

var defaultDemo = demoOptions{Requests: 200, TriggerPerPort: 250, Blocked: 100, Pings: 3, ResponseBytes: 4096, ProgressTimeout: 10 * time.Second}

func newDemoCommand() *cobra.Command {
	opts := defaultDemo
	var attach string
	c := &cobra.Command{
		Use:   "demo [flags]",
		Short: "Run the whole appliance in network namespaces of its own, with real traffic",
		Long: `Builds an outside host and a bridge host in network namespaces and runs the
daemon on the bridge host with an embedded configuration, an HTTP application
on a user-space stack and an ingest consumer; drives HTTP, UDP trigger bursts,
blocked datagrams and pings through it, prints a summary and removes
everything it made. Needs root.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			switch attach {
			case "auto":
				opts.Attach = config.AttachAuto
			case "strict":
				opts.Attach = config.AttachStrict
			default:
				return fmt.Errorf("demo: --attach %q: want auto or strict", attach)
			}
			if opts.Requests < 1 || opts.TriggerPerPort < 0 {
				return errors.New("demo: --requests must be at least 1 and --triggers not negative")
			}
			if os.Geteuid() != 0 {
				return errors.New("demo: needs root (it creates network namespaces, loads an XDP program and opens AF_XDP sockets)")
			}
			sum, err := runDemo(c.Context(), opts, c.OutOrStdout())
			if err != nil {
				return fmt.Errorf("demo: %w", err)
			}
			printSummary(c.OutOrStdout(), sum)
			return nil
		},
	}
	fs := c.Flags()
	fs.IntVar(&opts.Requests, "requests", opts.Requests, "HTTP requests to send")
	fs.IntVar(&opts.TriggerPerPort, "triggers", opts.TriggerPerPort, "UDP trigger datagrams per source port")
	fs.StringVar(&attach, "attach", "auto", "auto: the fastest data path the interface allows; strict: native zero-copy or fail")
	return c
}

// demoSummary is what the demo measured; the test asserts it.
type demoSummary struct {
	Mode          string // the bridge's data path
	Requests      int    // answered, as the outside client saw them
	Served        int64  // as the application counted them
	ResponseBytes int64
	Latency       [3]time.Duration // p50, p99, max

	TriggerSent    int
	TriggerKernel  int // trigger datagrams that reached a kernel socket instead
	IngestRecords  uint64
	IngestBytes    uint64
	IngestBuffers  uint64
	DroppedHere    uint64 // gaps in the ring's per-source sequences
	SenderGaps     uint64
	Windows        uint64
	Triggers       uint64
	IngestLatency  [2]time.Duration // p50, p99 wire to consumer (bucket upper bounds)
	IngestBudgetKO uint64

	BlockedSent     int
	BlockedDropped  uint64
	BlockedReceived int
	PingReplies     int

	Drops    map[string]uint64 // data path drops by where and why
	Verdicts map[string]uint64 // XDP verdict packets
	Rules    []ruleCount
	Log      string // the daemon's log

	Namespaces []string // the demo's own, all removed when it returns
	Dir        string   // its sockets, removed when it returns
}

type ruleCount struct {
	ID             int
	Name           string
	Packets, Bytes uint64
}

// scope is a topology.TB for a program: it keeps cleanups and runs them in
// reverse order, and turns Fatalf into a panic that runDemo recovers.
type scope struct {
	cleanups []func()
	errs     []error
}

type fatal struct{ err error }

func (s *scope) Helper()          {}
func (s *scope) Cleanup(f func()) { s.cleanups = append(s.cleanups, f) }
func (s *scope) Errorf(format string, args ...any) {
	s.errs = append(s.errs, fmt.Errorf(format, args...))
}
func (s *scope) Fatalf(format string, args ...any) { panic(fatal{fmt.Errorf(format, args...)}) }

func (s *scope) close() error {
	for _, f := range slices.Backward(s.cleanups) {
		f()
	}
	s.cleanups = nil
	return errors.Join(s.errs...)
}

// demoConfig is the embedded configs/demo.yaml with the topology's
// interface, address and socket directory in place of its placeholders.
func demoConfig(ifname string, addr netip.Addr, dir string, attach config.Attach) (*config.Config, error) {
	text, err := configs.Files.ReadFile(configs.Demo)
	if err != nil {
		return nil, err
	}
	s := strings.NewReplacer("veth0", ifname, "198.18.0.1", addr.String(), "/run/fabricbridge", dir, "attach: auto", "attach: "+attach.String()).Replace(string(text))
	return config.Parse(configs.Demo+" (embedded, with the demo's interface)", []byte(s))
}

// runDemo builds an outside host and a bridge host in network namespaces,
// starts the daemon on the bridge host with the embedded configuration, an
// HTTP application on its own user-space stack and an ingest consumer,
// drives HTTP, UDP trigger bursts, blocked datagrams and pings from the
// outside through the kernel's own stack, and reports what happened. It
// removes everything it made, also on error.
func runDemo(ctx context.Context, opts demoOptions, log io.Writer) (sum demoSummary, err error) {
	s := &scope{}
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(fatal)
			if !ok {
				panic(r)
			}
			err = f.err
		}
		err = errors.Join(err, s.close())
	}()

	fmt.Fprintln(log, "building the topology: outside host <-veth-> bridge host (network namespaces)")
	bridgeNS, outside, v := topology.Pair(s, topology.VethOptions{})
	local := v.A.Addr4.Addr()
	sum.Namespaces = []string{bridgeNS.Name, outside.Name}
	fmt.Fprintf(log, "  bridge %s %s on %s, outside %s on %s\n", bridgeNS.Name, local, v.A.Name, outside.Name, v.B.Name)
	// The veth stands in for a wire: complete checksums, as a NIC sends.
	if err := ethtool.DisableTxChecksum(outside, v.B.Name); err != nil {
		return sum, err
	}
	if sum.Dir, err = os.MkdirTemp("", "fabricbridge-demo-"); err != nil {
		return sum, err
	}
	s.Cleanup(func() { os.RemoveAll(sum.Dir) })
	cfg, err := demoConfig(v.A.Name, local, sum.Dir, opts.Attach)
	if err != nil {
		return sum, err
	}

	// The daemon, on the bridge host.
	var daemonLog syncBuffer
	var d *appliance.Daemon
	if err := bridgeNS.Do(func() (err error) {
		d, err = appliance.Start(cfg, appliance.Options{Log: &daemonLog})
		return err
	}); err != nil {
		return sum, fmt.Errorf("%w\n%s", err, daemonLog.String())
	}
	s.Cleanup(func() {
		if err := d.Close(); err != nil {
			s.Errorf("stopping the daemon: %v", err)
		}
		sum.Log = daemonLog.String()
	})
	first, err := scrapeAdmin(ctx, cfg.Control.AdminSocket)
	if err != nil {
		return sum, err
	}
	for _, x := range metrics.Find(first, "fabricbridge_attach_mode") {
		sum.Mode = x.Label("mode")
	}
	fmt.Fprintf(log, "daemon running: XDP classifier and AF_XDP bridge on %s, data path %s\n", v.A.Name, sum.Mode)
	if sum.Mode == "generic" || sum.Mode == "afpacket" {
		fmt.Fprintln(log, "  warning: this path is much slower than native XDP")
	}

	// The HTTP application on its own user-space TCP/IP stack.
	appCtx, stopApps := context.WithCancel(ctx)
	var apps sync.WaitGroup
	s.Cleanup(func() { stopApps(); apps.Wait() })
	st, err := userstack.Open(ctx, userstack.Options{App: "web", Control: cfg.Control.Socket})
	if err != nil {
		return sum, fmt.Errorf("web application: %w", err)
	}
	s.Cleanup(func() { st.Close() })
	var served httpCounters
	ln, err := st.Listen("tcp", fmt.Sprintf(":%d", httpPort))
	if err != nil {
		return sum, fmt.Errorf("web application: %w", err)
	}
	srv := &http.Server{Handler: httpHandler(opts.ResponseBytes, &served), ReadHeaderTimeout: 5 * time.Second}
	apps.Add(1)
	go func() {
		defer apps.Done()
		srv.Serve(ln)
	}()
	go func() {
		<-appCtx.Done()
		srv.Close()
	}()
	fmt.Fprintf(log, "web application on a user-space TCP/IP stack (gVisor netstack), listening on %s:%d\n", local, httpPort)

	// The ingest consumer: the CPU reference trigger.
	cons, err := ingest.Open(appliance.IngestPath(cfg, "trigger"), ingest.ConsumerOptions{Budget: time.Duration(cfg.Ingest[0].LatencyBudget)})
	if err != nil {
		return sum, fmt.Errorf("ingest consumer: %w", err)
	}
	s.Cleanup(func() { cons.Close() })
	ref := &ingest.Reference{Threshold: triggerThreshold}
	var refMu sync.Mutex
	apps.Add(1)
	go func() {
		defer apps.Done()
		for appCtx.Err() == nil {
			b, err := cons.Next(50 * time.Millisecond)
			if err != nil {
				if errors.Is(err, ingest.ErrTimeout) {
					continue
				}
				return
			}
			refMu.Lock()
			ref.Process(&b)
			refMu.Unlock()
			cons.Release(&b)
		}
	}()
	fmt.Fprintf(log, "ingest consumer attached to ring %q (%d buffers of %d bytes, window %v)\n",
		"trigger", cons.Info().Buffers, cons.Info().BufferSize, cons.Info().Window)

	fmt.Fprintf(log, "driving traffic from the outside host: %d HTTP requests, %d trigger datagrams on %d ports, %d to a blocked port, %d pings\n",
		opts.Requests, opts.TriggerPerPort*triggerPorts, triggerPorts, opts.Blocked, opts.Pings)
	if sum.PingReplies, err = outside.Ping(local, opts.Pings, opts.ProgressTimeout); err != nil {
		return sum, fmt.Errorf("ping: %w", err)
	}
	if err := httpLoad(ctx, outside, local, opts, &sum); err != nil {
		return sum, err
	}
	if err := udpBursts(bridgeNS, outside, local, opts, &sum); err != nil {
		return sum, err
	}

	// Wait for the consumer to see every trigger datagram (or give up).
	records := func() (n uint64) {
		refMu.Lock()
		defer refMu.Unlock()
		for _, c := range ref.Sources {
			n += c.Records + c.DroppedHere
		}
		return n
	}
	for deadline := time.Now().Add(opts.ProgressTimeout); records() < uint64(sum.TriggerSent) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	stopApps()
	apps.Wait()
	sum.Served, sum.IngestBuffers = served.Requests.Load(), cons.Stats().Buffers
	refMu.Lock()
	for _, c := range ref.Sources {
		sum.IngestRecords += c.Records
		sum.IngestBytes += c.Bytes
		sum.DroppedHere += c.DroppedHere
		sum.SenderGaps += c.SenderGaps
	}
	sum.Windows, sum.Triggers = ref.Windows, ref.Triggers
	refMu.Unlock()
	cs := cons.Stats()
	sum.IngestLatency = [2]time.Duration{time.Duration(cs.Latency.Quantile(0.5)), time.Duration(cs.Latency.Quantile(0.99))}
	sum.IngestBudgetKO = cs.Violations

	last, err := scrapeAdmin(ctx, cfg.Control.AdminSocket)
	if err != nil {
		return sum, err
	}
	readCounters(last, &sum)
	return sum, nil
}

// syncBuffer collects the daemon's log.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// scrapeAdmin reads the daemon's metrics over its admin socket.
func scrapeAdmin(ctx context.Context, sock string) ([]metrics.Sample, error) {
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://fabricbridge/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return metrics.Parse(resp.Body)
}

func sumOf(s []metrics.Sample, name string, labels ...string) (t uint64) {
	for _, x := range metrics.Find(s, name, metrics.L(labels...)...) {
		t += uint64(x.Value)
	}
	return t
}

// readCounters fills the summary's counters from the daemon's metrics.
func readCounters(s []metrics.Sample, sum *demoSummary) {
	sum.BlockedDropped = sumOf(s, "fabricbridge_rule_packets_total", "name", "blocked")
	sum.Verdicts = map[string]uint64{}
	for _, x := range metrics.Find(s, "fabricbridge_xdp_verdict_packets_total") {
		sum.Verdicts[x.Label("verdict")] += uint64(x.Value)
	}
	sum.Drops = map[string]uint64{
		"stream ring full": sumOf(s, "fabricbridge_queue_rx_drops_total", "reason", "ring_full"),
		"no stream":        sumOf(s, "fabricbridge_queue_rx_drops_total", "reason", "no_stream"),
		"malformed":        sumOf(s, "fabricbridge_queue_rx_drops_total", "reason", "malformed"),
		"kernel RX ring":   sumOf(s, "fabricbridge_queue_kernel_rx_drops_total"),
		"TX rejected":      sumOf(s, "fabricbridge_queue_tx_rejects_total"),
		"ingest ring":      sumOf(s, "fabricbridge_ingest_drops_total"),
		"ingest engine":    sumOf(s, "fabricbridge_ingest_engine_frames_total", "outcome", "malformed") + sumOf(s, "fabricbridge_ingest_engine_frames_total", "outcome", "no_ring") + sumOf(s, "fabricbridge_ingest_engine_frames_total", "outcome", "kernel_drop"),
		"redirect failed":  sumOf(s, "fabricbridge_xdp_redirect_failed_total"),
	}
	for _, x := range metrics.Find(s, "fabricbridge_rule_packets_total") {
		id, _ := strconv.Atoi(x.Label("id"))
		sum.Rules = append(sum.Rules, ruleCount{ID: id, Name: x.Label("name"), Packets: uint64(x.Value),
			Bytes: sumOf(s, "fabricbridge_rule_bytes_total", "id", x.Label("id"))})
	}
	slices.SortFunc(sum.Rules, func(a, b ruleCount) int { return a.ID - b.ID })
}

func httpLoad(ctx context.Context, outside *topology.NS, local netip.Addr, opts demoOptions, sum *demoSummary) error {
	// Dial inside the outside namespace: the socket stays there, whichever
	// thread the HTTP client later uses it on.
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			err = outside.Do(func() (err error) {
				d := net.Dialer{Timeout: opts.ProgressTimeout}
				c, err = d.DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
		DisableKeepAlives: true, // a connection per request: every one a SYN, a handshake and a close on the user-space stack
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: opts.ProgressTimeout}
	url := "http://" + netip.AddrPortFrom(local, httpPort).String() + "/"
	lat := make([]time.Duration, 0, opts.Requests)
	for range opts.Requests {
		start := time.Now()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("http: %w", err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			return fmt.Errorf("http: status %d, %v", resp.StatusCode, err)
		}
		lat = append(lat, time.Since(start))
		sum.Requests++
		sum.ResponseBytes += n
	}
	slices.Sort(lat)
	if len(lat) > 0 {
		sum.Latency = [3]time.Duration{lat[len(lat)/2], lat[(len(lat)*99)/100], lat[len(lat)-1]}
	}
	return nil
}

// udpBursts sends trigger datagrams (a sender sequence number and hit
// energies, the format the reference consumer reads) to each trigger port
// and datagrams to the blocked port. Kernel sockets on the bridge host
// listen on all those ports: whatever reaches them escaped XDP.
func udpBursts(bridge, outside *topology.NS, local netip.Addr, opts demoOptions, sum *demoSummary) error {
	var socks []*net.UDPConn
	defer func() {
		for _, c := range socks {
			c.Close()
		}
	}()
	if err := bridge.Do(func() error {
		for p := range triggerPorts + 1 {
			port := triggerPortLo + p
			if p == triggerPorts {
				port = blockedPort
			}
			c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, uint16(port))))
			if err != nil {
				return err
			}
			c.SetReadBuffer(4 << 20)
			socks = append(socks, c)
		}
		return nil
	}); err != nil {
		return err
	}
	send := func(port uint16, n int, trigger bool) error {
		return outside.Do(func() error {
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, port)))
			if err != nil {
				return err
			}
			defer c.Close()
			msg := make([]byte, ingest.TriggerSeqLen+2*triggerHits)
			energies := make([]uint16, triggerHits)
			for i := range n {
				if trigger {
					for h := range energies {
						energies[h] = uint16((i*31 + h*17 + int(port)) % 1000)
					}
					ingest.PutTriggerPayload(msg, uint32(i), energies)
				}
				if _, err := c.Write(msg); err != nil {
					return err
				}
				if i%64 == 63 {
					time.Sleep(50 * time.Microsecond) // bursts of 64, like a read-out board's
				}
			}
			return nil
		})
	}
	for p := range triggerPorts {
		if err := send(uint16(triggerPortLo+p), opts.TriggerPerPort, true); err != nil {
			return err
		}
		sum.TriggerSent += opts.TriggerPerPort
	}
	if err := send(blockedPort, opts.Blocked, false); err != nil {
		return err
	}
	sum.BlockedSent = opts.Blocked
	for i, c := range socks {
		n := drainUDP(c, 300*time.Millisecond)
		if i == triggerPorts {
			sum.BlockedReceived = n
		} else {
			sum.TriggerKernel += n
		}
	}
	return nil
}

func drainUDP(c *net.UDPConn, quiet time.Duration) int {
	buf := make([]byte, 2048)
	n := 0
	for {
		c.SetReadDeadline(time.Now().Add(quiet))
		if _, err := c.Read(buf); err != nil {
			return n
		}
		n++
	}
}

func printSummary(w io.Writer, sum demoSummary) {
	us := func(d time.Duration) string {
		return strconv.FormatFloat(float64(d)/float64(time.Microsecond), 'f', 0, 64) + "µs"
	}
	fmt.Fprintf(w, "\nsummary\n")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "  data path\t%s\n", sum.Mode)
	fmt.Fprintf(tw, "  HTTP requests served\t%d by the application on its user-space stack (%d answered, %d response bytes)\n", sum.Served, sum.Requests, sum.ResponseBytes)
	fmt.Fprintf(tw, "  HTTP latency\tp50 %s  p99 %s  max %s (connect, request, response, close)\n", us(sum.Latency[0]), us(sum.Latency[1]), us(sum.Latency[2]))
	fmt.Fprintf(tw, "  trigger datagrams\t%d sent, %d ingest records (%d payload bytes) in %d buffers, %d dropped here, %d sender gaps, %d reached the kernel\n",
		sum.TriggerSent, sum.IngestRecords, sum.IngestBytes, sum.IngestBuffers, sum.DroppedHere, sum.SenderGaps, sum.TriggerKernel)
	fmt.Fprintf(tw, "  ingest latency\tp50 < %s  p99 < %s wire to consumer, %d buffers over the budget\n", us(sum.IngestLatency[0]), us(sum.IngestLatency[1]), sum.IngestBudgetKO)
	fmt.Fprintf(tw, "  trigger reduction\t%d windows, %d triggered (summed energy >= %d)\n", sum.Windows, sum.Triggers, triggerThreshold)
	fmt.Fprintf(tw, "  blocked datagrams\t%d sent, %d dropped in XDP, %d reached the kernel\n", sum.BlockedSent, sum.BlockedDropped, sum.BlockedReceived)
	fmt.Fprintf(tw, "  pings\t%d replies (from the bridge host's kernel)\n", sum.PingReplies)
	var drops []string
	for _, k := range slices.Sorted(maps.Keys(sum.Drops)) {
		drops = append(drops, fmt.Sprintf("%s %d", k, sum.Drops[k]))
	}
	fmt.Fprintf(tw, "  drops\t%s\n", strings.Join(drops, ", "))
	tw.Flush()
	fmt.Fprintf(w, "\nXDP verdicts (packets)\n")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	for _, v := range slices.Sorted(maps.Keys(sum.Verdicts)) {
		fmt.Fprintf(tw, "  %s\t%d\t\n", v, sum.Verdicts[v])
	}
	tw.Flush()
	fmt.Fprintf(w, "\nrules (ids from %d are the listeners and flows applications claimed)\n", config.MaxStaticID+1)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "  id\tname\tpackets\tbytes\t\n")
	for _, r := range sum.Rules {
		fmt.Fprintf(tw, "  %d\t%s\t%d\t%d\t\n", r.ID, r.Name, r.Packets, r.Bytes)
	}
	tw.Flush()
}
