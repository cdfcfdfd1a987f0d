package userstack

import (
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/link/nested"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// hop is a point on a packet's way through the application's side of the
// path. BenchmarkRoundTripHops timestamps each one to attribute the round
// trip hop by hop (together with the bridge's capture hook and the client).
type hop uint8

const (
	hopRecv      hop = iota // the receive loop got a batch from the link
	hopDelivered            // the receive loop handed a packet to the stack
	hopReadable             // gVisor's TCP processor made a connection readable
	hopWrite                // the stack called WritePackets
	hopWriteData            // ... with a packet that carries payload
	hopSentData             // ... and that batch is in the link's TX ring
)

// hopTrace, when set before a stack is opened, is called at every hop of
// that stack's packets. Only the benchmark sets it.
var hopTrace atomic.Pointer[func(hop)]

// traceHop serves the one hop no endpoint sees, hopReadable (conn.go).
func traceHop(h hop) {
	if f := hopTrace.Load(); f != nil {
		(*f)(h)
	}
}

// withHopTrace is the link endpoint a new stack attaches: ep itself, or,
// while hopTrace is set, ep inside a hopTracer.
func withHopTrace(ep *LinkEndpoint) stack.LinkEndpoint {
	if f := hopTrace.Load(); f != nil {
		return traceHops(ep, *f)
	}
	return ep
}

// traceHops wraps ep and its link so that trace sees every hop. It must run
// before anything attaches ep, which starts ep's receive loop.
func traceHops(ep *LinkEndpoint, trace func(hop)) *hopTracer {
	// hopRecv is when the stream hands the receive loop a batch, before
	// the endpoint checks and coalesces it: only the link below sees that.
	ep.link = recvTracer{Link: ep.link, trace: trace}
	t := &hopTracer{trace: trace}
	t.Endpoint.Init(ep, t)
	return t
}

// hopTracer wraps a LinkEndpoint and records hops as packets pass through
// it, the way gVisor's sniffer logs them: the stack attaches the tracer,
// the tracer attaches itself to the endpoint as its dispatcher, and
// nested.Endpoint forwards the rest both ways. The endpoint itself carries
// no tracing.
type hopTracer struct {
	nested.Endpoint
	trace func(hop)
}

// DeliverNetworkPacket implements stack.NetworkDispatcher.
func (t *hopTracer) DeliverNetworkPacket(proto tcpip.NetworkProtocolNumber, pkt *stack.PacketBuffer) {
	t.Endpoint.DeliverNetworkPacket(proto, pkt)
	t.trace(hopDelivered)
}

// WritePackets implements stack.LinkWriter.
func (t *hopTracer) WritePackets(pkts stack.PacketBufferList) (int, tcpip.Error) {
	t.trace(hopWrite)
	if !carriesData(pkts) {
		return t.Endpoint.WritePackets(pkts)
	}
	t.trace(hopWriteData)
	n, err := t.Endpoint.WritePackets(pkts)
	t.trace(hopSentData)
	return n, err
}

func carriesData(pkts stack.PacketBufferList) bool {
	for _, p := range pkts.AsSlice() {
		if p.Data().Size() > 0 {
			return true
		}
	}
	return false
}

// recvTracer is the link under a traced endpoint: it records hopRecv when
// Recv returns packets.
type recvTracer struct {
	Link
	trace func(hop)
}

func (l recvTracer) Recv(bufs [][]byte) (int, error) {
	n, err := l.Link.Recv(bufs)
	if n > 0 {
		l.trace(hopRecv)
	}
	return n, err
}
