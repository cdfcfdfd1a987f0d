package appliance

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/appliance/announce"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
)

// startAnnounce starts announcing the addresses to the configured BGP
// neighbours, if bgp is configured. The routers send traffic only while
// canServe holds: the data plane attached, the control plane up, and an
// application registered to take the traffic.
func (d *Daemon) startAnnounce(cfg *config.Config) error {
	b := cfg.BGP
	if b.ASN == 0 {
		return nil
	}
	if err := sameNamespaceAsProcess(); err != nil {
		return cfg.Errorf("bgp", "%v", err)
	}
	ac := announce.Config{
		ASN:           b.ASN,
		RouterID:      b.RouterID.Addr,
		ListenPort:    b.ListenPort,
		HoldTime:      time.Duration(b.HoldTime),
		WithdrawDelay: time.Duration(b.WithdrawDelay),
		Ready:         d.canServe,
		Logger:        d.log,
	}
	for _, n := range b.Neighbors {
		ac.Neighbors = append(ac.Neighbors, announce.Neighbor{Address: n.Address.Addr, ASN: n.ASN})
	}
	for _, a := range b.AnnouncedAddresses(cfg.Addresses) {
		ac.Addresses = append(ac.Addresses, a.Addr)
	}
	if b.BFD.Enabled {
		iv := time.Duration(b.BFD.Interval)
		ac.BFD = &announce.BFD{MinTx: iv, MinRx: iv, Multiplier: uint8(b.BFD.Multiplier)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	a, err := announce.Start(ctx, ac)
	if err != nil {
		return cfg.Errorf("bgp", "%v", err)
	}
	d.announcer = a
	d.log.Info("announcing over BGP while serving", "asn", b.ASN, "neighbors", len(b.Neighbors), "addresses", len(ac.Addresses), "bfd", b.BFD.Enabled)
	return nil
}

// canServe is the announcer's readiness: a router may send this box traffic
// only while the data plane and control plane are up and at least one
// application is registered and listening: one that has claimed a listener,
// or that a configured listener is for. An application that has only said
// hello would have its first connections answered by the kernel's RST.
func (d *Daemon) canServe() bool {
	if !d.up.Load() || d.server == nil || d.server.Settling() {
		return false
	}
	cfg := d.Config()
	for _, a := range d.server.Apps() {
		if a.Listeners > 0 {
			return true
		}
		for _, l := range cfg.Listeners {
			if l.App == a.Name {
				return true
			}
		}
	}
	return false
}

// stopAnnounce withdraws the addresses, waits withdraw_delay for the routers
// to move the traffic to the other boxes, and closes the BGP sessions. It
// runs first in shutdown, while the data plane still serves what is in
// flight.
func (d *Daemon) stopAnnounce() error {
	d.up.Store(false)
	if d.announcer == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute+10*time.Second)
	defer cancel()
	err := d.announcer.Stop(ctx)
	d.announcer = nil
	if err != nil {
		return fmt.Errorf("bgp: %w", err)
	}
	d.log.Info("withdrawn from the routers")
	return nil
}

// startNetNS is the network namespace the process started in, where every
// thread that no goroutine has locked is: that is where GoBGP's goroutines
// open their sockets. (The main thread's /proc/self/ns/net will not do: a
// test may lock the main thread into a namespace of its own.)
var startNetNS, startNetNSErr = threadNetNS()

func threadNetNS() (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Stat("/proc/thread-self/ns/net", &st)
	return st, err
}

// sameNamespaceAsProcess refuses a daemon started on a thread switched into
// another network namespace than its process's (as tests and the demo do):
// GoBGP opens its sockets from goroutines of its own, on any thread, so it
// would peer from the process's namespace, not the daemon's.
func sameNamespaceAsProcess() error {
	here, err := threadNetNS()
	if err = errors.Join(err, startNetNSErr); err != nil {
		return err
	}
	if here.Ino != startNetNS.Ino || here.Dev != startNetNS.Dev {
		return errors.New("the daemon runs in another network namespace than its process; the BGP speaker cannot follow it there (run the daemon in the namespace, e.g. with ip netns exec)")
	}
	return nil
}

var famAnnounced = metrics.Family{Name: "fabricbridge_bgp_announced", Type: metrics.Gauge,
	Help: "1 while the addresses are announced to the BGP neighbours (bgp configured, the box can serve), 0 while withdrawn."}

var famSession = metrics.Family{Name: "fabricbridge_bgp_session_up", Type: metrics.Gauge,
	Help: "1 while the BGP session with the neighbour is established (and, with bfd, BFD is up on it: kind bfd)."}

// collectAnnounce writes whether the addresses are announced and the state
// of every session, if bgp is on.
func (d *Daemon) collectAnnounce(w *metrics.Writer) {
	a := d.announcer
	if a == nil {
		return
	}
	w.Add(famAnnounced, boolGauge(a.Announced()))
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	peers, err := a.Peers(ctx)
	if err != nil {
		return
	}
	bfd := d.Config().BGP.BFD.Enabled
	for _, p := range peers {
		w.Add(famSession, boolGauge(p.Established), metrics.L("neighbor", p.Address.String(), "kind", "bgp")...)
		if bfd {
			w.Add(famSession, boolGauge(p.BFDUp), metrics.L("neighbor", p.Address.String(), "kind", "bfd")...)
		}
	}
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// serveDrain is POST /drain on the admin socket: the box withdraws its
// addresses for good (until it restarts) and keeps serving; the answer
// comes after withdraw_delay, once the routers have moved the new
// connections away, so that the operator may then stop the daemon. With
// ?app=&instance= it drains that one instance instead (drainInstance).
func (d *Daemon) serveDrain(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "drain: POST only", http.StatusMethodNotAllowed)
		return
	}
	if q := r.URL.Query(); q.Has("app") || q.Has("instance") {
		d.drainInstance(w, q.Get("app"), q.Get("instance"))
		return
	}
	a := d.announcer
	if a == nil {
		http.Error(w, "drain: bgp is not configured; nothing is announced", http.StatusConflict)
		return
	}
	if err := a.Withdraw(r.Context()); err != nil {
		http.Error(w, "drain: "+err.Error(), http.StatusInternalServerError)
		return
	}
	d.log.Info("drained: withdrawn from the routers until restart")
	fmt.Fprintln(w, "withdrawn: the routers send no new connections here; established ones are still served")
}
