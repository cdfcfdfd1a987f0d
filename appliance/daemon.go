package appliance

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"reflect"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/announce"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Options are the daemon's settings that do not come from the file.
type Options struct {
	// Log receives the structured log; nil means standard error in the
	// configured format.
	Log io.Writer
	// BPFFS is where a bpf file system is mounted ("": DefaultBPFFS). The
	// daemon pins its XDP link and tables under BPFFS/fabricbridge/NETNS/
	// INTERFACE, so that they keep steering while it restarts (Handover)
	// and the next daemon takes them over. Without a bpf file system
	// there, nothing is kept, and a warning says so.
	BPFFS string
	// Release has Run give everything back when it stops (Close), for a
	// final shutdown, instead of leaving the data path steering for the
	// next daemon (Handover).
	Release bool
}

// HoldGrace is how long a daemon keeps the flows and listeners it took over
// from its predecessor for their applications to claim again. Their
// frames are dropped meanwhile (the applications' TCP retransmits them);
// afterwards, unclaimed ones go to the kernel, which resets them: their
// applications did not come back. Applications on this host come back
// within milliseconds of the control socket, remote ones within a second.
const HoldGrace = 10 * time.Second

// holdGrace is HoldGrace, shorter in tests.
var holdGrace = HoldGrace

// Daemon is a running fabricbridge.
type Daemon struct {
	log     *slog.Logger
	level   *slog.LevelVar
	home    home
	lock    *runLock
	plane   dataplane
	ingest  *ingestPlane
	server  *control.Server
	unixLn  *net.UnixListener
	tcpLn   net.Listener
	remote  *fabric.Remote
	cfg     atomic.Pointer[config.Config]
	serving sync.WaitGroup
	metrics *http.Server
	admin   *http.Server
	metAddr net.Addr
	started time.Time
	live    liveness

	// announcer tells the routers this box serves the addresses while
	// up holds (bgp.go); nil without a bgp section.
	announcer *announce.Announcer
	up        atomic.Bool

	// pinDir is where the data path is pinned for the next daemon; "":
	// nothing is kept across a restart.
	pinDir    string
	adopted   bool // the data path took over a predecessor's program or tables
	holdTimer *time.Timer

	reserved   *classifier.PortSet
	portRecord string // where the ports this daemon reserved are recorded
	netns      uint64 // the home namespace's inode, in the record

	mu        sync.Mutex // serialises Reload and Close
	closed    bool
	reloadsOK atomic.Uint64
	reloadsKO atomic.Uint64
	refused   reasonCounts // configuration files refused on SIGHUP, by config.Reason
}

// NewLogger builds the configured structured logger; level is adjustable
// afterwards (a reload changes it).
func NewLogger(w io.Writer, c config.Log) (*slog.Logger, *slog.LevelVar) {
	lv := &slog.LevelVar{}
	lv.Set(slog.Level(c.Level))
	o := &slog.HandlerOptions{Level: lv}
	if c.Format == config.LogJSON {
		return slog.New(slog.NewJSONHandler(w, o)), lv
	}
	return slog.New(slog.NewTextHandler(w, o)), lv
}

// Start brings the daemon up in the calling thread's network namespace:
// clears a crashed predecessor's leftovers, reserves the applications' port
// range, attaches the data plane to the interfaces, installs the rules,
// opens the control plane (the Unix socket, and TCP with the remote
// transport if configured) and starts the metrics endpoint. On error
// everything already done is undone.
func Start(cfg *config.Config, opts Options) (_ *Daemon, err error) {
	out := opts.Log
	if out == nil {
		out = os.Stderr
	}
	d := &Daemon{started: time.Now()}
	d.log, d.level = NewLogger(out, cfg.Log)
	if d.home, err = captureHome(); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			// What a predecessor left steering stays for the next try.
			d.shutdown(d.adopted)
		}
	}()

	if d.lock, err = lockRun(cfg.Control.Socket); err != nil {
		return nil, err
	}
	if removed, err := removeStaleSocket(cfg.Control.Socket); err != nil {
		return nil, err
	} else if removed {
		d.log.Warn("removed a stale control socket left by a crashed daemon", "path", cfg.Control.Socket)
	}
	d.portRecord = cfg.Control.Socket + ".ports"
	d.netns = netnsID()
	if bpffs := cmp.Or(opts.BPFFS, DefaultBPFFS); ebpf.IsBPFFS(bpffs) {
		if pins, err := sweepPins(pinRoot(bpffs)); err != nil {
			return nil, fmt.Errorf("sweep %s: %w", pinRoot(bpffs), err)
		} else if len(pins) > 0 {
			d.log.Warn("removed the pinned XDP programs of interfaces that are gone", "paths", pins)
		}
		d.pinDir = pinDir(bpffs, d.netns, cfg.Interfaces[0].Name)
	} else {
		d.log.Warn("no bpf file system: steering stops while the daemon restarts, and peers' packets to applications are reset meanwhile", "bpffs", bpffs)
	}
	if d.reserved, err = d.reserve(cfg); err != nil {
		return nil, err
	}
	d.log.Info("reserved ports for applications' outgoing connections", "range", cfg.ReservedPorts.String(), "added", d.reserved.String())

	bp, err := openBridge(cfg, d.log, d.pinDir)
	if err != nil {
		return nil, err
	}
	d.plane = bp
	d.adopt(bp)
	if d.ingest, err = openIngest(cfg, bp.b, d.log); err != nil {
		return nil, err
	}
	d.cfg.Store(cfg)
	if cfg.Control.TCP.Address != "" {
		if d.tcpLn, d.remote, err = listenTCP(cfg); err != nil {
			return nil, err
		}
	}
	cc, err := controlConfig(cfg, d.plane, d.remote, d.log)
	if err != nil {
		return nil, err
	}
	if d.server, err = control.NewServer(cc); err != nil {
		return nil, fmt.Errorf("install rules: %w", err)
	}
	bp.followMTU(d.server.SetMTU)
	d.log.Info("rules installed", "rules", len(cc.Static.Rules), "application_entries", len(cfg.Listeners)+len(cfg.Rules)-len(cc.Static.Rules))
	if d.unixLn, err = listenUnix(cfg); err != nil {
		return nil, err
	}
	d.serve("unix", func() error { return d.server.ServeLocal(d.unixLn) })
	d.log.Info("control socket", "path", cfg.Control.Socket, "mode", fmt.Sprintf("%04o", cfg.Control.SocketMode))
	if d.tcpLn != nil {
		d.serve("tcp", func() error { return d.server.ServeRemote(d.tcpLn) })
		d.log.Info("remote control plane", "address", d.tcpLn.Addr().String(), "auth", cfg.Control.TCP.Auth.String(), "geneve", d.remote.LocalAddr().String())
	}

	if err := d.startAdmin(cfg); err != nil {
		return nil, err
	}
	if cfg.Metrics.Address != "" {
		ln, err := net.Listen("tcp", string(cfg.Metrics.Address))
		if err != nil {
			return nil, metricsAddrErr(cfg, d.peers(cfg), err)
		}
		d.metAddr = ln.Addr()
		mux := http.NewServeMux()
		d.routeReadOnly(mux)
		d.metrics = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go d.metrics.Serve(ln)
		d.log.Info("metrics", "address", "http://"+ln.Addr().String()+"/metrics")
	}
	d.up.Store(true)
	if err := d.startAnnounce(cfg); err != nil {
		return nil, err
	}
	d.log.Info("fabricbridge running", "config", cfg.File, "interfaces", len(cfg.Interfaces), "pid", os.Getpid())
	return d, nil
}

// serve runs a control listener's accept loop; it ends when the listener
// is closed.
func (d *Daemon) serve(name string, loop func() error) {
	d.serving.Add(1)
	d.live.started(name)
	go func() {
		defer d.serving.Done()
		err := loop()
		d.live.stopped(name, err)
		if err != nil {
			d.log.Error("control listener failed", "listener", name, "error", err)
		}
	}()
}

// MetricsAddr is where /metrics is served, or nil.
func (d *Daemon) MetricsAddr() net.Addr { return d.metAddr }

// ControlAddr is the remote control plane's TCP address, or nil.
func (d *Daemon) ControlAddr() net.Addr {
	if d.tcpLn == nil {
		return nil
	}
	return d.tcpLn.Addr()
}

// Config returns the configuration in force.
func (d *Daemon) Config() *config.Config { return d.cfg.Load() }

// Apps lists the applications connected to the control plane.
func (d *Daemon) Apps() []control.AppInfo {
	if d.server == nil {
		return nil
	}
	return d.server.Apps()
}

// restartOnly lists the sections a reload cannot change: they size or bind
// resources that live as long as the daemon.
var restartOnly = []struct {
	field string
	get   func(*config.Config) any
}{
	{"interfaces", func(c *config.Config) any { return c.Interfaces }},
	{"addresses", func(c *config.Config) any { return c.Addresses }},
	{"reserved_ports", func(c *config.Config) any { return c.ReservedPorts }},
	{"streams", func(c *config.Config) any { return c.Streams }},
	{"ingest", func(c *config.Config) any { return c.Ingest }},
	{"control", func(c *config.Config) any { return c.Control }},
	{"metrics", func(c *config.Config) any { return c.Metrics }},
	{"applications", func(c *config.Config) any { return c.Applications }},
	{"default_quota", func(c *config.Config) any { return c.DefaultQuota }},
	{"bgp", func(c *config.Config) any { return c.BGP }},
	{"spread", func(c *config.Config) any { return c.Spread }},
}

// Reload applies a new configuration's rules and log settings in one atomic
// table swap. Established flows and the listeners applications registered
// are untouched. Sections that only a restart can change are kept and named
// in the log (applications and quotas among them: the control server takes
// policies at start); a changed ingest section refuses the reload, because
// the new rules may name rings that do not exist. On error nothing changes.
func (d *Daemon) Reload(next *config.Config) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("reload: the daemon is shut down")
	}
	cur := d.Config()
	merged := *cur
	merged.File = next.File
	merged.Listeners, merged.Rules, merged.Log = next.Listeners, next.Rules, next.Log
	var kept []string
	for _, s := range restartOnly {
		if !reflect.DeepEqual(s.get(cur), s.get(next)) {
			kept = append(kept, s.field)
		}
	}
	for _, f := range kept {
		if f == "ingest" || f == "applications" {
			d.reloadsKO.Add(1)
			return fmt.Errorf("reload: the %s section changed; that needs a restart (rules were not changed)", f)
		}
	}
	if err := d.server.SetStatic(static(&merged)); err != nil {
		d.reloadsKO.Add(1)
		return fmt.Errorf("reload: %w", err)
	}
	d.cfg.Store(&merged)
	d.level.Set(slog.Level(next.Log.Level))
	d.reloadsOK.Add(1)
	if len(kept) > 0 {
		d.log.Warn("reload: these sections changed but take effect only after a restart", "sections", kept)
	}
	d.log.Info("reloaded", "config", next.File, "listeners", len(next.Listeners), "rules", len(next.Rules))
	return nil
}

// Close shuts the daemon down for good: stops the metrics endpoint, detaches
// the data plane from every interface (removing its pins), returns the
// reserved ports and removes the control socket and lock.
func (d *Daemon) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	err := d.shutdown(false)
	d.log.Info("fabricbridge stopped", "error", err)
	return err
}

// Handover shuts the daemon down for a restart: like Close, but the data
// path keeps steering (its XDP program stays attached through its pinned
// link, with every claim in its tables, and drops what it steers while no
// daemon runs) and the reserved ports stay reserved, for the next daemon
// to take over. The applications lose their sessions and come back to the
// next daemon. Without a bpf file system (Options.BPFFS) it is Close.
func (d *Daemon) Handover() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	bp, _ := d.plane.(*bridgePlane)
	keep := d.pinDir != "" && bp != nil && bp.steersWithoutUs()
	err := d.shutdown(keep)
	if keep {
		d.log.Info("fabricbridge stopped; its data path keeps steering for the next daemon", "pins", d.pinDir, "error", err)
	} else {
		d.log.Info("fabricbridge stopped", "error", err)
	}
	return err
}

// adopt logs what the data path took over from the previous daemon and
// has the flows and listeners it holds for their applications released
// after HoldGrace.
func (d *Daemon) adopt(bp *bridgePlane) {
	a, ok := bp.b.Adoption()
	if !ok || d.pinDir == "" {
		return
	}
	if len(a.Replaced) > 0 {
		d.log.Warn("did not take over all of the previous daemon's data path", "pins", d.pinDir, "reason", a.Replaced)
	}
	if !a.Program && !a.Link && !a.Tables {
		return
	}
	d.adopted = true
	d.log.Info("took over the data path the previous daemon left steering", "pins", d.pinDir, "program", a.Program, "link", a.Link, "tables", a.Tables,
		"held_flows", a.HeldFlows, "held_listeners", a.HeldListeners, "grace", holdGrace.String())
	if a.HeldFlows+a.HeldListeners == 0 {
		return
	}
	d.holdTimer = time.AfterFunc(holdGrace, func() {
		flows, listeners, err := bp.releaseHeld()
		if err != nil {
			d.log.Debug("releasing the held entries", "error", err)
			return
		}
		d.log.Info("released the held flows and listeners no application claimed again", "flows", flows, "listeners", listeners)
	})
}

// shutdown stops everything Start started. With keep, the data path stays
// for the next daemon: it stops first, so that the sessions ending after
// it take nothing out of its tables, and the reserved ports stay reserved
// (the next daemon adopts the record, as after a crash).
func (d *Daemon) shutdown(keep bool) error {
	// Routers stop sending here before anything stops serving.
	errs := []error{d.stopAnnounce()}
	if d.holdTimer != nil {
		d.holdTimer.Stop()
	}
	if d.admin != nil {
		d.admin.Close() // captures in progress end here
	}
	if keep {
		errs = append(errs, d.ingest.Close()) // before the bridge: it shares the bridge's UMEMs
		if d.plane != nil {
			errs = append(errs, d.plane.Handover())
		}
	}
	if d.server != nil {
		// Ends every session: each application loses what it held, as if
		// it had disconnected, and its stream is closed.
		errs = append(errs, d.server.Close())
	}
	for _, l := range []io.Closer{d.unixLn, d.tcpLn} {
		if l != nil && !reflect.ValueOf(l).IsNil() {
			l.Close()
		}
	}
	d.serving.Wait()
	if d.remote != nil {
		errs = append(errs, d.remote.Close())
	}
	if d.metrics != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		errs = append(errs, d.metrics.Shutdown(ctx))
		cancel()
	}
	if !keep {
		errs = append(errs, d.ingest.Close()) // before the bridge: it shares the bridge's UMEMs
		if d.plane != nil {
			errs = append(errs, d.plane.Close())
		}
	}
	if d.reserved != nil && !keep {
		err := d.home.do(func() error { return unreservePorts(d.withoutPeers(d.reserved)) })
		if err == nil {
			os.Remove(d.portRecord)
		}
		errs = append(errs, err)
	}
	if d.lock != nil {
		d.lock.release()
	}
	if d.home.ns != 0 {
		d.home.close()
	}
	return errors.Join(errs...)
}

// Run is `fabricbridge run`: it starts the daemon from the file at path,
// reloads the file on SIGHUP, and shuts down when ctx ends (the caller
// ties ctx to SIGTERM and SIGINT).
func Run(ctx context.Context, path string, opts Options) error {
	cfg, err := config.LoadContext(ctx, path)
	if err != nil {
		return err
	}
	d, err := Start(cfg, opts)
	if err != nil {
		return err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	for {
		select {
		case <-ctx.Done():
			d.log.Info("shutting down", "reason", context.Cause(ctx), "release", opts.Release)
			if opts.Release {
				return d.Close()
			}
			return d.Handover()
		case <-hup:
			d.log.Info("SIGHUP: reloading", "config", path)
			next, err := config.LoadContext(ctx, path)
			if err != nil {
				d.reloadsKO.Add(1)
				d.refused.add(config.Reason(err))
			} else {
				err = d.Reload(next)
			}
			if err != nil {
				d.log.Error("reload failed; the running configuration is unchanged", "error", err)
			}
		}
	}
}
