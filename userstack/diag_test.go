package userstack

import (
	"bytes"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/seqnum"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
)

// tcpSnapshot is what a stalled test prints of a TCP endpoint's state.
type tcpSnapshot struct {
	at                                     time.Time
	sndUna, sndNxt, maxSentAck             seqnum.Value
	sndWnd                                 seqnum.Size
	cwnd, ssthresh, outstanding, sackedOut int
	rto                                    time.Duration
	fastRecovery                           tcp.TCPFastRecoveryState
	rackFACK                               seqnum.Value
	rackReorder                            bool
	sndClosed                              bool
	sndBufUsed, sndBufSize                 int
	rcvNxt, rcvAcc                         seqnum.Value
	pending, rcvBufUsed                    int
	rcvWndScale                            uint8
	rcvClosed                              bool
	sackBlocks, sackReceived               []header.SACKBlock
}

// tcpStates keeps the last state gVisor's TCP probe reported for each
// endpoint, for a test to print when a transfer stalls.
type tcpStates struct {
	mu   sync.Mutex
	last map[tcp.TCPEndpointID]tcpSnapshot
	// firstZero describes the first time a congestion window fell to 0.
	firstZero string
}

// watchTCP installs a probe on the stacks the test makes from now on.
func watchTCP(t *testing.T) *tcpStates {
	st := &tcpStates{last: map[tcp.TCPEndpointID]tcpSnapshot{}}
	f := tcp.TCPProbeFunc(func(s *tcp.TCPEndpointState) {
		snd, rcv := &s.Sender, &s.Receiver
		snap := tcpSnapshot{
			at: time.Now(), sndUna: snd.SndUna, sndNxt: snd.SndNxt, maxSentAck: snd.MaxSentAck, sndWnd: snd.SndWnd,
			cwnd: snd.SndCwnd, ssthresh: snd.Ssthresh, outstanding: snd.Outstanding, sackedOut: snd.SackedOut,
			rto: snd.RTO, fastRecovery: snd.FastRecovery, rackFACK: snd.RACKState.FACK, rackReorder: snd.RACKState.Reord,
			sndClosed: snd.Closed, sndBufUsed: s.SndBufState.SndBufUsed, sndBufSize: s.SndBufState.SndBufSize,
			rcvNxt: rcv.RcvNxt, rcvAcc: rcv.RcvAcc, pending: rcv.PendingBufUsed, rcvBufUsed: s.RcvBufState.RcvBufUsed,
			rcvWndScale: rcv.RcvWndScale, rcvClosed: s.RcvBufState.RcvClosed,
			sackBlocks: append([]header.SACKBlock(nil), s.SACK.Blocks...), sackReceived: append([]header.SACKBlock(nil), s.SACK.ReceivedBlocks...),
		}
		st.mu.Lock()
		if prev, ok := st.last[s.ID]; ok && snap.cwnd < 1 && prev.cwnd >= 1 && st.firstZero == "" {
			st.firstZero = fmt.Sprintf("%v:%d: cwnd %d -> %d on one segment; before %+v; after %+v", s.ID.LocalAddress, s.ID.LocalPort, prev.cwnd, snap.cwnd, prev, snap)
		}
		st.last[s.ID] = snap
		st.mu.Unlock()
	})
	tcpProbe.Store(&f)
	t.Cleanup(func() { tcpProbe.Store(nil) })
	return st
}

// zero describes the first time a congestion window fell to 0, if one did.
func (st *tcpStates) zero() string {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.firstZero
}

func (st *tcpStates) log(t *testing.T) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.firstZero != "" {
		t.Logf("congestion window fell to 0: %s", st.firstZero)
	}
	for id, s := range st.last {
		t.Logf("tcp %v:%d -> %v:%d, after its last segment %v ago: %+v",
			id.LocalAddress, id.LocalPort, id.RemoteAddress, id.RemotePort, time.Since(s.at).Round(time.Millisecond), s)
	}
}

// logStacks logs the stacks of the goroutines that mention any of the
// given strings.
func logStacks(t *testing.T, any ...string) {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		for _, a := range any {
			if strings.Contains(string(g), a) {
				t.Log(string(g))
				break
			}
		}
	}
}
