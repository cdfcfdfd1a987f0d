package appliance

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/ebpf"
)

// Released is what Release gave back.
type Released struct {
	// Pins is the pin directory removed, "" if there was none; Detached
	// says whether a program was attached through it.
	Pins     string
	Detached bool
	// Ports are the reserved ports returned to the kernel.
	Ports string
}

// Release gives back what a daemon with configuration cfg left for its
// successor when it stopped (Handover), for a final shutdown: it detaches
// the XDP program that kept steering, removes its pins, and returns the
// reserved ports it recorded. It must run in the daemon's network
// namespace, and refuses while that daemon runs.
func Release(cfg *config.Config, opts Options) (Released, error) {
	var r Released
	lock, err := lockRun(cfg.Control.Socket)
	if err != nil {
		return r, err
	}
	defer lock.release()
	netns := netnsID()
	if bpffs := cmp.Or(opts.BPFFS, DefaultBPFFS); ebpf.IsBPFFS(bpffs) {
		dir := pinDir(bpffs, netns, cfg.Interfaces[0].Name)
		if _, err := os.Stat(dir); err == nil {
			if r.Detached, err = ebpf.RemovePins(dir); err != nil {
				return r, err
			}
			r.Pins = dir
			os.Remove(filepath.Dir(dir)) // the namespace's directory, once empty
		}
	}
	record := cfg.Control.Socket + ".ports"
	rec, err := readPortRecord(record)
	if err != nil {
		return r, err
	}
	peers := runningPeers(cfg.Control.Socket, netns, filepath.Dir(cfg.Control.Socket), filepath.Dir(config.DefaultSocket))
	ports := exceptPeers(rec.Added, peers)
	if err := unreservePorts(ports); err != nil {
		return r, fmt.Errorf("return the reserved ports: %w", err)
	}
	r.Ports = ports.String()
	if err := os.Remove(record); err != nil && !os.IsNotExist(err) {
		return r, err
	}
	return r, nil
}
