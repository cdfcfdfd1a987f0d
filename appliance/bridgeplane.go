package appliance

import (
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/capture"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// bridgePlane adapts the bridge on the configured interface to what the
// control server and the daemon need.
type bridgePlane struct {
	ifname string
	b      *bridge.Bridge
	log    *slog.Logger

	mu     sync.Mutex
	closed bool
	// kept: closed by Handover. The claims that sessions ending then
	// remove stay in the XDP program's tables for the next daemon, and
	// not removing them is no error.
	kept    bool
	streams map[uint32]*planeStream
	stop    chan struct{}
	ticker  sync.WaitGroup
	mtu     mtuFollower // mtu.go
}

// planeStream is one application stream the bridge serves.
type planeStream struct {
	s      fabric.BridgeEnd // the bridge's end of the application's stream
	remote bool             // a remote application's, closed here when removed
	gone   chan struct{}    // while captured: closed when the capture ends
}

// endCapture tells a running capture that it is over.
func (e *planeStream) endCapture() {
	if e.gone != nil {
		close(e.gone)
		e.gone = nil
	}
}

// healthInterval is how often stream health intervals end: a stream is
// sick when it dropped packets in the last one.
const healthInterval = time.Second

// openBridge clears a stale XDP program from the interface and opens the
// bridge on it. It must run on a thread in the interface's namespace.
// bridgeConfig is what the bridge on interface in is opened with.
func bridgeConfig(in config.Interface, log *slog.Logger) (bridge.Config, error) {
	bc := bridge.Config{
		Interface:  in.Name,
		Queues:     in.Queues,
		FrameSize:  int(in.FrameSize),
		FrameCount: in.Frames,
		BusyPoll:   time.Duration(in.BusyPoll),
		Spin:       time.Duration(in.Spin),
		CPUs:       in.CPUs,
		RouteCache: in.RouteCache,
		// The file says what to turn off; the bridge's zero is on.
		NoSegmentOffload: in.NoSegmentOffload,
		Logger:           log,
		// The AF_PACKET path has no flow table to size.
		FlowCapacity: in.FlowCapacity,
	}
	if bc.Spin == 0 {
		bc.Spin = -1 // the bridge's zero is its default; the file's is "sleep at once"
	}
	if in.Attach == config.AttachStrict {
		bc.Mode = bridge.ModeStrict
	}
	var err error
	bc.Path, err = bridge.ParsePath(in.Path.String())
	return bc, err
}

// openBridge opens the bridge on the configured interface, taking over the
// XDP program a previous daemon left pinned in pinDir ("": pin nothing), or
// clearing a stale one a crashed process left attached.
func openBridge(cfg *config.Config, log *slog.Logger, pinDir string) (*bridgePlane, error) {
	in := cfg.Interfaces[0]
	ifc, err := net.InterfaceByName(in.Name)
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", in.Name, err)
	}
	// A program pinned for this daemon is adopted by the bridge; one
	// attached otherwise is in the way.
	if _, pinned, _ := ebpf.PinnedLink(pinDir); !pinned {
		if removed, err := ebpf.DetachStale(ifc.Index); err != nil {
			return nil, err
		} else if removed {
			log.Warn("removed a stale fabricbridge XDP program left attached by a crashed process", "interface", in.Name)
		}
	}
	bc, err := bridgeConfig(in, log)
	if err != nil {
		return nil, err
	}
	bc.PinDir = pinDir
	b, err := bridge.Open(bc)
	if err != nil {
		return nil, fmt.Errorf("interface %s (attach: %s): %w", in.Name, in.Attach, err)
	}
	p := &bridgePlane{ifname: in.Name, b: b, log: log, streams: map[uint32]*planeStream{}, stop: make(chan struct{})}
	logAttach(log, in.Name, b)
	p.ticker.Add(1)
	go p.tick()
	return p, nil
}

// logAttach says which path the data path took. Leaving native XDP is a
// fallback users must notice (rates drop by an order of magnitude): a
// warning with each path's reason, which the metrics and `fabricbridge
// stats` repeat (fabricbridge_attach_fallback). Native copy after zero copy
// is what most drivers, veth among them, offer, and is only noted.
func logAttach(log *slog.Logger, ifname string, b *bridge.Bridge) {
	fb := b.Fallbacks()
	slow := b.Path() == bridge.PathGeneric || b.Path() == bridge.PathAFPacket
	switch {
	case slow && len(fb) > 0:
		log.Warn("data path fell back to a slower path; expect much lower rates", "interface", ifname,
			"from", fb[0].From.String(), "to", b.Mode(), "reason", b.Tried())
	case slow:
		log.Warn("data path attached on a slow path, as configured; expect much lower rates", "interface", ifname, "mode", b.Mode())
	default:
		log.Info("data path attached", "interface", ifname, "mode", b.Mode(), "tried", b.Tried())
	}
}

func (p *bridgePlane) tick() {
	defer p.ticker.Done()
	t := time.NewTicker(healthInterval)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			p.mu.Lock()
			for _, e := range p.streams {
				e.s.Tick()
			}
			p.mtu.check(p.b.MTU(), p.log)
			p.mu.Unlock()
		}
	}
}

// gone turns errors of a closed plane into the error that tells
// applications the bridge is gone.
func (p *bridgePlane) gone() error {
	if p.closed {
		return fmt.Errorf("%w: the daemon is shutting down", control.ErrBridgeGone)
	}
	return nil
}

func (p *bridgePlane) AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.gone(); err != nil {
		return err
	}
	if err := p.b.AddStream(id, s, own); err != nil {
		return err
	}
	p.streams[id] = &planeStream{s: s}
	return nil
}

// AddRemoteStream has the bridge serve a remote application's GENEVE
// stream directly, through the stream's bridge end.
func (p *bridgePlane) AddRemoteStream(id uint32, s *fabric.RemoteStream, own classifier.Ownership) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.gone(); err != nil {
		return err
	}
	if err := p.b.AddStream(id, s.Bridge(), own); err != nil {
		return err
	}
	p.streams[id] = &planeStream{s: s.Bridge(), remote: true}
	return nil
}

func (p *bridgePlane) SetOwnership(id uint32, own classifier.Ownership) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.gone(); err != nil {
		return err
	}
	return p.b.SetOwnership(id, own)
}

var _ control.FlowDataplane = (*bridgePlane)(nil)

// AddFlows, RemoveFlows and OwnPort make bridgePlane a control.FlowDataplane.
// They do not hold the plane's lock while the bridge works, so that flow
// claims of different applications run concurrently (the bridge orders its
// own maps); a call that loses a race with Close says the bridge is gone.
func (p *bridgePlane) AddFlows(flows []classifier.Flow) error {
	return p.unlocked(func() error { return p.b.AddFlows(flows) })
}

func (p *bridgePlane) RemoveFlows(flows []classifier.Flow) error {
	if p.handedOver() {
		return nil
	}
	return p.unlocked(func() error { return p.b.RemoveFlows(flows) })
}

func (p *bridgePlane) handedOver() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.kept
}

func (p *bridgePlane) OwnPort(id uint32, pc classifier.PortClaim, own bool) error {
	return p.unlocked(func() error { return p.b.OwnPort(id, pc, own) })
}

func (p *bridgePlane) unlocked(f func() error) error {
	p.mu.Lock()
	err := p.gone()
	p.mu.Unlock()
	if err != nil {
		return err
	}
	if err = f(); err != nil {
		p.mu.Lock()
		if gone := p.gone(); gone != nil {
			err = gone
		}
		p.mu.Unlock()
	}
	return err
}

func (p *bridgePlane) RemoveStream(id uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	e := p.streams[id]
	if e != nil {
		e.endCapture() // the bridge's hook goes with the stream
	}
	delete(p.streams, id)
	var err error
	if p.gone() == nil { // else the bridge is closed: nothing touches the stream any more
		err = p.b.RemoveStream(id)
	}
	if e != nil && e.remote {
		e.s.Close() // the application hears at once that its stream is gone
	}
	return err
}

func (p *bridgePlane) SetTables(t *classifier.Tables) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.kept {
		return nil
	}
	if err := p.gone(); err != nil {
		return err
	}
	return p.b.SetTables(t)
}

// steersWithoutUs reports whether the data path can go on steering after
// a Handover: it runs an XDP program.
func (p *bridgePlane) steersWithoutUs() bool {
	_, xdp := p.b.Adoption()
	return xdp
}

// releaseHeld removes the flows and listeners taken over from a previous
// daemon that no application claimed again.
func (p *bridgePlane) releaseHeld() (flows, listeners int, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.gone(); err != nil {
		return 0, 0, err
	}
	return p.b.ReleaseHeld()
}

// Close detaches the bridge: XDP program, sockets, loops.
func (p *bridgePlane) Close() error { return p.close(false) }

// Handover stops the bridge but leaves its XDP program steering for the
// next daemon (bridge.Handover). Control-plane changes that come after it
// (the sessions ending) reach the bridge no more: the claims stay in the
// program's tables for the applications to take back.
func (p *bridgePlane) Handover() error { return p.close(true) }

func (p *bridgePlane) close(keep bool) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed, p.kept = true, keep
	p.mu.Unlock()
	close(p.stop)
	p.ticker.Wait()
	var err error
	if keep {
		err = p.b.Handover()
	} else {
		err = p.b.Close()
	}
	p.mu.Lock()
	for _, e := range p.streams {
		e.endCapture()
		if e.remote {
			e.s.Close()
		}
	}
	p.mu.Unlock()
	return err
}

// Tap shows see every packet of stream id, both ways, through the bridge's
// capture hook (inbound as it is copied into the stream, outbound after
// verification, with the XDP timestamp) until stop is called or the stream
// goes (gone is closed then). One capture per stream at a time.
func (p *bridgePlane) Tap(id uint32, see func(capture.Direction, time.Time, []byte)) (stop func(), gone <-chan struct{}, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.gone(); err != nil {
		return nil, nil, err
	}
	e := p.streams[id]
	if e == nil {
		return nil, nil, fmt.Errorf("no stream %d", id)
	}
	if e.gone != nil {
		return nil, nil, fmt.Errorf("stream %d is already being captured", id)
	}
	err = p.b.SetCapture(id, func(dir bridge.Direction, pkt []byte, ts time.Time) {
		d := capture.In
		if dir != bridge.Inbound {
			d = capture.Out
		}
		see(d, ts, pkt)
	})
	if err != nil {
		return nil, nil, err
	}
	ch := make(chan struct{})
	e.gone = ch
	stop = func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if e.gone != ch {
			return // the stream or the bridge went first
		}
		if !p.closed {
			p.b.SetCapture(id, nil)
		}
		e.endCapture()
	}
	return stop, ch, nil
}

var (
	famQueueRx         = metrics.Family{Name: "fabricbridge_queue_rx_packets_total", Type: metrics.Counter, Help: "Frames a receive queue delivered into streams."}
	famQueueRxBytes    = metrics.Family{Name: "fabricbridge_queue_rx_bytes_total", Type: metrics.Counter, Help: "Bytes a receive queue delivered into streams."}
	famQueueRxDrops    = metrics.Family{Name: "fabricbridge_queue_rx_drops_total", Type: metrics.Counter, Help: "Received frames that reached no stream, by reason (ring_full, no_stream, malformed)."}
	famQueueTx         = metrics.Family{Name: "fabricbridge_queue_tx_packets_total", Type: metrics.Counter, Help: "Packets a queue sent to the wire."}
	famQueueTxBytes    = metrics.Family{Name: "fabricbridge_queue_tx_bytes_total", Type: metrics.Counter, Help: "Bytes a queue sent to the wire."}
	famQueueTxKernel   = metrics.Family{Name: "fabricbridge_queue_tx_via_kernel_total", Type: metrics.Counter, Help: "Packets handed to the kernel: the neighbour was not known yet, or fragments of a packet over a lowered MTU."}
	famQueueTxJoined   = metrics.Family{Name: "fabricbridge_queue_tx_joined_total", Type: metrics.Counter, Help: "Packets sent joined with others of their TCP connection into one segmentation-offload packet (AF_XDP copy mode)."}
	famQueueTxPktSock  = metrics.Family{Name: "fabricbridge_queue_tx_packet_socket_total", Type: metrics.Counter, Help: "Packets sent through the segmentation-offload packet socket, joined or not (AF_XDP copy mode; all of a pinned loop's on a device with several transmit queues)."}
	famQueueTxOffLost  = metrics.Family{Name: "fabricbridge_queue_tx_offload_lost_total", Type: metrics.Counter, Help: "Packets lost in segmentation-offload sends (the device refused them; TCP sends them again)."}
	famQueueTxRejects  = metrics.Family{Name: "fabricbridge_queue_tx_rejects_total", Type: metrics.Counter, Help: "Packets refused on transmit, by reason."}
	famQueueFillEmpty  = metrics.Family{Name: "fabricbridge_queue_fill_ring_empty_total", Type: metrics.Counter, Help: "Times the kernel found the AF_XDP fill ring empty."}
	famQueueSleeps     = metrics.Family{Name: "fabricbridge_queue_sleeps_total", Type: metrics.Counter, Help: "Times a queue's loop found nothing to do for its spin and slept until woken."}
	famQueueCPU        = metrics.Family{Name: "fabricbridge_queue_cpu", Type: metrics.Gauge, Help: "The CPU a queue's loop is pinned to (interfaces[].cpus); -1: not pinned."}
	famQueueKernelDrop = metrics.Family{Name: "fabricbridge_queue_kernel_rx_drops_total", Type: metrics.Counter, Help: "Frames the kernel dropped for want of room in the receive ring."}
	famStreamRx        = metrics.Family{Name: "fabricbridge_stream_rx_packets_total", Type: metrics.Counter, Help: "Packets delivered into each application stream."}
	famStreamRxBytes   = metrics.Family{Name: "fabricbridge_stream_rx_bytes_total", Type: metrics.Counter, Help: "Bytes delivered into each application stream."}
	famStreamRxDrops   = metrics.Family{Name: "fabricbridge_stream_rx_drops_total", Type: metrics.Counter, Help: "Packets for a stream that were dropped, by reason (ring_full: the application did not keep up)."}
	famStreamTx        = metrics.Family{Name: "fabricbridge_stream_tx_packets_total", Type: metrics.Counter, Help: "Packets each stream sent to the wire."}
	famStreamTxBytes   = metrics.Family{Name: "fabricbridge_stream_tx_bytes_total", Type: metrics.Counter, Help: "Bytes each stream sent to the wire."}
	famStreamTxRejects = metrics.Family{Name: "fabricbridge_stream_tx_rejects_total", Type: metrics.Counter, Help: "Packets a stream sent that failed verification, by reason."}
	famStreamHealth    = metrics.Family{Name: "fabricbridge_stream_health", Type: metrics.Gauge, Help: "1 for each stream's health state (normal, sick: dropped in the last second, broken: the application is gone)."}
	famKernelSendErr   = metrics.Family{Name: "fabricbridge_kernel_send_errors_total", Type: metrics.Counter, Help: "Packets the kernel refused on the hand-off path for unknown neighbours."}
	famAttachFallback  = metrics.Family{Name: "fabricbridge_attach_fallback", Type: metrics.Gauge, Help: "1 for each path the data path tried at start and left for a slower one (from), with the path it ended on (to) and why (reason)."}
	famQueueErrors     = metrics.Family{Name: "fabricbridge_queue_bind_errors_total", Type: metrics.Counter, Help: "Receive queues that came into use (ethtool -L) and could not be served: the frames they steer are dropped (the kernel would reset them)."}
	famVLANRulesBlind  = metrics.Family{Name: "fabricbridge_vlan_rules_blind", Type: metrics.Gauge, Help: "1 when rules match on VLAN ids but the interface strips VLAN tags before XDP and could not be made to stop: those rules cannot match."}
)

func rejects(w *metrics.Writer, f metrics.Family, r bridge.Rejects, labels ...metrics.Label) {
	for _, x := range []struct {
		reason string
		n      uint64
	}{{"version", r.Version}, {"header_length", r.HeaderLength}, {"total_length", r.TotalLength}, {"mtu", r.MTU},
		{"source_addr", r.SourceAddr}, {"protocol", r.Protocol}, {"source_port", r.SourcePort}, {"second_chance", r.SecondChance}} {
		w.AddUint(f, x.n, append(labels, metrics.Label{Name: "reason", Value: x.reason})...)
	}
}

func (p *bridgePlane) Collect(w *metrics.Writer, names func(uint32) string, apps map[uint32]string) {
	st := p.b.Stats()
	in := metrics.Label{Name: "interface", Value: p.ifname}
	w.Add(famAttach, 1, in, metrics.Label{Name: "mode", Value: st.Path})
	for _, f := range p.b.Fallbacks() {
		w.Add(famAttachFallback, 1, in, metrics.Label{Name: "from", Value: f.From.String()}, metrics.Label{Name: "to", Value: st.Path}, metrics.Label{Name: "reason", Value: f.Reason})
	}
	w.AddUint(famQueueErrors, st.QueueErrors, in)
	if c, err := p.b.VerdictCounters(); err == nil {
		collectVerdicts(w, p.ifname, c)
	}
	if rc, err := p.b.RuleCounters(); err == nil {
		collectRules(w, p.ifname, rc, names)
	}
	w.AddUint(famKernelSendErr, st.KernelSendErrors, in)
	collectRoutes(w, st.Routes, in)
	blind := 0.0
	if st.VLANRulesBlind {
		blind = 1
	}
	w.Add(famVLANRulesBlind, blind, in)
	for _, q := range st.Queues {
		l := []metrics.Label{in, {Name: "queue", Value: strconv.Itoa(q.Queue)}}
		w.AddUint(famQueueRx, q.RxPackets, l...)
		w.AddUint(famQueueRxBytes, q.RxBytes, l...)
		for _, d := range []struct {
			reason string
			n      uint64
		}{{"ring_full", q.RxDrops.RingFull}, {"no_stream", q.RxDrops.NoStream}, {"malformed", q.RxDrops.Malformed}} {
			w.AddUint(famQueueRxDrops, d.n, append(l, metrics.Label{Name: "reason", Value: d.reason})...)
		}
		w.AddUint(famQueueTx, q.TxPackets, l...)
		w.AddUint(famQueueTxBytes, q.TxBytes, l...)
		w.AddUint(famQueueTxKernel, q.TxViaKernel, l...)
		w.AddUint(famQueueTxJoined, q.TxJoined, l...)
		w.AddUint(famQueueTxOffLost, q.TxOffloadLost, l...)
		w.AddUint(famQueueTxPktSock, q.TxPacketSocket, l...)
		rejects(w, famQueueTxRejects, q.TxRejects, l...)
		w.AddUint(famQueueFillEmpty, q.FillRingEmpty, l...)
		w.AddUint(famQueueKernelDrop, q.KernelRxDrops, l...)
		w.AddUint(famQueueSleeps, q.RxSleeps, l...)
		w.Add(famQueueCPU, float64(q.CPU), l...)
	}
	p.mu.Lock()
	health := map[uint32]fabric.Health{}
	for id, e := range p.streams {
		health[id] = e.s.Health()
	}
	p.mu.Unlock()
	for _, s := range st.Streams {
		l := []metrics.Label{in, {Name: "stream", Value: strconv.FormatUint(uint64(s.ID), 10)}, {Name: "app", Value: apps[s.ID]}}
		w.AddUint(famStreamRx, s.RxPackets, l...)
		w.AddUint(famStreamRxBytes, s.RxBytes, l...)
		w.AddUint(famStreamRxDrops, s.RxRingFull, append(l, metrics.Label{Name: "reason", Value: "ring_full"})...)
		w.AddUint(famStreamTx, s.TxPackets, l...)
		w.AddUint(famStreamTxBytes, s.TxBytes, l...)
		rejects(w, famStreamTxRejects, s.TxRejects, l...)
		h, ok := health[s.ID]
		if s.Broken || !ok {
			h = fabric.Broken
		}
		for _, state := range []fabric.Health{fabric.Normal, fabric.Sick, fabric.Broken} {
			v := 0.0
			if state == h {
				v = 1
			}
			w.Add(famStreamHealth, v, append(l, metrics.Label{Name: "state", Value: state.String()})...)
		}
	}
}
