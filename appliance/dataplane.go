package appliance

import (
	"strconv"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/ebpf"
)

// dataplane is what the daemon needs of the data plane: what the control
// server drives, plus metrics and shutdown.
type dataplane interface {
	control.Dataplane
	// Collect writes the data plane's metrics; names labels rule ids,
	// apps maps stream ids to application names.
	Collect(w *metrics.Writer, names func(id uint32) string, apps map[uint32]string)
	// Close detaches from the interfaces and releases everything.
	Close() error
	// Handover stops serving but leaves the data path steering, where it
	// can, for the next daemon to take over.
	Handover() error
}

var (
	famAttach = metrics.Family{Name: "fabricbridge_attach_mode", Type: metrics.Gauge,
		Help: "1 for the way the data path is attached to the interface (native, generic, af_packet; with zerocopy or copy for AF_XDP): users must know when they run slow."}
	famVerdictPackets = metrics.Family{Name: "fabricbridge_xdp_verdict_packets_total", Type: metrics.Counter,
		Help: "Frames the classifier gave each verdict (the XDP program, or the Go reference on the AF_PACKET path)."}
	famVerdictBytes = metrics.Family{Name: "fabricbridge_xdp_verdict_bytes_total", Type: metrics.Counter,
		Help: "Bytes of the frames the classifier gave each verdict."}
	famRedirectFailed = metrics.Family{Name: "fabricbridge_xdp_redirect_failed_total", Type: metrics.Counter,
		Help: "Frames steered or ingested with no AF_XDP socket bound on their queue: steered ones are dropped, ingest ones go to the kernel."}
	famMetaFailed = metrics.Family{Name: "fabricbridge_xdp_meta_failed_total", Type: metrics.Counter,
		Help: "Frames for which the driver left no room for the metadata."}
	famRulePackets = metrics.Family{Name: "fabricbridge_rule_packets_total", Type: metrics.Counter,
		Help: "Frames matched by each rule, listener or flow id in the classifier (XDP or, on the AF_PACKET path, the Go reference)."}
	famRuleBytes = metrics.Family{Name: "fabricbridge_rule_bytes_total", Type: metrics.Counter,
		Help: "Bytes of the frames matched by each rule, listener or flow id."}
)

// collectVerdicts writes the classifier's counters per verdict and its
// events; on the AF_PACKET path the reference classifier keeps the same
// ones (the events stay zero: they are XDP's).
func collectVerdicts(w *metrics.Writer, ifname string, c ebpf.Counters) {
	for v, vc := range c.Verdicts {
		l := metrics.L("interface", ifname, "verdict", classifier.Verdict(v).String())
		w.AddUint(famVerdictPackets, vc.Packets, l...)
		w.AddUint(famVerdictBytes, vc.Bytes, l...)
	}
	w.AddUint(famRedirectFailed, c.RedirectFailed, metrics.L("interface", ifname)...)
	w.AddUint(famMetaFailed, c.MetaFailed, metrics.L("interface", ifname)...)
}

// collectRules writes the counters of every flow, listener and rule id that
// matched something.
func collectRules(w *metrics.Writer, ifname string, rc map[uint32]ebpf.Counter, names func(uint32) string) {
	for _, id := range sortedKeys(rc) {
		l := metrics.L("interface", ifname, "id", strconv.FormatUint(uint64(id), 10), "name", names(id))
		w.AddUint(famRulePackets, rc[id].Packets, l...)
		w.AddUint(famRuleBytes, rc[id].Bytes, l...)
	}
}
