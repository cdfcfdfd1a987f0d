package appliance

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// dataplane is what the daemon needs of the data plane: what the control
// server drives, plus metrics and shutdown.
type dataplane interface {
	control.Dataplane
	// Collect writes the data plane's metrics; names label rule ids.
	Collect(w *metrics.Writer, names func(id uint32) string)
	// Close detaches from the interfaces and releases everything.
	Close() error
}

// xdpPlane is the classifier alone: the XDP program attached to every
// configured interface, with no AF_XDP sockets behind it, so steered and
// ingested frames fall back to the kernel (counted as failed redirects),
// and application streams are accepted and accounted but carry nothing.
// It is the data plane until the bridge is wired in.
type xdpPlane struct {
	ifaces []*xdpIface

	mu      sync.Mutex
	streams map[uint32]control.Ownership
}

type xdpIface struct {
	name string
	prog *ebpf.Program
	mode ebpf.Mode
}

func openXDP(cfg *config.Config, log *slog.Logger) (_ *xdpPlane, err error) {
	p := &xdpPlane{streams: map[uint32]control.Ownership{}}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	for _, in := range cfg.Interfaces {
		ifc, err := net.InterfaceByName(in.Name)
		if err != nil {
			return nil, fmt.Errorf("interface %s: %w", in.Name, err)
		}
		if removed, err := clearStaleXDP(in.Name); err != nil {
			return nil, err
		} else if removed {
			log.Warn("removed a stale fabricbridge XDP program left attached by a crashed process", "interface", in.Name)
		}
		prog, err := ebpf.Load()
		if err != nil {
			return nil, err
		}
		want := ebpf.ModeAuto
		if in.Attach == config.AttachStrict {
			want = ebpf.ModeNative
		}
		mode, err := prog.Attach(ifc.Index, want)
		if err != nil {
			prog.Close()
			return nil, fmt.Errorf("interface %s (attach: %s): %w", in.Name, in.Attach, err)
		}
		p.ifaces = append(p.ifaces, &xdpIface{name: in.Name, prog: prog, mode: mode})
		if mode == ebpf.ModeGeneric {
			log.Warn("XDP classifier attached in generic mode: it runs on the skb path and is much slower than native", "interface", in.Name, "mode", mode.String())
		} else {
			log.Info("XDP classifier attached", "interface", in.Name, "mode", mode.String())
		}
	}
	return p, nil
}

func (p *xdpPlane) SetTables(t *classifier.Tables) error {
	var errs []error
	for _, i := range p.ifaces {
		if err := i.prog.Update(t); err != nil {
			errs = append(errs, fmt.Errorf("interface %s: %w", i.name, err))
		}
	}
	return errors.Join(errs...)
}

func (p *xdpPlane) AddStream(id uint32, _ *fabric.Stream, own control.Ownership) error {
	return p.SetOwnership(id, own)
}

func (p *xdpPlane) AddRemoteStream(id uint32, _ *fabric.RemoteStream, own control.Ownership) error {
	return p.SetOwnership(id, own)
}

func (p *xdpPlane) SetOwnership(id uint32, own control.Ownership) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.streams[id] = own
	return nil
}

func (p *xdpPlane) RemoveStream(id uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.streams, id)
	return nil
}

func (p *xdpPlane) Close() error {
	var errs []error
	for _, i := range p.ifaces {
		errs = append(errs, i.prog.Close())
	}
	p.ifaces = nil
	return errors.Join(errs...)
}

func (p *xdpPlane) Collect(w *metrics.Writer, names func(uint32) string) {
	for _, i := range p.ifaces {
		collectProgram(w, i.name, i.mode.String(), i.prog, names)
	}
}

var (
	famAttach = metrics.Family{Name: "fabricbridge_attach_mode", Type: metrics.Gauge,
		Help: "1 for the way the data path is attached to the interface (native, generic, af_packet; with zerocopy or copy for AF_XDP): users must know when they run slow."}
	famVerdictPackets = metrics.Family{Name: "fabricbridge_xdp_verdict_packets_total", Type: metrics.Counter,
		Help: "Frames the XDP classifier gave each verdict."}
	famVerdictBytes = metrics.Family{Name: "fabricbridge_xdp_verdict_bytes_total", Type: metrics.Counter,
		Help: "Bytes of the frames the XDP classifier gave each verdict."}
	famRedirectFailed = metrics.Family{Name: "fabricbridge_xdp_redirect_failed_total", Type: metrics.Counter,
		Help: "Frames steered or ingested with no AF_XDP socket bound on their queue; they went to the kernel."}
	famMetaFailed = metrics.Family{Name: "fabricbridge_xdp_meta_failed_total", Type: metrics.Counter,
		Help: "Frames for which the driver left no room for the metadata."}
	famRulePackets = metrics.Family{Name: "fabricbridge_rule_packets_total", Type: metrics.Counter,
		Help: "Frames matched by each rule, listener or flow id in the XDP classifier."}
	famRuleBytes = metrics.Family{Name: "fabricbridge_rule_bytes_total", Type: metrics.Counter,
		Help: "Bytes of the frames matched by each rule, listener or flow id."}
)

// collectProgram writes one XDP program's counters.
func collectProgram(w *metrics.Writer, ifname, mode string, prog *ebpf.Program, names func(uint32) string) {
	w.Add(famAttach, 1, metrics.L("interface", ifname, "mode", mode)...)
	c, err := prog.Counters()
	if err == nil {
		for v, vc := range c.Verdicts {
			l := metrics.L("interface", ifname, "verdict", classifier.Verdict(v).String())
			w.AddUint(famVerdictPackets, vc.Packets, l...)
			w.AddUint(famVerdictBytes, vc.Bytes, l...)
		}
		w.AddUint(famRedirectFailed, c.RedirectFailed, metrics.L("interface", ifname)...)
		w.AddUint(famMetaFailed, c.MetaFailed, metrics.L("interface", ifname)...)
	}
	rc, err := prog.RuleCounters()
	if err == nil {
		for _, id := range sortedKeys(rc) {
			l := metrics.L("interface", ifname, "id", strconv.FormatUint(uint64(id), 10), "name", names(id))
			w.AddUint(famRulePackets, rc[id].Packets, l...)
			w.AddUint(famRuleBytes, rc[id].Bytes, l...)
		}
	}
}
