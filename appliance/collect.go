package appliance

import (
	"fmt"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
)

var (
	famStart = metrics.Family{Name: "fabricbridge_start_time_seconds", Type: metrics.Gauge,
		Help: "When the daemon started, in seconds since the Unix epoch."}
	famReloads = metrics.Family{Name: "fabricbridge_reloads_total", Type: metrics.Counter,
		Help: "Configuration reloads by result (ok, error)."}
	famStatic = metrics.Family{Name: "fabricbridge_static_rules", Type: metrics.Gauge,
		Help: "Static listeners and rules in the configuration in force, by kind."}
	famApps = metrics.Family{Name: "fabricbridge_applications_connected", Type: metrics.Gauge,
		Help: "Applications connected to the control plane."}
)

// collect writes every metric of the daemon for one scrape.
func (d *Daemon) collect(w *metrics.Writer) {
	w.Add(famStart, float64(d.started.UnixNano())/1e9)
	w.AddUint(famReloads, d.reloadsOK.Load(), metrics.L("result", "ok")...)
	w.AddUint(famReloads, d.reloadsKO.Load(), metrics.L("result", "error")...)
	cfg, streams, _ := d.book.snapshot()
	w.Add(famStatic, float64(len(cfg.Listeners)), metrics.L("kind", "listener")...)
	w.Add(famStatic, float64(len(cfg.Rules)), metrics.L("kind", "rule")...)
	w.Add(famApps, float64(len(streams)))
	names := cfg.RuleNames()
	d.plane.Collect(w, func(id uint32) string {
		if n, ok := names[id]; ok {
			return n
		}
		return fmt.Sprintf("dynamic %d", id)
	})
}
