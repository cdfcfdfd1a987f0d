package fabric

import (
	"golang.org/x/sys/unix"
)

// RemoteBridge is the bridge's end of a RemoteStream (see
// RemoteStream.Bridge). Through it the bridge serves an application on
// another node as it serves a local one through a BridgeStream: packets
// for the application leave from the bridge's loop in one sendmmsg,
// straight from the frames they arrived in, and the application's packets
// are taken from the receive queue straight into the frames they leave
// in. The bridge never waits on it: a peer without credit loses the
// packets, counted, as a full ring would.
type RemoteBridge struct{ s *RemoteStream }

// Bridge returns the stream's end for the bridge. A stream served by the
// bridge is not used through its own Send and Recv.
func (s *RemoteStream) Bridge() *RemoteBridge { return &s.bridged }

// SendMeta sends packets to the application without waiting: what its
// credit does not cover, or the socket's buffer does not take, is dropped
// and counted (Health turns Sick). Of the metadata words only the marks
// cross the wire (the rule id stays on the bridge). It returns how many
// left or were dropped as no IP packet of at most MaxPayload bytes, and an
// error only once the stream is dead.
func (b *RemoteBridge) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	return b.s.send(pkts, meta, true)
}

// TryRecv takes up to len(bufs) of the application's packets without
// waiting (see RemoteStream.TryRecv).
func (b *RemoteBridge) TryRecv(bufs [][]byte) (int, error) { return b.s.TryRecv(bufs) }

// TryRecvMeta is TryRecv returning each packet's marks as its metadata word.
func (b *RemoteBridge) TryRecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	return b.s.TryRecvMeta(bufs, meta)
}

// MaxPayload is the largest packet either direction carries.
func (b *RemoteBridge) MaxPayload() int { return b.s.MaxPayload() }

// Health is the stream's (see RemoteStream.Health).
func (b *RemoteBridge) Health() Health { return b.s.Health() }

// Tick ends a health interval.
func (b *RemoteBridge) Tick() { b.s.Tick() }

// Err returns why the stream is broken or closed, or nil.
func (b *RemoteBridge) Err() error { return b.s.Err() }

// Close closes the stream (see RemoteStream.Close).
func (b *RemoteBridge) Close() error { return b.s.Close() }

func (b *RemoteBridge) wakeFd() int      { return b.s.efd }
func (b *RemoteBridge) dataReady() bool  { return b.s.rxReady.ready() }
func (b *RemoteBridge) armFlag() *uint32 { return b.s.rxC.v.consArmed }
func (b *RemoteBridge) cond() *condition { return &b.s.condition }
func (b *RemoteBridge) tenant() *tenancy { return &b.s.tenancy }
func (b *RemoteBridge) release()         { unix.Close(b.s.efd) }

// gone: closed only. A stream whose peer has gone still holds the packets
// the peer sent before; the bridge drains them, and the receive that finds
// the queue empty returns the error.
func (b *RemoteBridge) gone() bool { return b.s.closed.Load() }
