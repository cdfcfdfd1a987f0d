package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// The sample applications run on a user-space stack over a stream of the
// bridge: for trying the bridge out and for benchmarks.

const appUsage = `usage: fabricbridge app http|echo|sink|trigger [flags]

  http     serve HTTP: GET / answers --size bytes, GET /bytes/N answers N bytes
           (at --rate Mbit/s at most, if given)
  echo     TCP echo (and UDP echo with --udp)
  sink     discard TCP (and UDP with --udp), print the rate every --every
  trigger  consume an ingest ring, on the CPU or with --gpu (app trigger -h)

flags (all applications):
  --name NAME          application name, as the bridge's configuration knows it
  --listen HOST:PORT   where to listen (default :80 for http, :7 echo, :9 sink)
  --config FILE        the bridge's configuration, for its control socket
  --control PATH       the bridge's control socket (overrides --config)
  --remote HOST:PORT   a bridge on another node (control over TCP, stream over GENEVE)
  --secret-file FILE   the secret shared with that bridge (required with --remote)
  --tls-cert FILE      client certificate, for a bridge with auth: tls (with --tls-key)
  --tls-key FILE       its private key
  --tls-ca FILE        the CA that signed the bridge's certificate (default: system roots)
  --tls-server-name N  the name to check in the bridge's certificate (default: the
                       host of --remote, an IP address checked against its IP SANs)
  --mtu N              largest IP packet the stack sends; with --remote, at most the
                       link MTU towards the bridge minus 36 (GENEVE): 1464 on 1500
`

type appOptions struct {
	kind, name, listen string
	stack              userstack.Options
	size               int
	rateMbit           float64
	udp                bool
	every              time.Duration
}

func parseApp(args []string) (appOptions, error) {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return appOptions{}, errors.New(appUsage)
	}
	o := appOptions{kind: args[0]}
	defaults := map[string]string{"http": ":80", "echo": ":7", "sink": ":9"}
	listen, ok := defaults[o.kind]
	if !ok {
		return o, fmt.Errorf("app: unknown application %q\n\n%s", o.kind, appUsage)
	}
	fs := flag.NewFlagSet("app "+o.kind, flag.ContinueOnError)
	fs.StringVar(&o.name, "name", o.kind, "application name")
	fs.StringVar(&o.listen, "listen", listen, "address to listen on")
	cfgPath := fs.String("config", "", "the bridge's configuration (default "+DefaultConfig+")")
	control := fs.String("control", "", "the bridge's control socket")
	remote := fs.String("remote", "", "a remote bridge's control address")
	secretFile := fs.String("secret-file", "", "the secret shared with the remote bridge")
	var tlsFiles clientTLSFiles
	fs.StringVar(&tlsFiles.cert, "tls-cert", "", "client certificate for a bridge with auth: tls")
	fs.StringVar(&tlsFiles.key, "tls-key", "", "the client certificate's key")
	fs.StringVar(&tlsFiles.ca, "tls-ca", "", "CA of the bridge's certificate")
	fs.StringVar(&tlsFiles.serverName, "tls-server-name", "", "name to check in the bridge's certificate")
	fs.IntVar(&o.stack.MTU, "mtu", 0, "largest IP packet the stack sends")
	fs.IntVar(&o.size, "size", 4096, "http: bytes of the answer to GET /")
	fs.Float64Var(&o.rateMbit, "rate", 0, "http: pace answers to GET /bytes/N to this many Mbit/s (0: no limit)")
	fs.BoolVar(&o.udp, "udp", false, "echo, sink: serve UDP on the same port too")
	fs.DurationVar(&o.every, "every", 5*time.Second, "sink: how often to print the rate")
	if err := fs.Parse(args[1:]); err != nil {
		return o, err
	}
	if fs.NArg() > 0 || o.size < 0 || o.every <= 0 || o.stack.MTU < 0 || o.rateMbit < 0 {
		return o, errors.New(appUsage)
	}
	o.stack.App = o.name
	if *remote == "" && (*secretFile != "" || tlsFiles != clientTLSFiles{}) {
		return o, errors.New("app: --secret-file and --tls-* go with --remote")
	}
	switch {
	case *remote != "":
		if *secretFile == "" {
			return o, errors.New("app: --remote needs --secret-file")
		}
		secret, err := os.ReadFile(*secretFile)
		if err != nil {
			return o, fmt.Errorf("app: --secret-file: %w", err)
		}
		o.stack.Remote = &userstack.RemoteOptions{Control: *remote, Secret: []byte(strings.TrimRight(string(secret), "\r\n"))}
		if tlsFiles != (clientTLSFiles{}) {
			if o.stack.Remote.TLS, err = tlsFiles.config(*remote); err != nil {
				return o, err
			}
		}
	case *control != "":
		o.stack.Control = *control
	default:
		path := *cfgPath
		if path == "" {
			path = DefaultConfig
		}
		if _, err := os.Stat(path); err != nil && *cfgPath == "" {
			o.stack.Control = config.DefaultSocket
			break
		}
		c, err := config.Load(path)
		if err != nil {
			return o, err
		}
		o.stack.Control = c.Control.Socket
	}
	return o, nil
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

func appCommand(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) > 0 && args[0] == "trigger" {
		return triggerCommand(ctx, args[1:], stdout)
	}
	o, err := parseApp(args)
	if err != nil {
		return err
	}
	o.stack.Events = func(e userstack.Event) { logBridgeEvent(stdout, o.kind, e) }
	st, err := userstack.Open(ctx, o.stack)
	if err != nil {
		return fmt.Errorf("app %s: %w", o.kind, err)
	}
	defer st.Close()
	fmt.Fprintf(stdout, "%s: application %q on a user-space stack, addresses %v\n", o.kind, o.name, st.Addrs())
	switch o.kind {
	case "http":
		return serveHTTP(ctx, st, o.listen, o.size, o.rateMbit*1e6/8, stdout, nil)
	case "echo":
		return serveEcho(ctx, st, o.listen, o.udp, stdout)
	default:
		return serveSink(ctx, st, o.listen, o.udp, o.every, stdout)
	}
}

// logBridgeEvent tells the operator that the bridge went away or came
// back, or that a claim did not survive its absence.
func logBridgeEvent(w io.Writer, kind string, e userstack.Event) {
	switch e.Kind {
	case userstack.BridgeLost:
		fmt.Fprintf(w, "%s: bridge lost, reconnecting (connections wait): %v\n", kind, e.Err)
	case userstack.BridgeBack:
		fmt.Fprintf(w, "%s: bridge back after %v\n", kind, e.Down.Round(time.Millisecond))
	default:
		fmt.Fprintf(w, "%s: %v\n", kind, e)
	}
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
func serveHTTP(ctx context.Context, st *userstack.Stack, listen string, size int, rate float64, log io.Writer, counters *httpCounters) error {
	ln, err := st.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("http: listen %s: %w", listen, err)
	}
	if counters == nil {
		counters = &httpCounters{}
	}
	srv := &http.Server{Handler: httpHandlerPaced(size, rate, counters), ReadHeaderTimeout: 10 * time.Second}
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

func serveEcho(ctx context.Context, st *userstack.Stack, listen string, udp bool, log io.Writer) error {
	return serveStream(ctx, st, listen, udp, log, "echo", func(c net.Conn) { io.Copy(c, c) }, func(pc net.PacketConn) {
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

func serveSink(ctx context.Context, st *userstack.Stack, listen string, udp bool, every time.Duration, log io.Writer) error {
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
	return serveStream(ctx, st, listen, udp, log, "sink", func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		bytes.Add(n)
	}, func(pc net.PacketConn) {
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

// serveStream accepts TCP connections (and, with udp, datagrams on the same
// port) until ctx ends.
func serveStream(ctx context.Context, st *userstack.Stack, listen string, udp bool, log io.Writer, name string, conn func(net.Conn), packets func(net.PacketConn)) error {
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
		go func() {
			defer c.Close()
			conn(c)
		}()
	}
}
