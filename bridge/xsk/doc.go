// Package xsk is AF_XDP on golang.org/x/sys/unix: a UMEM, its fill and
// completion rings, and sockets with RX and TX rings, all mapped from the
// kernel and driven without locks on the hot path.
//
// # Pieces
//
// A Umem is one area of equal frames (2048 or 4096 bytes) registered with the
// kernel, plus a free pool of frames nobody uses. Frames move between five
// places and are always in exactly one of them:
//
//	free pool ─Alloc─► user ─FillRing.Fill─► fill ring ─kernel─► RX ring ─RxRing.Receive─► user
//	user ─TxRing.Send─► TX ring ─kernel─► completion ring ─CompletionRing.Reap─► user ─Free─► free pool
//
// (plus "in the kernel": taken from the fill or TX ring and not yet put in the
// RX or completion ring). Umem.Account checks that invariant frame by frame;
// tests call it after heavy traffic.
//
// A Socket is bound to one (interface, queue). The first socket on a Umem
// registers the area with the kernel on its own descriptor; later ones bind
// with XDP_SHARED_UMEM. A socket belongs to the network namespace of the
// thread that opens it, and so does the interface index it binds to: open
// sockets on a thread that is in the interface's namespace. Sockets on the same (interface, queue) share that queue's
// fill and completion rings (the kernel gives them one buffer pool); a socket
// on another queue gets its own pair. That is how a second consumer — the
// ingest engine next to the bridge — can receive on a queue the bridge already
// uses: it opens its socket on the bridge's Umem and puts it in its own
// XSKMAP; frames it receives go back through the shared fill ring.
//
// # Rings and ordering
//
// Each ring is single-producer/single-consumer shared with the kernel: the
// producer writes entries then publishes its index with a release store; the
// consumer loads the other side's index with an acquire load, reads entries,
// then publishes its own index. Go's sync/atomic operations are sequentially
// consistent, which is at least acquire/release. Each side caches the other's
// index and reloads it only when the cached value says the ring is full (or
// empty), so a batch costs one shared load and one store. Batches are up to
// MaxBatch entries.
//
// The kernel works the same way on its side, and publishes how far it has
// consumed the fill and TX rings only when it has used up the entries it
// last saw. A producer can therefore find a ring full that the kernel has in
// fact emptied: Fill and Send may take fewer entries than asked even when
// every frame the caller owns would fit. Keep what they refuse and offer it
// again (dropping it loses the frame for good), and size the fill and TX
// rings at twice the frames they carry, so that they never look full.
//
// RxRing, TxRing, FillRing and CompletionRing are not safe for concurrent use,
// with one exception: FillRing.Fill and CompletionRing.Reap take a small
// per-ring lock, once per batch, because sockets that share a queue share
// those rings and may be driven from different goroutines.
//
// # Wake-ups and busy polling
//
// Sockets bind with XDP_USE_NEED_WAKEUP unless told otherwise: the kernel
// sets a flag in the fill or TX ring when it needs a system call to make
// progress (FillRing.NeedWakeup, TxRing.NeedWakeup), so a busy ring costs no
// system calls. In copy mode every TX batch needs a Kick. BusyPoll sets
// SO_PREFER_BUSY_POLL, SO_BUSY_POLL and SO_BUSY_POLL_BUDGET so that WakeRX
// and Kick run the driver's NAPI in the caller's context.
//
// # Zero copy
//
// BindZeroCopy asks for XDP_ZEROCOPY and fails where the driver cannot do it
// (veth, for instance); BindCopy forces copy mode; BindAny lets the kernel try
// zero copy and fall back. Socket.ZeroCopy reports what was granted. A failed
// bind leaves the Umem registered with the kernel in an unusable state on some
// kernels, so callers retrying in another mode should start from a fresh Umem.
//
// # Frame layout
//
// A received descriptor's address points at the first byte of the frame;
// the XDP program's metadata, if any, lies just before it (Meta gives it).
// Frames for TX are written at their frame's base address. Addresses are
// offsets into the area; Base rounds one down to its frame.
package xsk
