package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/internal/netns"
)

// The demo's embedded default configuration. Ids name the counters.
const (
	idHTTP    = 1
	idTrigger = 2
	idBlocked = 3
)

const (
	triggerPortLo = 9000
	triggerPorts  = 4
	blockedPort   = 6666
)

func defaultRules(httpAddr netip.Addr) *classifier.RuleSet {
	return &classifier.RuleSet{
		Listeners: []classifier.Listener{
			{ID: idHTTP, Protocol: classifier.ProtoTCP, Addr: httpAddr, Port: 80, Stream: 1},
		},
		Rules: []classifier.Rule{
			{ID: idTrigger, Priority: 10, Protocol: classifier.ProtoUDP,
				DstPorts: classifier.PortRange{Lo: triggerPortLo, Hi: triggerPortLo + triggerPorts - 1},
				Action:   classifier.ActionIngest, Stream: 10},
			{ID: idBlocked, Priority: 20, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(blockedPort), Action: classifier.ActionDrop},
		},
	}
}

// demoOptions size the traffic.
type demoOptions struct {
	Requests        int // HTTP requests
	TriggerPerPort  int // UDP datagrams to each trigger port
	Blocked         int // UDP datagrams to the dropped port
	Pings           int
	Mode            ebpf.Mode
	ResponseBytes   int
	ProgressTimeout time.Duration
}

var defaultDemo = demoOptions{Requests: 200, TriggerPerPort: 250, Blocked: 100, Pings: 3, ResponseBytes: 4096, ProgressTimeout: 10 * time.Second}

// demoSummary is what the demo measured; the test asserts it.
type demoSummary struct {
	Mode            ebpf.Mode
	Requests        int
	ResponseBytes   int64
	Latency         [3]time.Duration // p50, p99, max
	TriggerSent     int
	TriggerKernel   int // received by the kernel socket after the fallback
	BlockedSent     int
	BlockedReceived int
	PingReplies     int
	Counters        ebpf.Counters
	Rules           map[uint32]ebpf.Counter
	Namespaces      []string // the demo's own, all removed when it returns
}

// scope is a netns.TB for a program: it keeps cleanups and runs them in
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

// runDemo builds an outside host and a bridge host in network namespaces,
// attaches the classifier to the bridge's interface with the embedded rules,
// drives HTTP, UDP trigger bursts, blocked datagrams and pings from the
// outside through the kernel's own stack, and reports what was counted. It
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
	bridge, outside, v := netns.Pair(s, netns.VethOptions{})
	local := v.A.Addr4.Addr()
	sum.Namespaces = []string{bridge.Name, outside.Name}
	fmt.Fprintf(log, "  bridge %s %s on %s, outside %s on %s\n", bridge.Name, local, v.A.Name, outside.Name, v.B.Name)

	prog, err := ebpf.Load()
	if err != nil {
		return sum, err
	}
	s.Cleanup(func() {
		if err := prog.Close(); err != nil {
			s.Errorf("closing the program: %v", err)
		}
	})
	rules := defaultRules(local)
	tables, err := classifier.Compile(rules)
	if err != nil {
		return sum, err
	}
	if err := prog.Update(tables); err != nil {
		return sum, err
	}
	if err := bridge.Do(func() (err error) {
		sum.Mode, err = prog.Attach(v.A.Index, opts.Mode)
		return err
	}); err != nil {
		return sum, err
	}
	fmt.Fprintf(log, "XDP classifier attached to %s in %s mode\n", v.A.Name, sum.Mode)
	if sum.Mode == ebpf.ModeGeneric {
		fmt.Fprintln(log, "  warning: generic mode runs on the skb path and is much slower than native")
	}

	// Stream 1 (HTTP) and ingest buffer 10 have no AF_XDP consumer yet, so
	// their frames fall back to the bridge host's kernel, where ordinary
	// sockets stand in for the applications.
	if err := startHTTP(s, bridge, netip.AddrPortFrom(local, 80), opts.ResponseBytes); err != nil {
		return sum, err
	}

	fmt.Fprintf(log, "driving traffic from the outside host: %d HTTP requests, %d trigger datagrams on %d ports, %d to a blocked port, %d pings\n",
		opts.Requests, opts.TriggerPerPort*triggerPorts, triggerPorts, opts.Blocked, opts.Pings)
	if sum.PingReplies, err = outside.Ping(local, opts.Pings, opts.ProgressTimeout); err != nil {
		return sum, fmt.Errorf("ping: %w", err)
	}
	if err := httpLoad(ctx, outside, local, opts, &sum); err != nil {
		return sum, err
	}
	if err := udpBursts(bridge, outside, local, opts, &sum); err != nil {
		return sum, err
	}

	if sum.Counters, err = prog.Counters(); err != nil {
		return sum, err
	}
	if sum.Rules, err = prog.RuleCounters(); err != nil {
		return sum, err
	}
	return sum, nil
}

func startHTTP(s *scope, ns *netns.NS, at netip.AddrPort, size int) error {
	var ln net.Listener
	if err := ns.Do(func() (err error) {
		ln, err = net.Listen("tcp", at.String())
		return err
	}); err != nil {
		return err
	}
	body := strings.Repeat("x", size)
	srv := &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, body) }),
		ReadHeaderTimeout: 5 * time.Second,
	}
	go srv.Serve(ln)
	s.Cleanup(func() { srv.Close() })
	return nil
}

func httpLoad(ctx context.Context, outside *netns.NS, local netip.Addr, opts demoOptions, sum *demoSummary) error {
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
		DisableKeepAlives: true, // a connection per request: more SYNs for the listener to claim
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: opts.ProgressTimeout}
	url := "http://" + netip.AddrPortFrom(local, 80).String() + "/"
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

func udpBursts(bridge, outside *netns.NS, local netip.Addr, opts demoOptions, sum *demoSummary) error {
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
	send := func(port uint16, n int) error {
		return outside.Do(func() error {
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, port)))
			if err != nil {
				return err
			}
			defer c.Close()
			msg := make([]byte, 64)
			for i := range n {
				msg[0], msg[1] = byte(i>>8), byte(i)
				if _, err := c.Write(msg); err != nil {
					return err
				}
			}
			return nil
		})
	}
	for p := range triggerPorts {
		if err := send(uint16(triggerPortLo+p), opts.TriggerPerPort); err != nil {
			return err
		}
		sum.TriggerSent += opts.TriggerPerPort
	}
	if err := send(blockedPort, opts.Blocked); err != nil {
		return err
	}
	sum.BlockedSent = opts.Blocked
	for i, c := range socks {
		n := drainUDP(c, 500*time.Millisecond)
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
	fmt.Fprintf(w, "\nsummary\n")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "  attach mode\t%s\n", sum.Mode)
	fmt.Fprintf(tw, "  HTTP requests served\t%d (%d response bytes)\n", sum.Requests, sum.ResponseBytes)
	fmt.Fprintf(tw, "  HTTP latency\tp50 %v  p99 %v  max %v\n", sum.Latency[0].Round(time.Microsecond), sum.Latency[1].Round(time.Microsecond), sum.Latency[2].Round(time.Microsecond))
	fmt.Fprintf(tw, "  trigger datagrams\t%d sent, %d counted for ingest, %d reached the kernel (no ingest consumer yet)\n",
		sum.TriggerSent, sum.Rules[idTrigger].Packets, sum.TriggerKernel)
	fmt.Fprintf(tw, "  blocked datagrams\t%d sent, %d dropped in XDP, %d reached the kernel\n", sum.BlockedSent, sum.Rules[idBlocked].Packets, sum.BlockedReceived)
	fmt.Fprintf(tw, "  pings\t%d replies\n", sum.PingReplies)
	tw.Flush()
	fmt.Fprintf(w, "\nverdicts\n")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "  verdict\tpackets\tbytes\t\n")
	for v, c := range sum.Counters.Verdicts {
		fmt.Fprintf(tw, "  %s\t%d\t%d\t\n", classifier.Verdict(v), c.Packets, c.Bytes)
	}
	tw.Flush()
	fmt.Fprintf(w, "  redirects that fell back to the kernel (no AF_XDP socket bound): %d\n", sum.Counters.RedirectFailed)
	fmt.Fprintf(w, "\nrules\n")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "  id\twhat\tpackets\tbytes\t\n")
	for _, r := range []struct {
		id   uint32
		what string
	}{{idHTTP, "tcp listener :80 -> stream 1"}, {idTrigger, "udp 9000-9003 -> ingest 10"}, {idBlocked, "udp 6666 drop"}} {
		c := sum.Rules[r.id]
		fmt.Fprintf(tw, "  %d\t%s\t%d\t%d\t\n", r.id, r.what, c.Packets, c.Bytes)
	}
	tw.Flush()
}
