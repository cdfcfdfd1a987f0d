package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// The sample applications run on a user-space stack over a stream of the
// bridge: for trying the bridge out and for benchmarks.

// appOptions are the flags of `app http`, `app echo` and `app sink`.
type appOptions struct {
	kind, name, listen string
	stack              userstack.Options
	size               int
	rateMbit           float64
	udp                bool
	every              time.Duration
	drainTimeout       time.Duration
	stacks             int

	// Where the bridge is, turned into stack.Control, stack.Remote or
	// stack.Bridges by resolve.
	config, control, remote, secretFile string
	bridges                             []string
	tls                                 clientTLSFiles
}

func newAppCommand() *cobra.Command {
	app := &cobra.Command{
		Use:   "app http|echo|sink|trigger [flags]",
		Short: "Run a sample application on a user-space stack over the bridge",
		Long: `Runs a sample application on its own user-space TCP/IP stack (gVisor
netstack) over a stream of the bridge, local or on another node: for trying
the bridge out and for benchmarks; or the consumer of an ingest ring.`,
		RunE: func(c *cobra.Command, args []string) error {
			if len(args) == 0 {
				return errors.New("app: which application? http, echo, sink or trigger (fabricbridge app --help)")
			}
			return fmt.Errorf("app: unknown application %q: http, echo, sink or trigger (fabricbridge app --help)", args[0])
		},
	}
	app.AddCommand(
		newServeCommand("http", ":80", "Serve HTTP on a user-space stack",
			"Serves HTTP: GET / answers --size bytes, GET /bytes/N answers N bytes\n(at --rate Mbit/s at most, if given)."),
		newServeCommand("echo", ":7", "Echo TCP (and UDP) on a user-space stack",
			"Echoes TCP connections, and UDP datagrams with --udp."),
		newServeCommand("sink", ":9", "Discard TCP (and UDP) on a user-space stack, printing the rate",
			"Discards TCP connections, and UDP datagrams with --udp, and prints the rate\nevery --every."),
		newTriggerCommand())
	return app
}

// newServeCommand is `app KIND`, a server on a user-space stack that
// listens on listen unless told otherwise; long says what it serves.
func newServeCommand(kind, listen, short, long string) *cobra.Command {
	o := appOptions{kind: kind}
	c := &cobra.Command{
		Use:   kind + " [flags]",
		Short: short,
		Long: long + `

It registers with the bridge as --name, over the control socket of the local
bridge (--control, or the one --config names) or over TCP to a bridge on
another node (--remote, with its shared secret and, for a bridge with
auth: tls, a client certificate), and serves on its own user-space stack.

With --bridge, once for each bridge box of a scale-out group, it registers
with all of them as instance --instance, so that whichever box the routers
pick steers its connections here: "local" is the local bridge (--control or
--config), an absolute path another local control socket, HOST:PORT a bridge
on another node (with --secret-file and --tls-*, the same for every one).
Packets leave through the first bridge of the list that is up.

With --stacks N it runs N user-space stacks in this one process, each with a
stream of its own and registered as an instance of the application, which
the bridge spreads new connections over, as it does over instances in
processes of their own. A stack's locks and counters are then shared by
fewer connections (see docs/performance.md, several stacks in one process).
The process runs one Go processor per stack unless GOMAXPROCS is set: a
request's hand-offs between a stack's goroutines then stay on one core.

On SIGTERM or Ctrl-C, an instance of a shared listener (--instance,
several --bridge, or --stacks) drains before it exits: every bridge sends it
no new connections, and it serves the open ones until they end or
--drain-timeout passes; then it exits 0. A second signal ends it at once.
Any other application stops at once.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := o.resolve(); err != nil {
				return err
			}
			if ownsProcess {
				if procs, set := goProcsPerStack(o.stacks); set {
					fmt.Fprintf(c.OutOrStdout(), "%s: Go processors (GOMAXPROCS): %d, for %d stacks; set GOMAXPROCS to choose\n", kind, procs, o.stacks)
				}
			}
			if o.stack.Spin > 0 {
				fmt.Fprintf(c.OutOrStdout(), "%s: the receive loop polls an empty stream for %v before it sleeps\n", kind, o.stack.Spin)
			}
			if o.stacks > 1 {
				return serveStacks(c.Context(), o, c.OutOrStdout())
			}
			return serveApp(c.Context(), o, c.OutOrStdout())
		},
	}
	fs := c.Flags()
	fs.StringVar(&o.name, "name", kind, "application name, as the bridge's configuration knows it")
	fs.StringVar(&o.listen, "listen", listen, "where to listen, HOST:PORT")
	fs.StringVar(&o.config, "config", "", "the bridge's configuration, for its control socket (default "+DefaultConfig+")")
	fs.StringVar(&o.control, "control", "", "the bridge's control socket (overrides --config)")
	fs.StringVar(&o.remote, "remote", "", "a bridge on another node, HOST:PORT (control over TCP, stream over GENEVE)")
	fs.StringArrayVar(&o.bridges, "bridge", nil, "a bridge of a scale-out group, once for each: local, a control socket's path, or HOST:PORT; the first that is up sends")
	fs.StringVar(&o.stack.Instance, "instance", "", "this instance's name, the same at every bridge (default: with several --bridge, HOST-PID)")
	fs.IntVar(&o.stacks, "stacks", 1, "run this many stacks side by side, each with a stream of its own, as instances INSTANCE-1, INSTANCE-2, ... (default INSTANCE: NAME-PID)")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, how long an instance (--instance, several --bridge, or --stacks) serves its open connections, taking no new ones, before it exits (0: exit at once)")
	fs.StringVar(&o.secretFile, "secret-file", "", "the secret shared with that bridge (required with --remote)")
	fs.StringVar(&o.tls.cert, "tls-cert", "", "client certificate, for a bridge with auth: tls (with --tls-key)")
	fs.StringVar(&o.tls.key, "tls-key", "", "the client certificate's private key")
	fs.StringVar(&o.tls.ca, "tls-ca", "", "the CA that signed the bridge's certificate (default: the system's roots)")
	fs.StringVar(&o.tls.serverName, "tls-server-name", "", "the name to check in the bridge's certificate (default: the host of --remote, an IP address checked against its IP SANs)")
	fs.DurationVar(&o.stack.Spin, "spin", 0, "how long each stack's receive loop polls an empty stream before it sleeps until the bridge signals, at most 1s (0: at once, best where cores are shared; tens of µs where the application has cores of its own)")
	fs.BoolVar(&o.stack.NoAckDelay, "no-ack-delay", false, "send every ACK at once, instead of holding a request's ACK up to 1 ms for the answer to carry; for peers that write a request in several small pieces with Nagle's algorithm on")
	fs.IntVar(&o.stack.MTU, "mtu", 0, "largest IP packet the stack sends; with --remote, at most the link MTU towards the bridge minus 36 (GENEVE): 1464 on 1500")
	switch kind {
	case "http":
		fs.IntVar(&o.size, "size", 4096, "bytes of the answer to GET /")
		fs.Float64Var(&o.rateMbit, "rate", 0, "pace answers to GET /bytes/N to this many Mbit/s (0: no limit)")
	case "echo":
		fs.BoolVar(&o.udp, "udp", false, "serve UDP on the same port too")
	case "sink":
		fs.BoolVar(&o.udp, "udp", false, "serve UDP on the same port too")
		fs.DurationVar(&o.every, "every", 5*time.Second, "how often to print the rate")
	}
	return c
}

// resolve checks the flags and finds the bridges: over TCP, by their
// control sockets, or by the socket the configuration names.
func (o *appOptions) resolve() error {
	if o.size < 0 || o.stack.MTU < 0 || o.rateMbit < 0 || o.drainTimeout < 0 || (o.kind == "sink" && o.every <= 0) {
		return fmt.Errorf("app %s: --size, --mtu, --rate and --drain-timeout must not be negative, --every must be positive", o.kind)
	}
	if o.stack.Spin < 0 || o.stack.Spin > time.Second {
		return fmt.Errorf("app %s: --spin %v: want 0 to 1s", o.kind, o.stack.Spin)
	}
	if o.stacks < 1 || o.stacks > maxStacks {
		return fmt.Errorf("app %s: --stacks %d: want 1 to %d", o.kind, o.stacks, maxStacks)
	}
	o.stack.App = o.name
	remotes := o.remote != "" || slices.ContainsFunc(o.bridges, isRemoteBridge)
	if !remotes && (o.secretFile != "" || o.tls != clientTLSFiles{}) {
		return errors.New("app: --secret-file and --tls-* go with --remote or a --bridge HOST:PORT")
	}
	if len(o.bridges) > 0 {
		if o.remote != "" {
			return errors.New("app: --remote and --bridge do not go together: give the remote bridge as one more --bridge")
		}
		for _, b := range o.bridges {
			br, err := o.bridge(b)
			if err != nil {
				return err
			}
			o.stack.Bridges = append(o.stack.Bridges, br)
		}
		return nil
	}
	var err error
	if o.remote != "" {
		o.stack.Remote, err = o.remoteOptions(o.remote)
	} else {
		o.stack.Control, err = o.localSocket()
	}
	return err
}

// isRemoteBridge says whether a --bridge names a bridge on another node.
func isRemoteBridge(b string) bool { return b != "local" && !filepath.IsAbs(b) }

// bridge resolves one --bridge.
func (o *appOptions) bridge(b string) (userstack.Bridge, error) {
	switch {
	case b == "local":
		path, err := o.localSocket()
		return userstack.Bridge{Control: path}, err
	case filepath.IsAbs(b):
		return userstack.Bridge{Control: b}, nil
	}
	if _, _, err := net.SplitHostPort(b); err != nil {
		return userstack.Bridge{}, fmt.Errorf("app: --bridge %q is neither local, an absolute path nor HOST:PORT", b)
	}
	ro, err := o.remoteOptions(b)
	return userstack.Bridge{Remote: ro}, err
}

// remoteOptions reach the bridge at addr with --secret-file and --tls-*.
func (o *appOptions) remoteOptions(addr string) (*userstack.RemoteOptions, error) {
	if o.secretFile == "" {
		return nil, fmt.Errorf("app: the bridge at %s needs --secret-file", addr)
	}
	secret, err := os.ReadFile(o.secretFile)
	if err != nil {
		return nil, fmt.Errorf("app: --secret-file: %w", err)
	}
	ro := &userstack.RemoteOptions{Control: addr, Secret: []byte(strings.TrimRight(string(secret), "\r\n"))}
	if o.tls != (clientTLSFiles{}) {
		if ro.TLS, err = o.tls.config(addr); err != nil {
			return nil, err
		}
	}
	return ro, nil
}

// localSocket is the local bridge's control socket: --control, or the one
// the configuration names.
func (o *appOptions) localSocket() (string, error) {
	if o.control != "" {
		return o.control, nil
	}
	path := o.config
	if path == "" {
		path = DefaultConfig
	}
	if _, err := os.Stat(path); err != nil && o.config == "" {
		return config.DefaultSocket, nil
	}
	c, err := config.Load(path)
	if err != nil {
		return "", err
	}
	return c.Control.Socket, nil
}

// clientTLSFiles are the --tls-* flags: the client's side of mutual TLS
// with a bridge whose TCP control plane has auth: tls.
type clientTLSFiles struct{ cert, key, ca, serverName string }

// config loads them. The server name defaults to the host of the bridge's
// control address; TLS 1.3, as the bridge requires.
func (f clientTLSFiles) config(remote string) (*tls.Config, error) {
	if f.cert == "" || f.key == "" {
		return nil, errors.New("app: mutual TLS needs --tls-cert and --tls-key (the bridge refuses clients without a certificate)")
	}
	pair, err := tls.LoadX509KeyPair(f.cert, f.key)
	if err != nil {
		return nil, fmt.Errorf("app: --tls-cert/--tls-key: %w", err)
	}
	c := &tls.Config{Certificates: []tls.Certificate{pair}, ServerName: f.serverName, MinVersion: tls.VersionTLS13}
	if c.ServerName == "" {
		host, _, err := net.SplitHostPort(remote)
		if err != nil {
			return nil, fmt.Errorf("app: --remote %q: %w", remote, err)
		}
		c.ServerName = host
	}
	if f.ca != "" {
		pem, err := os.ReadFile(f.ca)
		if err != nil {
			return nil, fmt.Errorf("app: --tls-ca: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("app: --tls-ca: %s holds no PEM certificate", f.ca)
		}
	}
	return c, nil
}

// drains says whether the application drains when it is told to stop:
// only an instance, which shares its listener with others, can hand new
// connections over to them. Several bridges make the stack an instance
// even without --instance (userstack.Options.Instance), and so do several
// stacks (serveStacks names each).
func (o *appOptions) drains() bool {
	return o.drainTimeout > 0 && (o.stack.Instance != "" || len(o.stack.Bridges) > 1)
}

// serveApp runs the application until ctx ends, then drains it first if
// it is an instance (appOptions.drains).
func serveApp(ctx context.Context, o appOptions, stdout io.Writer) error {
	var opened atomic.Pointer[userstack.Stack]
	o.stack.Events = func(e userstack.Event) {
		logBridgeEvent(stdout, o.kind, e)
		if s := opened.Load(); s != nil && e.Bridge != "" && movesSending(e.Kind) {
			logSending(stdout, o.kind, s.Bridges())
		}
	}
	st, err := userstack.Open(ctx, o.stack)
	if err != nil {
		return fmt.Errorf("app %s: %w", o.kind, err)
	}
	defer st.Close()
	defer func() { logLinkStats(stdout, o.kind, st.LinkStats()) }()
	opened.Store(st)
	fmt.Fprintf(stdout, "%s: application %q on a user-space stack, addresses %v\n", o.kind, o.name, st.Addrs())
	if bs := st.Bridges(); len(bs) > 1 {
		for _, b := range bs {
			fmt.Fprintf(stdout, "%s: bridge %s up %v\n", o.kind, b.Name, b.Up)
		}
		logSending(stdout, o.kind, bs)
	}
	conns := newOpenConns()
	serveCtx := ctx
	if o.drains() {
		var stop context.CancelFunc
		serveCtx, stop = context.WithCancel(context.WithoutCancel(ctx))
		defer stop()
		go func() {
			select {
			case <-ctx.Done():
				drainApp(st, conns, o.drainTimeout, stdout, o.kind)
				stop()
			case <-serveCtx.Done(): // it ended on its own
			}
		}()
	}
	switch o.kind {
	case "http":
		return serveHTTP(serveCtx, st, o.listen, o.size, o.rateMbit*1e6/8, stdout, nil, conns)
	case "echo":
		return serveEcho(serveCtx, st, o.listen, o.udp, stdout, conns)
	default:
		return serveSink(serveCtx, st, o.listen, o.udp, o.every, stdout, conns)
	}
}

// serveStacks runs o.stacks stacks side by side in this process, each an
// instance of the application (BASE-1, BASE-2, ...), until ctx ends or one
// of them fails; then the others drain and stop too. Each line a stack
// writes starts with its instance's name.
func serveStacks(ctx context.Context, o appOptions, stdout io.Writer) error {
	base := o.stack.Instance
	if base == "" {
		base = fmt.Sprintf("%s-%d", o.name, os.Getpid())
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var outMu sync.Mutex
	errs := make([]error, o.stacks)
	var wg sync.WaitGroup
	for i := range o.stacks {
		oi := o
		oi.stack.Instance = fmt.Sprintf("%s-%d", base, i+1)
		wg.Go(func() {
			out := prefixedLines{mu: &outMu, w: stdout, prefix: oi.stack.Instance + ": "}
			if errs[i] = serveApp(ctx, oi, out); errs[i] != nil {
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// goProcsPerStack gives the Go runtime one processor per stack, at most
// as many as it has, unless GOMAXPROCS is set in the environment, and
// reports the count and whether it set it. A request crosses several
// goroutines of one stack (the receive loop, gVisor's TCP processor, the
// connection's own): on one processor each hand-off is a switch on the
// same core with warm caches; on several, goroutines wake one another
// across cores, idle processors spin looking for work, and the stack's
// shared locks and counters move between caches. On two vCPUs beside the
// daemon the serving rate rose by about a sixth (docs/performance.md, one
// Go processor per stack).
func goProcsPerStack(stacks int) (int, bool) {
	if os.Getenv("GOMAXPROCS") != "" {
		return runtime.GOMAXPROCS(0), false
	}
	n := min(stacks, runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(n)
	return n, true
}

// maxStacks bounds --stacks: each stack holds a stream, a control
// connection and its goroutines.
const maxStacks = 256

// prefixedLines writes each line after prefix into w, which writers
// sharing mu (the stacks of one process) write to as well.
type prefixedLines struct {
	mu     *sync.Mutex
	w      io.Writer
	prefix string
}

func (p prefixedLines) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for rest := b; len(rest) > 0; {
		line := rest
		if i := bytes.IndexByte(rest, '\n'); i >= 0 {
			line = rest[:i+1]
		}
		rest = rest[len(line):]
		if _, err := io.WriteString(p.w, p.prefix); err != nil {
			return 0, err
		}
		if _, err := p.w.Write(line); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

// logLinkStats is the application's last line: what its stack's links
// moved, and what the receive and transmit paths saved or refused.
func logLinkStats(w io.Writer, kind string, s userstack.LinkStats) {
	fmt.Fprintf(w, "%s: link: received %d packets in %d batches (%d pure ACKs superseded, %d bad checksums, %d not IP, %d from its own address); sent %d packets in %d batches (%d pure ACKs delayed, %d of them absorbed; %d dropped), %d to itself\n",
		kind, s.RxPackets, s.RxBatches, s.RxAcksSuperseded, s.RxBadChecksum, s.RxNotIP, s.RxFromSelf, s.TxPackets, s.TxBatches, s.AcksDelayed, s.AcksAbsorbed, s.TxDropped, s.TxLooped)
}

// drainApp has every bridge send st no new connections and waits until
// conns are all closed or timeout passes.
func drainApp(st *userstack.Stack, conns *openConns, timeout time.Duration, w io.Writer, kind string) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	n, _ := conns.open()
	fmt.Fprintf(w, "%s: draining: the bridges are to send no new connections; %d open, served until they end or %v passes\n", kind, n, timeout)
	ctx, cancel := context.WithTimeout(context.Background(), min(timeout, drainRequestTimeout))
	err := st.Drain(ctx)
	cancel()
	if err != nil {
		// The open connections are served all the same.
		fmt.Fprintf(w, "%s: drain: %v\n", kind, err)
	}
wait:
	for {
		n, none := conns.open()
		if n == 0 {
			break
		}
		select {
		case <-none: // one may have opened since: look again
		case <-deadline.C:
			break wait
		}
	}
	n, _ = conns.open()
	fmt.Fprintf(w, "%s: drained, %d connections left\n", kind, n)
}

// drainRequestTimeout bounds the drain's requests to the bridges.
const drainRequestTimeout = 10 * time.Second

// openConns counts an application's open connections, for a drain to wait
// on.
type openConns struct {
	mu   sync.Mutex
	n    int
	none chan struct{} // closed while n is 0
}

func newOpenConns() *openConns {
	c := &openConns{none: make(chan struct{})}
	close(c.none)
	return c
}

// add counts d more open connections (d < 0: fewer).
func (c *openConns) add(d int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == 0 && d > 0 {
		c.none = make(chan struct{})
	}
	c.n += d
	if c.n == 0 && d < 0 {
		close(c.none)
	}
}

// open is the number of open connections and a channel closed once there
// are none.
func (c *openConns) open() (int, <-chan struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n, c.none
}

// logBridgeEvent tells the operator that the bridge went away or came
// back, or that a claim did not survive its absence.
// With several bridges, each line names the bridge.
func logBridgeEvent(w io.Writer, kind string, e userstack.Event) {
	bridge := "bridge"
	if e.Bridge != "" {
		bridge += " " + e.Bridge
	}
	switch e.Kind {
	case userstack.BridgeLost:
		fmt.Fprintf(w, "%s: %s lost, reconnecting (connections wait): %v\n", kind, bridge, e.Err)
	case userstack.BridgeBack:
		fmt.Fprintf(w, "%s: %s back after %v\n", kind, bridge, e.Down.Round(time.Millisecond))
	default:
		fmt.Fprintf(w, "%s: %v\n", kind, e)
	}
}

// movesSending reports whether an event of kind k may change the bridge
// a stack of several sends through.
func movesSending(k userstack.EventKind) bool {
	switch k {
	case userstack.BridgeLost, userstack.BridgeBack, userstack.BridgeUnresponsive, userstack.BridgeResponsive:
		return true
	}
	return false
}

// logSending says which of several bridges the stack sends through now.
func logSending(w io.Writer, kind string, bridges []userstack.BridgeState) {
	for _, b := range bridges {
		if b.Sending {
			fmt.Fprintf(w, "%s: sending through bridge %s\n", kind, b.Name)
			return
		}
	}
	fmt.Fprintf(w, "%s: no bridge up, sending nowhere (connections wait)\n", kind)
}

// httpCounters are what the HTTP application served.
type httpCounters struct {
	Requests, Bytes atomic.Int64
}

// httpHandler answers GET / with size bytes and GET /bytes/N with N.
func httpHandler(size int, c *httpCounters) http.Handler { return httpHandlerPaced(size, 0, c) }

// httpHandlerPaced is httpHandler sending /bytes/N at rate bytes a second
// at most (0: as fast as the connection takes them), so that a download
// can be made to last.
func httpHandlerPaced(size int, rate float64, c *httpCounters) http.Handler {
	body := []byte(strings.Repeat("fabricbridge ", size/13+1)[:size])
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		n, _ := w.Write(body)
		c.Requests.Add(1)
		c.Bytes.Add(int64(n))
	})
	mux.HandleFunc("GET /bytes/{n}", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.PathValue("n"))
		if err != nil || n < 0 || n > 1<<30 {
			http.Error(w, "want /bytes/N with N up to 1 GiB", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(n))
		chunk := []byte(strings.Repeat("x", 64<<10))
		sent, start := 0, time.Now()
		for sent < n {
			k, err := w.Write(chunk[:min(len(chunk), n-sent)])
			sent += k
			if err != nil {
				break
			}
			if rate > 0 {
				time.Sleep(time.Duration(float64(sent)/rate*float64(time.Second)) - time.Since(start))
			}
		}
		c.Requests.Add(1)
		c.Bytes.Add(int64(sent))
	})
	return mux
}

// serveHTTP serves until ctx ends, /bytes/N at rate bytes a second at most
// (0: no limit); counters, if not nil, count what it served.
func serveHTTP(ctx context.Context, st *userstack.Stack, listen string, size int, rate float64, log io.Writer, counters *httpCounters, conns *openConns) error {
	ln, err := st.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("http: listen %s: %w", listen, err)
	}
	if counters == nil {
		counters = &httpCounters{}
	}
	srv := &http.Server{Handler: httpHandlerPaced(size, rate, counters), ReadHeaderTimeout: 10 * time.Second,
		ConnState: func(_ net.Conn, s http.ConnState) {
			switch s {
			case http.StateNew:
				conns.add(1)
			case http.StateClosed, http.StateHijacked:
				conns.add(-1)
			}
		}}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	fmt.Fprintf(log, "http: serving on %s\n", ln.Addr())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	fmt.Fprintf(log, "http: %d requests, %d bytes served\n", counters.Requests.Load(), counters.Bytes.Load())
	return nil
}

func serveEcho(ctx context.Context, st *userstack.Stack, listen string, udp bool, log io.Writer, conns *openConns) error {
	return serveStream(ctx, st, listen, udp, log, conns, "echo", func(c net.Conn) { io.Copy(c, c) }, func(pc net.PacketConn) {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(buf[:n], from)
		}
	})
}

func serveSink(ctx context.Context, st *userstack.Stack, listen string, udp bool, every time.Duration, log io.Writer, conns *openConns) error {
	var bytes, packets atomic.Int64
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		last, start := int64(0), time.Now()
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				b := bytes.Load()
				fmt.Fprintf(log, "sink: %.1f Mbit/s (%d bytes, %d datagrams in all)\n", float64(b-last)*8/now.Sub(start).Seconds()/1e6, b, packets.Load())
				last, start = b, now
			}
		}
	}()
	return serveStream(ctx, st, listen, udp, log, conns, "sink", func(c net.Conn) { sinkConn(c, &bytes) }, func(pc net.PacketConn) {
		buf := make([]byte, 65536)
		for {
			n, _, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			bytes.Add(int64(n))
			packets.Add(1)
		}
	})
}

// sinkConn reads c to its end, adding each read to n as it arrives: the
// rate printed every --every is then the rate of the transfer, not of the
// connections that closed.
func sinkConn(c net.Conn, n *atomic.Int64) {
	buf := make([]byte, 64<<10)
	for {
		k, err := c.Read(buf)
		n.Add(int64(k))
		if err != nil {
			return
		}
	}
}

// serveStream accepts TCP connections (and, with udp, datagrams on the same
// port) until ctx ends, counting the open ones in conns.
func serveStream(ctx context.Context, st *userstack.Stack, listen string, udp bool, log io.Writer, conns *openConns, name string, conn func(net.Conn), packets func(net.PacketConn)) error {
	ln, err := st.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("%s: listen %s: %w", name, listen, err)
	}
	defer ln.Close()
	if udp {
		pc, err := st.ListenPacket("udp", listen)
		if err != nil {
			return fmt.Errorf("%s: listen udp %s: %w", name, listen, err)
		}
		defer pc.Close()
		go packets(pc)
	}
	go func() {
		<-ctx.Done()
		ln.Close()
	}()
	fmt.Fprintf(log, "%s: serving on %s%s\n", name, ln.Addr(), map[bool]string{true: " (tcp and udp)", false: ""}[udp])
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		conns.add(1)
		go func() {
			defer conns.add(-1)
			defer c.Close()
			conn(c)
		}()
	}
}
