package appliance

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/capture"
	"github.com/fabricbridge/fabricbridge/appliance/config"
)

// The admin socket serves the operator's tools over HTTP on a Unix socket
// that only root may open (mode 0600): what the metrics address serves
// (metrics, health, the read-only API), and /capture, which streams a pcap
// of one application stream. Captures are not offered on the metrics
// address because that one may listen on the network and packets are the
// applications' data; nor is anything that changes state.

// tapper is a data plane that can capture a stream.
type tapper interface {
	Tap(id uint32, see func(capture.Direction, time.Time, []byte)) (stop func(), gone <-chan struct{}, err error)
}

func (d *Daemon) startAdmin(cfg *config.Config) error {
	path := cfg.Control.AdminSocket
	if removed, err := removeStaleSocket(path); err != nil {
		return cfg.Errorf("control.admin_socket", "%v", err)
	} else if removed {
		d.log.Warn("removed a stale admin socket left by a crashed daemon", "path", path)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return cfg.Errorf("control.admin_socket", "%v", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return cfg.Errorf("control.admin_socket", "%v", err)
	}
	mux := http.NewServeMux()
	d.routeReadOnly(mux)
	mux.HandleFunc("/capture", d.serveCapture)
	d.admin = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go d.admin.Serve(ln)
	d.log.Info("admin socket", "path", path)
	return nil
}

// streamByName resolves a stream given by id or application name.
func (d *Daemon) streamByName(name string) (uint32, string, error) {
	apps := d.Apps()
	var names []string
	for _, a := range apps {
		if a.Name == name || strconv.FormatUint(uint64(a.Stream), 10) == name {
			return a.Stream, a.Name, nil
		}
		names = append(names, fmt.Sprintf("%s (stream %d)", a.Name, a.Stream))
	}
	if len(names) == 0 {
		return 0, "", fmt.Errorf("no stream %q: no application is connected", name)
	}
	return 0, "", fmt.Errorf("no stream %q; connected: %s", name, strings.Join(names, ", "))
}

// serveCapture streams a pcap of one stream until the client goes, the
// count is reached or the application disconnects. The last line of the
// story is the Fabricbridge-Capture-Summary trailer.
func (d *Daemon) serveCapture(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	filter, err := capture.ParseFilter(q.Get("filter"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var opts capture.Options
	opts.Filter = filter
	for _, f := range []struct {
		name string
		to   *int
	}{{"count", &opts.Count}, {"snaplen", &opts.Snaplen}} {
		if v := q.Get(f.name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				http.Error(w, fmt.Sprintf("%s=%q is not a count", f.name, v), http.StatusBadRequest)
				return
			}
			*f.to = n
		}
	}
	id, app, err := d.streamByName(q.Get("stream"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	}
	tp, ok := d.plane.(tapper)
	if !ok {
		http.Error(w, "this data plane cannot capture", http.StatusNotImplemented)
		return
	}
	sess := capture.NewSession(opts)
	stop, gone, err := tp.Tap(id, sess.Packet)
	if err != nil {
		http.Error(w, err.Error(), http.StatusConflict)
		return
	}
	defer stop()
	d.log.Info("capture started", "stream", id, "app", app, "filter", filter.String(), "count", opts.Count)
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	go func() {
		select {
		case <-gone:
			cancel()
		case <-ctx.Done():
		}
	}()
	w.Header().Set("Content-Type", "application/vnd.tcpdump.pcap")
	w.Header().Set("Trailer", "Fabricbridge-Capture-Summary")
	w.WriteHeader(http.StatusOK)
	flush := func() {
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
	}
	err = sess.Run(ctx, w, flush)
	w.Header().Set("Fabricbridge-Capture-Summary", sess.Summary())
	d.log.Info("capture ended", "stream", id, "app", app, "summary", sess.Summary(), "error", err)
}
