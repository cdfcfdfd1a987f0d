package userstack

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/stack/gro"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// Link is what a stack runs over: the application end of a fabric stream.
// *fabric.Stream and *fabric.RemoteStream both satisfy it.
//
// Send queues whole IP packets and may block until there is room (the TX
// ring's backpressure); it is only ever called by one goroutine at a time.
// Recv blocks until at least one packet is there and fills bufs the way
// fabric.Link.Recv does: each buffer is used up to its capacity and
// resliced to the packet's length. Closing the link is its owner's business;
// once closed, Recv must return an error, which ends the receive loop.
type Link interface {
	Send(pkts [][]byte) (int, error)
	Recv(bufs [][]byte) (int, error)
}

// MarkedLink is a Link that also carries each packet's metadata word, as
// *fabric.Stream and *fabric.RemoteStream do. Only over one does the
// endpoint take part in the second chance of a listener several instances
// share: a packet the bridge marks fabric.MarkMayReturn that belongs to
// no connection of this stack goes back with fabric.MarkNotMine instead of
// up the stack (which would reset it), for the bridge to offer to the
// instance that had the flow's slot before.
type MarkedLink interface {
	Link
	RecvMeta(bufs [][]byte, meta []uint32) (int, error)
	SendMeta(pkts [][]byte, meta []uint32) (int, error)
}

// LinkConfig shapes a LinkEndpoint.
type LinkConfig struct {
	// MTU is the largest IP packet the stack may send. It must fit the
	// link's slots and the wire behind the bridge; Open takes the smaller
	// of the two. Default 1500.
	MTU int
	// MaxPacket is the largest packet the link delivers (the stream's
	// MaxPayload); receive buffers are this big. Default MTU.
	MaxPacket int
	// Batch is the number of packets moved per Send or Recv, at most 64 by
	// the design's rule. Default 64.
	Batch int
	// NoGRO turns off receive coalescing of TCP segments (see LinkEndpoint).
	NoGRO bool
	// NoAckDelay sends every pure ACK the stack makes at once (see
	// delack.go); by default one that data may soon carry waits a
	// millisecond for it.
	NoAckDelay bool
	// RxDepth is how many packets the link holds for the stack before it
	// drops (a local stream's RX ring); the stack keeps TCP receive
	// windows within it. 0: the link does not drop, its sender waits
	// (the remote transport's credits).
	RxDepth int
}

// gsoMaxSize bounds a segmentation-offload packet handed down by TCP. It
// keeps an IPv4 total length (headers included) inside 16 bits.
const gsoMaxSize = 65000

// LinkEndpoint is gVisor's view of a fabric stream: a layer-3 link (no
// Ethernet header; the bridge adds it) that moves packets in batches.
//
// Receive: one goroutine takes up to Batch packets per Recv straight into
// pooled gVisor views (the only copy on this side is the ring's), wraps each
// in a pooled PacketBuffer and hands the batch up, coalescing consecutive
// TCP segments of a flow first (GRO: gVisor's for IPv4, gro6 for IPv6) so
// that the TCP layer sees few large segments instead of many small ones.
//
// Transmit: the endpoint offers segmentation offload, so TCP hands down
// segments of up to 64 KB; WritePackets cuts them to the MSS, finishes the
// checksums and sends the resulting packets in batches of up to Batch with
// one Send each. Every packet is flattened into one of Batch preallocated
// buffers, so nothing is allocated per packet.
//
// Checksums are verified exactly once, here: the bridge copies packets and
// never looks at L4 checksums. The receive loop checks each packet right
// after the ring copy, while it is in cache: the IPv4 header checksum and
// the TCP, UDP, ICMP or ICMPv6 checksum. A packet that fails is dropped
// and counted (RxBadChecksum); one that passes goes up marked as checked
// (the endpoint declares receive checksum offload), which is also what
// lets GRO hand the stack coalesced segments whose headers no longer
// carry valid checksums. What the loop cannot judge alone — IP fragments
// (the L4 checksum covers the reassembled datagram), IPv6 extension
// headers, other protocols, inconsistent lengths — goes up with the offload
// switched off for that packet, so the stack checks it instead. On
// transmit gVisor computes checksums, except TCP's, which the endpoint
// completes while segmenting.
type LinkEndpoint struct {
	link   Link
	marked MarkedLink // link, if it carries metadata words; else nil
	// conns answers whether a segment belongs to a connection of the
	// stack (see handsBack); set once, before the stack attaches.
	conns     *stack.Stack
	local     localAddrs // the stack's addresses (local.go); set once, before the stack attaches
	mtu       atomic.Uint32
	maxPacket int
	batch     int
	groOn     bool

	// stackChecks is set while the receive loop delivers a packet whose
	// checksums the stack must verify itself.
	stackChecks atomic.Bool

	// unreach notes the errnos of ICMPv6 destination unreachables that the
	// receive loop rewrote for gVisor (unreach6.go).
	unreach unreachNotes

	// afterICMPError, if set before the stack attaches, runs after a batch
	// that carried an ICMP or ICMPv6 error, once the stack has taken it
	// (see Stack.wakeDatagramReaders).
	afterICMPError func()

	mu         sync.RWMutex
	dispatcher stack.NetworkDispatcher
	started    bool
	onClose    func()
	done       chan struct{}
	rxErr      error

	tx txState

	stats linkCounters
}

type txState struct {
	sync.Mutex
	bufs  [][]byte   // Batch buffers of maxPacket bytes, the flattening targets
	batch [][]byte   // the packets of the batch being built (slices of bufs)
	gso   []byte     // an offload packet's headers, gathered before it is cut
	acks  *ackHolder // nil: ACKs are not delayed
}

type linkCounters struct {
	rxPackets, rxBytes, rxBatches, rxNotIP atomic.Uint64
	rxBadChecksum, rxAcksSuperseded        atomic.Uint64
	txPackets, txBytes, txBatches          atomic.Uint64
	txSegmented, txDropped                 atomic.Uint64
	rxMayReturn, txNotMine                 atomic.Uint64
	txAcksDelayed, txAcksAbsorbed          atomic.Uint64
	rxFromSelf, txLooped                   atomic.Uint64
}

// LinkStats are a LinkEndpoint's counters.
type LinkStats struct {
	RxPackets, RxBytes, RxBatches uint64
	RxNotIP                       uint64 // received packets that were neither IPv4 nor IPv6, dropped
	RxBadChecksum                 uint64 // received packets with a wrong checksum, dropped
	// RxAcksSuperseded counts received pure ACKs dropped because a later
	// segment of their connection in the same batch carried all they did
	// (acksupersede.go).
	RxAcksSuperseded              uint64
	TxPackets, TxBytes, TxBatches uint64
	TxSegmented                   uint64 // offload packets cut into MSS-sized segments
	TxDropped                     uint64 // packets refused: malformed offload packet or link error
	// RxMayReturn counts received packets the bridge marked
	// fabric.MarkMayReturn (their listener's slot changed hands); of them,
	// TxNotMine counts those that belonged to no connection here and went
	// back to the bridge (they are in RxPackets, not in TxPackets).
	RxMayReturn, TxNotMine uint64
	// AcksDelayed counts the pure ACKs the endpoint held back (delack.go);
	// of them, AcksAbsorbed were made redundant by a later segment of their
	// connection and never sent.
	AcksDelayed, AcksAbsorbed uint64
	// RxFromSelf counts received packets dropped because their source was
	// one of the stack's own addresses; TxLooped counts packets the stack
	// sent to itself, handed back up without reaching the link (local.go).
	RxFromSelf, TxLooped uint64
}

// add adds o's counts to s's.
func (s *LinkStats) add(o LinkStats) {
	s.RxPackets += o.RxPackets
	s.RxBytes += o.RxBytes
	s.RxBatches += o.RxBatches
	s.RxNotIP += o.RxNotIP
	s.RxBadChecksum += o.RxBadChecksum
	s.RxAcksSuperseded += o.RxAcksSuperseded
	s.TxPackets += o.TxPackets
	s.TxBytes += o.TxBytes
	s.TxBatches += o.TxBatches
	s.TxSegmented += o.TxSegmented
	s.TxDropped += o.TxDropped
	s.RxMayReturn += o.RxMayReturn
	s.TxNotMine += o.TxNotMine
	s.AcksDelayed += o.AcksDelayed
	s.AcksAbsorbed += o.AcksAbsorbed
	s.RxFromSelf += o.RxFromSelf
	s.TxLooped += o.TxLooped
}

// NewLinkEndpoint returns an endpoint over l. Its receive loop starts when
// a stack attaches it.
func NewLinkEndpoint(l Link, cfg LinkConfig) (*LinkEndpoint, error) {
	if cfg.MTU == 0 {
		cfg.MTU = 1500
	}
	if cfg.MaxPacket == 0 {
		cfg.MaxPacket = cfg.MTU
	}
	if cfg.Batch == 0 {
		cfg.Batch = 64
	}
	switch {
	case l == nil:
		return nil, errors.New("userstack: nil link")
	case cfg.MTU < header.IPv6MinimumMTU:
		return nil, errors.New("userstack: MTU below 1280 cannot carry IPv6")
	case cfg.MaxPacket < cfg.MTU:
		return nil, errors.New("userstack: link's largest packet is smaller than the MTU")
	case cfg.Batch < 1 || cfg.Batch > 64:
		return nil, errors.New("userstack: batch must be 1..64")
	}
	e := &LinkEndpoint{
		link:      l,
		maxPacket: cfg.MaxPacket,
		batch:     cfg.Batch,
		groOn:     !cfg.NoGRO,
		done:      make(chan struct{}),
	}
	e.marked, _ = l.(MarkedLink)
	e.mtu.Store(uint32(cfg.MTU))
	e.tx.bufs = make([][]byte, cfg.Batch)
	for i := range e.tx.bufs {
		e.tx.bufs[i] = make([]byte, cfg.MaxPacket)
	}
	e.tx.batch = make([][]byte, 0, cfg.Batch)
	e.tx.gso = make([]byte, maxOffloadHeaders)
	if !cfg.NoAckDelay {
		e.tx.acks = newAckHolder(e)
	}
	return e, nil
}

// Stats returns a snapshot of the counters.
func (e *LinkEndpoint) Stats() LinkStats {
	c := &e.stats
	return LinkStats{
		RxPackets: c.rxPackets.Load(), RxBytes: c.rxBytes.Load(), RxBatches: c.rxBatches.Load(),
		RxNotIP: c.rxNotIP.Load(), RxBadChecksum: c.rxBadChecksum.Load(), RxAcksSuperseded: c.rxAcksSuperseded.Load(),
		TxPackets: c.txPackets.Load(), TxBytes: c.txBytes.Load(), TxBatches: c.txBatches.Load(),
		TxSegmented: c.txSegmented.Load(), TxDropped: c.txDropped.Load(),
		RxMayReturn: c.rxMayReturn.Load(), TxNotMine: c.txNotMine.Load(),
		AcksDelayed: c.txAcksDelayed.Load(), AcksAbsorbed: c.txAcksAbsorbed.Load(),
		RxFromSelf: c.rxFromSelf.Load(), TxLooped: c.txLooped.Load(),
	}
}

// Done is closed when the receive loop has ended (the link was closed or
// broke); Err then says why.
func (e *LinkEndpoint) Done() <-chan struct{} { return e.done }

// Err is the error that ended the receive loop, or nil while it runs.
func (e *LinkEndpoint) Err() error {
	select {
	case <-e.done:
		return e.rxErr
	default:
		return nil
	}
}

// MTU implements stack.LinkEndpoint.
func (e *LinkEndpoint) MTU() uint32 { return e.mtu.Load() }

// SetMTU implements stack.LinkEndpoint. The MTU never grows beyond what the
// link's slots carry.
func (e *LinkEndpoint) SetMTU(mtu uint32) {
	e.mtu.Store(min(mtu, uint32(e.maxPacket)))
}

// MaxHeaderLength implements stack.LinkEndpoint: no link header.
func (*LinkEndpoint) MaxHeaderLength() uint16 { return 0 }

// LinkAddress implements stack.LinkEndpoint: a layer-3 link has none.
func (*LinkEndpoint) LinkAddress() tcpip.LinkAddress { return "" }

// SetLinkAddress implements stack.LinkEndpoint (ignored).
func (*LinkEndpoint) SetLinkAddress(tcpip.LinkAddress) {}

// Capabilities implements stack.LinkEndpoint: receive checksum offload,
// since the receive loop verifies checksums itself, except while it hands
// up a packet it could not judge (see the type's documentation). gVisor
// reads this for every received packet; the transmit bits never change.
func (e *LinkEndpoint) Capabilities() stack.LinkEndpointCapabilities {
	if e.stackChecks.Load() {
		return stack.CapabilityNone
	}
	return stack.CapabilityRXChecksumOffload
}

// GSOMaxSize implements stack.GSOEndpoint.
func (*LinkEndpoint) GSOMaxSize() uint32 { return gsoMaxSize }

// SupportedGSO implements stack.GSOEndpoint: TCP hands down large segments
// with a partial checksum, as to a NIC with TSO, and WritePackets cuts them.
func (*LinkEndpoint) SupportedGSO() stack.SupportedGSO { return stack.HostGSOSupported }

// ARPHardwareType implements stack.LinkEndpoint.
func (*LinkEndpoint) ARPHardwareType() header.ARPHardwareType { return header.ARPHardwareNone }

// AddHeader implements stack.LinkEndpoint: nothing to add.
func (*LinkEndpoint) AddHeader(*stack.PacketBuffer) {}

// ParseHeader implements stack.LinkEndpoint: nothing to parse.
func (*LinkEndpoint) ParseHeader(*stack.PacketBuffer) bool { return true }

// SetOnCloseAction implements stack.LinkEndpoint.
func (e *LinkEndpoint) SetOnCloseAction(f func()) {
	e.mu.Lock()
	e.onClose = f
	e.mu.Unlock()
}

// Close implements stack.LinkEndpoint. It runs the close action; the link
// itself belongs to whoever made it.
func (e *LinkEndpoint) Close() {
	e.mu.Lock()
	f := e.onClose
	e.onClose = nil
	e.mu.Unlock()
	if f != nil {
		f()
	}
}

// Attach implements stack.LinkEndpoint. The first attach starts the receive
// loop; detaching (nil) makes it drop what arrives until the link closes.
func (e *LinkEndpoint) Attach(d stack.NetworkDispatcher) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.dispatcher = d
	if d != nil && !e.started {
		e.started = true
		go e.receiveLoop()
	}
}

// IsAttached implements stack.LinkEndpoint.
func (e *LinkEndpoint) IsAttached() bool {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.dispatcher != nil
}

// Wait implements stack.LinkEndpoint: it returns once the receive loop has
// ended, which happens when the link is closed.
func (e *LinkEndpoint) Wait() {
	e.mu.RLock()
	started := e.started
	e.mu.RUnlock()
	if started {
		<-e.done
	}
}

// receiveLoop moves batches from the link into the stack until Recv fails.
func (e *LinkEndpoint) receiveLoop() {
	r := newReceiver(e)
	defer close(e.done)
	for {
		if err := r.once(); err != nil {
			r.release()
			e.rxErr = err
			return
		}
	}
}

// receiver owns the receive side's buffers; only the receive loop (or a
// test standing in for it) touches it.
type receiver struct {
	e     *LinkEndpoint
	views []*buffer.View // the views the next Recv fills; nil once handed up
	bufs  [][]byte
	meta  []uint32 // the packets' metadata words; all 0 over a plain Link
	gro   gro.GRO
	gro6  gro6
	// acks finds the pure ACKs a later segment of the batch supersedes
	// (acksupersede.go); skip marks them, verdicts holds each packet's check.
	acks     ackSuperseder
	skip     []bool
	verdicts []verdict
	// back collects the batch's packets that go back to the bridge (see
	// handsBack), backMeta their words; their views stay with the receiver.
	back     [][]byte
	backMeta []uint32
}

func newReceiver(e *LinkEndpoint) *receiver {
	r := &receiver{e: e, views: make([]*buffer.View, e.batch), bufs: make([][]byte, e.batch), meta: make([]uint32, e.batch),
		skip: make([]bool, e.batch), verdicts: make([]verdict, e.batch),
		back: make([][]byte, 0, e.batch), backMeta: make([]uint32, e.batch)}
	for i := range r.backMeta {
		r.backMeta[i] = fabric.MarkNotMine
	}
	r.gro.Init(e.groOn)
	r.gro6.disabled = !e.groOn
	return r
}

// once receives one batch and delivers it.
func (r *receiver) once() error {
	for i, v := range r.views {
		if v == nil {
			v = buffer.NewViewSize(r.e.maxPacket)
			r.views[i] = v
		}
		r.bufs[i] = v.AsSlice()
	}
	var n int
	var err error
	if r.e.marked != nil {
		n, err = r.e.marked.RecvMeta(r.bufs, r.meta)
	} else {
		n, err = r.e.link.Recv(r.bufs)
	}
	if n > 0 {
		r.deliver(n)
		r.e.expireDueAcks()
		// Delivering readied goroutines: gVisor's TCP processor (runnext
		// on this P), and through it the application. Yield the P to them
		// now. Otherwise this goroutine goes back into Recv, spins and
		// sleeps in poll(2) still holding the P, and what it readied waits
		// until the runtime's monitor takes the P back: measured at ~120 µs
		// per packet on 2 vCPUs (docs/performance.md#the-receive-loop).
		runtime.Gosched()
	}
	return err
}

// deliver hands the first n filled views up the stack as one batch.
func (r *receiver) deliver(n int) {
	e := r.e
	e.mu.RLock()
	d := e.dispatcher
	e.mu.RUnlock()
	r.gro.Dispatcher = d
	if superseded := r.acks.mark(r.bufs, r.meta, r.verdicts, r.skip, n); superseded > 0 {
		e.stats.rxAcksSuperseded.Add(uint64(superseded))
	}
	var bytes uint64
	icmpErrors := false
	for i := 0; i < n; i++ {
		v := r.views[i]
		size := len(r.bufs[i])
		bytes += uint64(size)
		icmpError := isICMPError(r.bufs[i])
		icmpErrors = icmpErrors || icmpError
		var proto tcpip.NetworkProtocolNumber
		if size > 0 {
			switch r.bufs[i][0] >> 4 {
			case 4:
				proto = header.IPv4ProtocolNumber
			case 6:
				proto = header.IPv6ProtocolNumber
			}
		}
		if proto == 0 || d == nil {
			// Not IP, or no stack to take it: reuse the view as is.
			e.stats.rxNotIP.Add(1)
			continue
		}
		if r.skip[i] {
			continue // superseded: the view stays for the next batch
		}
		if e.local.fromSelf(r.bufs[i]) {
			e.stats.rxFromSelf.Add(1)
			continue // a spoof: the view stays for the next batch
		}
		verdict := r.verdicts[i]
		if verdict == corrupt {
			e.stats.rxBadChecksum.Add(1)
			continue // the view stays for the next batch
		}
		if r.meta[i]&fabric.MarkMayReturn != 0 {
			e.stats.rxMayReturn.Add(1)
			if e.handsBack(r.bufs[i]) {
				r.back = append(r.back, r.bufs[i])
				continue // the view stays too: sent back below
			}
		}
		switch verdict {
		case verified:
			r.views[i] = nil
			v.CapLength(size)
			if proto == header.IPv6ProtocolNumber {
				if icmpError {
					e.unreach.adaptUnreach6(r.bufs[i])
				}
				// gVisor's IPv6 GRO allocates per packet: our own (gro6).
				r.gro6.enqueue(d, v, r.bufs[i][:size])
				continue
			}
			if icmpError {
				e.unreach.adaptUnreach4(r.bufs[i])
			}
			pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithView(v)})
			pkt.NetworkProtocolNumber = proto
			pkt.RXChecksumValidated = true // GRO need not check again
			r.gro.Enqueue(pkt)
			pkt.DecRef()
		case unverified:
			r.views[i] = nil
			v.CapLength(size)
			pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithView(v)})
			pkt.NetworkProtocolNumber = proto
			r.flushGRO() // keep order with what GRO holds
			r.gro6.flush(d)
			e.stackChecks.Store(true)
			d.DeliverNetworkPacket(proto, pkt)
			e.stackChecks.Store(false)
			pkt.DecRef()
		}
	}
	r.flushGRO()
	r.gro6.flush(d)
	if len(r.back) > 0 {
		e.sendBack(r.back, r.backMeta[:len(r.back)])
		clear(r.back)
		r.back = r.back[:0]
	}
	if icmpErrors && e.afterICMPError != nil && d != nil {
		e.afterICMPError()
	}
	e.stats.rxPackets.Add(uint64(n))
	e.stats.rxBytes.Add(bytes)
	e.stats.rxBatches.Add(1)
}

// groBucketSize is how many packets each of the buckets of gVisor's GRO
// holds (its groBucketSize, unexported).
const groBucketSize = 8

// flushGRO hands up everything gVisor's GRO holds. Its Flush hands up only
// the first packet of each bucket: it walks a bucket's list while removing
// the packets from it, and a removed packet's link to the next is cleared.
// What stayed would wait for a later batch, and a flow whose sender waits
// for the ACK of a held segment sends none until its retransmission timer
// runs out. Each Flush takes one packet from every bucket, so as many
// calls as a bucket holds empty them all (TestGROHoldsNothing). gVisor's
// pull request #14081 (open in September 2026) fixes Flush; with a gVisor
// that has it, one call does.
func (r *receiver) flushGRO() {
	for range groBucketSize {
		r.gro.Flush()
	}
}

func (r *receiver) release() {
	for i, v := range r.views {
		if v != nil {
			v.Release()
			r.views[i] = nil
		}
	}
}

// handsBack reports whether p, a verified packet the bridge marked
// fabric.MarkMayReturn, goes back to it: a TCP segment without SYN of no
// connection of this stack, which the stack would answer with a reset
// (a listener's SYN cookie is no connection yet: the bridge brings the
// segment back unmarked if the previous owner does not know it either).
// A SYN opens a connection here; other protocols, fragments and IPv6
// extension headers have no second chance at the bridge and go up.
func (e *LinkEndpoint) handsBack(p []byte) bool {
	if e.conns == nil {
		return false
	}
	var netProto tcpip.NetworkProtocolNumber
	var id stack.TransportEndpointID
	var l4 []byte
	switch p[0] >> 4 {
	case 4:
		ip := header.IPv4(p)
		if len(p) < header.IPv4MinimumSize || ip.TransportProtocol() != header.TCPProtocolNumber || ip.More() || ip.FragmentOffset() != 0 {
			return false
		}
		netProto, l4 = header.IPv4ProtocolNumber, p[min(int(ip.HeaderLength()), len(p)):]
		id.LocalAddress, id.RemoteAddress = ip.DestinationAddress(), ip.SourceAddress()
	case 6:
		ip := header.IPv6(p)
		if len(p) < header.IPv6MinimumSize || ip.TransportProtocol() != header.TCPProtocolNumber {
			return false
		}
		netProto, l4 = header.IPv6ProtocolNumber, p[header.IPv6MinimumSize:]
		id.LocalAddress, id.RemoteAddress = ip.DestinationAddress(), ip.SourceAddress()
	default:
		return false
	}
	if len(l4) < header.TCPMinimumSize {
		return false
	}
	seg := header.TCP(l4)
	if seg.Flags()&header.TCPFlagSyn != 0 {
		return false
	}
	id.LocalPort, id.RemotePort = seg.DestinationPort(), seg.SourcePort()
	return !isConnection(e.conns.FindTransportEndpoint(netProto, header.TCPProtocolNumber, id, nicID))
}

// isConnection reports whether ep, what the stack's demultiplexer finds for
// a segment, is a connection of its own rather than a listener or a bound
// socket (which it falls back to) or nothing.
func isConnection(ep stack.TransportEndpoint) bool {
	t, ok := ep.(*tcp.Endpoint)
	if !ok {
		return ep != nil // not gVisor's TCP: let the stack judge
	}
	switch t.EndpointState() {
	case tcp.StateListen, tcp.StateInitial, tcp.StateBound, tcp.StateClose, tcp.StateError:
		return false
	}
	return true
}

// sendBack returns packets to the bridge with fabric.MarkNotMine, through
// the transmit side's lock (the link has one sender at a time).
func (e *LinkEndpoint) sendBack(pkts [][]byte, meta []uint32) {
	e.tx.Lock()
	n, _ := e.marked.SendMeta(pkts, meta) // a broken link is the receive loop's to report
	e.tx.Unlock()
	n = max(n, 0)
	e.stats.txNotMine.Add(uint64(n))
	if lost := len(pkts) - n; lost > 0 {
		e.stats.txDropped.Add(uint64(lost))
	}
}

// errLink is what WritePackets reports when the link refuses packets.
var errLink = &tcpip.ErrClosedForSend{}

// WritePackets implements stack.LinkWriter: it flattens (and, for offload
// packets, segments) the packets into the endpoint's buffers and sends them
// in batches. It returns how many of the stack's packets were written.
// Concurrent calls are serialised, which also keeps the link's Send
// single-producer.
func (e *LinkEndpoint) WritePackets(pkts stack.PacketBufferList) (int, tcpip.Error) {
	looped := 0
	for _, pkt := range pkts.AsSlice() {
		if e.toSelf(pkt) {
			e.loopBack(pkt)
			looped++
		}
	}
	if looped == pkts.Len() {
		return looped, nil
	}
	t := &e.tx
	t.Lock()
	defer t.Unlock()
	written := looped
	for _, pkt := range pkts.AsSlice() {
		if looped > 0 && e.toSelf(pkt) {
			continue // looped back above
		}
		ok, err := e.writeLocked(pkt)
		if err != nil {
			return written, err
		}
		if ok {
			written++
		}
	}
	if err := e.flush(); err != nil {
		return written, errLink
	}
	return written, nil
}

// writeLocked appends pkt to the transmit batch. A malformed packet is
// lost alone (false, nil); a link error drops the batch. The caller holds
// e.tx.
func (e *LinkEndpoint) writeLocked(pkt *stack.PacketBuffer) (bool, tcpip.Error) {
	verdict := ackSend
	var seg outSeg
	if e.tx.acks != nil {
		var ok bool
		if seg, ok = parseOut(pkt); ok {
			var err error
			if verdict, err = e.judge(&seg, e.MTU()-header.IPv6MinimumSize-header.TCPMinimumSize); err != nil {
				e.stats.txDropped.Add(1)
				e.tx.batch = e.tx.batch[:0]
				return false, errLink
			}
		}
	}
	var err error
	if pkt.GSOOptions.Type != stack.GSONone && pkt.GSOOptions.NeedsCsum {
		err = e.writeOffload(pkt)
	} else {
		err = e.writePlain(pkt)
	}
	if err != nil {
		e.stats.txDropped.Add(1)
		if errors.Is(err, errMalformedOffload) {
			return false, nil
		}
		e.tx.batch = e.tx.batch[:0]
		return false, errLink
	}
	if verdict == ackKeep {
		e.holdLast(&seg)
	}
	return true, nil
}

// linkQDisc is the NIC's queueing discipline: it writes each packet the
// stack sends straight into the endpoint's batch. gVisor's default
// discipline wraps every packet in a list of its own, an allocation per
// packet sent.
type linkQDisc struct{ e *LinkEndpoint }

// WritePacket implements stack.QueueingDiscipline.
func (q linkQDisc) WritePacket(pkt *stack.PacketBuffer) tcpip.Error {
	e := q.e
	if e.toSelf(pkt) {
		e.loopBack(pkt)
		return nil
	}
	e.tx.Lock()
	defer e.tx.Unlock()
	if _, err := e.writeLocked(pkt); err != nil {
		return err
	}
	if err := e.flush(); err != nil {
		return errLink
	}
	return nil
}

// Close implements stack.QueueingDiscipline: the endpoint has no queue of
// its own to release.
func (linkQDisc) Close() {}

// writePlain appends a packet whose checksums are complete.
func (e *LinkEndpoint) writePlain(pkt *stack.PacketBuffer) error {
	if pkt.Size() > e.maxPacket {
		return errMalformedOffload
	}
	dst, err := e.slot()
	if err != nil {
		return err
	}
	e.tx.batch = append(e.tx.batch, flatten(pkt, dst))
	return nil
}

// slot returns the next free flattening buffer, sending the batch first if
// all are in use.
func (e *LinkEndpoint) slot() ([]byte, error) {
	t := &e.tx
	if len(t.batch) == len(t.bufs) {
		if err := e.flush(); err != nil {
			return nil, err
		}
	}
	return t.bufs[len(t.batch)][:e.maxPacket], nil
}

// flush sends the batch built so far.
func (e *LinkEndpoint) flush() error {
	t := &e.tx
	if len(t.batch) == 0 {
		return nil
	}
	want := len(t.batch)
	n, err := e.link.Send(t.batch)
	var bytes uint64
	for _, p := range t.batch[:max(n, 0)] {
		bytes += uint64(len(p))
	}
	e.stats.txPackets.Add(uint64(n))
	e.stats.txBytes.Add(bytes)
	e.stats.txBatches.Add(1)
	t.batch = t.batch[:0]
	if err == nil && n < want {
		err = errors.New("userstack: link took part of a batch")
	}
	return err
}

// flatten copies the packet (from its network header on) into dst and
// returns the filled part. dst must hold pkt.Size() bytes.
func flatten(pkt *stack.PacketBuffer, dst []byte) []byte {
	views, off := pkt.AsViewList()
	n := 0
	for v := views.Front(); v != nil; v = v.Next() {
		s := v.AsSlice()
		if off >= len(s) {
			off -= len(s)
			continue
		}
		n += copy(dst[n:], s[off:])
		off = 0
	}
	return dst[:n]
}
