// Package xsk is AF_XDP on golang.org/x/sys/unix: a UMEM, its fill and
// completion rings, and sockets with RX and TX rings, all mapped from the
// kernel and driven without locks on the hot path.
//
// A Umem is one area of equal frames registered with the kernel, plus a
// free pool. A Socket, opened on it with Umem.Open, is bound to one
// (interface, queue); sockets on the same queue share its Fill and
// Completion rings, which is how a second consumer can receive beside the
// bridge on a queue it serves. Frames are always in exactly one place:
//
//	free pool ─Alloc─► user ─FillRing.Fill─► fill ring ─kernel─► RX ring ─RxRing.Receive─► user
//	user ─TxRing.Send─► TX ring ─kernel─► completion ring ─CompletionRing.Reap─► user ─Free─► free pool
//
// Umem.Account checks that invariant frame by frame; tests call it after
// heavy traffic. Open sockets on a thread in the interface's network
// namespace: the socket and the interface index belong to it.
//
// # Rings
//
// Each ring is single-producer/single-consumer, shared with the kernel, in
// batches of up to MaxBatch. Fill and Send may take fewer entries than
// asked even when the ring has room: the kernel publishes how far it has
// consumed only when it has used up what it last saw. Keep what they refuse
// and offer it again (dropping it loses the frame for good), and size the
// fill and TX rings at twice the frames they carry. The rings are not safe
// for concurrent use, except FillRing.Fill and CompletionRing.Reap, which
// take a per-ring lock once per batch because sockets on one queue share
// them.
//
// Sockets bind with XDP_USE_NEED_WAKEUP, so a busy ring costs no system
// calls; in copy mode every TX batch needs a Kick. BindZeroCopy fails where
// the driver cannot do zero copy (veth), BindAny lets the kernel fall back,
// and Socket.ZeroCopy reports what was granted; after a failed bind start
// again from a fresh Umem. A received frame's XDP metadata lies just before
// it (Umem.Meta). How the rings order their index updates: docs/bridge.md.
package xsk
