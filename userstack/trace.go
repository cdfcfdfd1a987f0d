package userstack

import (
	"sync/atomic"

	"gvisor.dev/gvisor/pkg/tcpip/stack"
)

// hop is a point on a packet's way through the application's side of the
// path. BenchmarkRoundTripHops timestamps each one to attribute the round
// trip hop by hop (together with the bridge's capture hook and the client).
type hop uint8

const (
	hopRecv      hop = iota // the receive loop got a batch from the link
	hopDelivered            // the batch was handed to the stack
	hopReadable             // gVisor's TCP processor made a connection readable
	hopWrite                // the stack called WritePackets
	hopWriteData            // ... with a packet that carries payload
	hopSentData             // ... and that batch is in the link's TX ring
)

// hopTrace, when set, sees every hop as it happens. Only the benchmark sets
// it, before it opens a stack; otherwise it costs one atomic load per
// batch.
var hopTrace atomic.Pointer[func(hop)]

func traceHop(h hop) {
	if f := hopTrace.Load(); f != nil {
		(*f)(h)
	}
}

// traceWrite stamps a WritePackets call and returns what stamps its end.
func traceWrite(pkts stack.PacketBufferList) func() {
	traceHop(hopWrite)
	data := false
	for _, p := range pkts.AsSlice() {
		data = data || p.Data().Size() > 0
	}
	if !data {
		return func() {}
	}
	traceHop(hopWriteData)
	return func() { traceHop(hopSentData) }
}
