package fabric

import "time"

// Link is what a user-space network stack needs of a stream, whichever
// transport carries it: the application side of a shm Stream and a
// RemoteStream both satisfy it, with the same contract.
//
//   - Send queues whole IP packets and blocks while the peer has no room
//     (the shm TX ring is full, or the remote peer gave no credit); it
//     returns len(pkts), or fewer and an error.
//   - Recv, RecvTimeout and TryRecv fill the caller's buffers (each used
//     to its capacity, resliced to the packet; give MaxPayload bytes) and
//     return how many; RecvTimeout gives up with ErrTimeout, TryRecv
//     never waits. Packets that arrived before the peer left are
//     delivered before the error that says it left.
//   - Err is nil while the stream works, ErrClosed after Close, and an
//     error wrapping ErrBroken (and ErrPeerGone, ErrCorruption, ...)
//     once it is dead. A dead stream never recovers.
//   - Close may be called from any goroutine and unblocks Send and Recv.
//
// One goroutine may send while another receives.
type Link interface {
	Send(pkts [][]byte) (int, error)
	Recv(bufs [][]byte) (int, error)
	RecvTimeout(bufs [][]byte, d time.Duration) (int, error)
	TryRecv(bufs [][]byte) (int, error)
	MaxPayload() int
	Err() error
	Close() error
}

var (
	_ Link = (*Stream)(nil)
	_ Link = (*RemoteStream)(nil)
)
