package appliance

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
)

// Probes for what orchestrators and load balancers ask of a daemon:
// /healthz, is it alive (restart it if not), and /readyz, can it serve
// (send it traffic, announce it, if so).

var famReady = metrics.Family{Name: "fabricbridge_ready", Type: metrics.Gauge,
	Help: "1 while the box can serve, as GET /readyz answers 200: the data path attached to the interface and the control plane listening."}

// probeTimeout bounds how long a collection of the daemon's state may
// take before /healthz calls the daemon wedged: collecting takes the locks
// that the data plane's and control plane's loops take.
const probeTimeout = 2 * time.Second

// liveness tracks the daemon's long-running loops and the collection that
// probes them.
type liveness struct {
	mu      sync.Mutex
	running map[string]bool
	ended   map[string]error
	probing chan struct{} // closed when the probe in flight ends; nil when none is
}

// started records that the named loop runs.
func (l *liveness) started(name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.running == nil {
		l.running, l.ended = map[string]bool{}, map[string]error{}
	}
	l.running[name] = true
	delete(l.ended, name)
}

// stopped records that the named loop ended, and why (nil: it was closed).
func (l *liveness) stopped(name string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.running, name)
	l.ended[name] = err
}

func (l *liveness) isRunning(name string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.running[name]
}

// failures describes each loop that ended.
func (l *liveness) failures() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, name := range sortedKeys(l.ended) {
		err := l.ended[name]
		if err == nil {
			err = errors.New("closed")
		}
		out = append(out, fmt.Sprintf("control listener %s ended: %v", name, err))
	}
	return out
}

// probe runs collect and waits up to probeTimeout for it. A collection
// that does not return is left to finish, and no other starts meanwhile:
// a wedged daemon costs one goroutine, not one per probe.
func (l *liveness) probe(collect func(*metrics.Writer)) error {
	l.mu.Lock()
	done := l.probing
	if done == nil {
		done = make(chan struct{})
		l.probing = done
		go func() {
			collect(metrics.NewWriter())
			l.mu.Lock()
			l.probing = nil
			l.mu.Unlock()
			close(done)
		}()
	}
	l.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-time.After(probeTimeout):
		return fmt.Errorf("collecting the daemon's state took over %v: a loop holds a lock", probeTimeout)
	}
}

// attachment is a data plane that can say whether it holds the interface.
type attachment interface {
	// attachedPath is the data path in use (native-zerocopy, ..., afpacket);
	// ok is false once the plane has let the interface go.
	attachedPath() (path string, ok bool)
}

func (p *bridgePlane) attachedPath() (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.b.Mode(), !p.closed
}

// health says why the daemon is not alive, or nothing.
func (d *Daemon) health() []string {
	why := d.live.failures()
	if err := d.live.probe(d.collect); err != nil {
		why = append(why, err.Error())
	}
	return why
}

// readiness says why the box cannot serve, or nothing; on success, ok
// says how it serves.
func (d *Daemon) readiness() (why []string, ok string) {
	ifname := d.Config().Interfaces[0].Name
	path, attached := "", false
	if a, isA := d.plane.(attachment); isA {
		path, attached = a.attachedPath()
	}
	if !attached {
		why = append(why, "data path not attached to "+ifname)
	}
	listeners := []string{"unix"}
	if d.tcpLn != nil {
		listeners = append(listeners, "tcp")
	}
	for _, l := range listeners {
		if !d.live.isRunning(l) {
			why = append(why, "control plane not listening on "+l)
		}
	}
	return why, fmt.Sprintf("data path %s on %s, control plane listening on %s", path, ifname, strings.Join(listeners, " and "))
}

func writeProbe(w http.ResponseWriter, why []string, ok string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if len(why) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, strings.Join(why, "\n"))
		return
	}
	fmt.Fprintln(w, ok)
}

func (d *Daemon) serveHealthz(w http.ResponseWriter, r *http.Request) {
	writeProbe(w, d.health(), "ok")
}

// serveReadyz answers 200 only while the box can serve and the daemon is
// alive: a wedged daemon attached to its interface serves nobody.
func (d *Daemon) serveReadyz(w http.ResponseWriter, r *http.Request) {
	why, ok := d.readiness()
	why = append(why, d.health()...)
	writeProbe(w, slices.Compact(why), "ready: "+ok)
}

// collectServing is what /metrics serves: the daemon's metrics and its
// readiness. The scrape itself probes liveness (one that hangs fails).
func (d *Daemon) collectServing(w *metrics.Writer) {
	d.collect(w)
	ready := 0.0
	if why, _ := d.readiness(); len(why) == 0 {
		ready = 1
	}
	w.Add(famReady, ready)
}
