// Package fabric carries packets between the bridge and applications.
//
// A stream is CLAN's distributed message queue done in shared memory: two
// single-producer/single-consumer packet rings, RX (bridge to application)
// and TX (application to bridge), in one region that both processes map.
// Each side keeps its own authoritative indices in private memory and a
// lazy copy of the other side's index, so a batch of packets costs one
// release store of an index and, while the peer is awake, no system call.
// Sleeping uses a tripwire (Waiter): spin, arm a flag in the region,
// re-check, sleep on an eventfd; the other side signals only armed flags.
// EventQueue gathers the TX wake-ups of many streams for the bridge, one
// epoll event per idle-to-busy transition. The shm transport (NewShm,
// Handover, AttachShm, ListenShm, DialShm) passes the memfd and eventfds
// over a Unix socket; the remote transport (Remote) carries the same
// packets over UDP in GENEVE for applications on other nodes. Both give
// the application the same Link: a user-space stack runs over either.
//
// # Trust
//
// The bridge never trusts the region. Everything it reads from it — the
// peer's ring index and each slot's length — is validated before use,
// lengths are read once, and its own indices are never read back. A
// violation marks the stream Broken and it is never touched again. The
// memfd is sealed (F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL) before handover so
// the application cannot truncate it under the bridge's mapping. The
// application validates the region the same way.
//
// # Handshake (Unix stream socket)
//
// The bridge sends one message of 24 bytes with SCM_RIGHTS carrying four
// descriptors, in order: the region memfd, the RX-data eventfd (bridge
// signals, application sleeps), the TX-data eventfd (application signals,
// bridge sleeps) and the TX-space eventfd (bridge signals, application
// sleeps for room). Message: u32 magic 0x54534246 ("FBST"), u32 version
// (1), u32 descriptor count (4), u32 zero, u64 region length. The
// application answers with the same 24-byte layout (count and length zero);
// either side refuses a different magic or version with ErrBadMagic or
// ErrVersion. The socket stays open: its closing is how each side learns
// that the other is gone (a crashed process closes its sockets too). The
// eventfds are non-blocking; a signal is a write of the 8-byte value 1.
//
// # Region layout (version 1)
//
// All integers are little-endian (the host's order; big-endian builds are
// refused at compile time). Offsets are in bytes from the start of the
// region. The bridge zeroes the region, writes the header, and writes the
// magic last.
//
//	Header, offset 0, 128 bytes:
//	  0   u32  magic        0x54534246
//	  4   u32  version      1
//	  8   u32  header_len   128
//	  12  u32  flags        0
//	  16  u64  region_len   total bytes, = memfd size (a multiple of 4096)
//	  24  u32  bridge_state 0 init, 1 open, 2 closed (written by the bridge)
//	  28  u32  app_state    0 init, 1 open, 2 closed (written by the app)
//	  32  ring descriptor RX (32 bytes)
//	  64  ring descriptor TX (32 bytes)
//	  96  32 bytes zero
//	Ring descriptor:
//	  0   u64  ctl_off      control block offset (multiple of 128)
//	  8   u64  slots_off    slot array offset (multiple of 64)
//	  16  u32  slot_count   power of two, 2..1048576
//	  20  u32  slot_stride  bytes per slot, multiple of 64, 64..65536
//	  24  u64  reserved 0
//	Control block, 384 bytes (this version places RX's at 128, TX's at 512):
//	  0   u32  write_i      producer's next slot index  (producer line)
//	  4   u32  lazy_read_i  producer's last-seen read_i (informational)
//	  8   u64  drops        packets the producer dropped (informational)
//	  16  u32  cons_armed   1: consumer sleeps, signal it on new data
//	  128 u32  read_i       consumer's next slot index  (consumer line)
//	  132 u32  lazy_write_i consumer's last-seen write_i (informational)
//	  136 u32  prod_armed   1: producer sleeps, signal it on free space
//	  256 128 bytes reserved, zero
//	Slot i of a ring is at slots_off + (index mod slot_count) * slot_stride:
//	  0   u32  len          payload bytes, <= slot_stride - 8
//	  4   u32  meta         producer-defined (the bridge: classifier rule id)
//	  8   len bytes of packet (an IP packet, starting at the IP header)
//	This version places RX slots at 4096 and TX slots right after them.
//
// Indices are free-running u32 counters; the ring holds write_i - read_i
// packets (mod 2^32), never more than slot_count. Producer: write slots
// [write_i, read_i + slot_count), then store write_i with release order,
// then, if cons_armed is 1, atomically exchange it 1→0 and signal the data
// eventfd. (An armed flag sits on the line of the side that clears it,
// which it writes anyway, so a busy ring moves no extra cache line.) Consumer: load write_i with acquire order, copy slots, store
// read_i with release order, then likewise wake a producer whose
// prod_armed is 1 through the space eventfd. A sleeper atomically
// exchanges 1 into its armed word, re-reads the other index, and only then
// sleeps. The index store and the flag test, and the flag set and the
// index re-read, must each be ordered store-before-load (C11 seq_cst, or an
// atomic read-modify-write such as x86 XCHG on either side): this is the
// Dekker pattern that guarantees no wake-up is lost. Validation, all in
// u32 modular arithmetic: a newly read write_i must satisfy
// write_i - read_i <= slot_count and write_i - read_i >= old_write_i -
// read_i (it never moves back); a newly read read_i must satisfy
// read_i - old_read_i <= write_i - old_read_i (it lies between what was
// seen before and write_i); len must be <= slot_stride - 8. The RX ring
// never blocks its producer (the bridge drops the newest packets and adds
// them to drops); the TX ring blocks the application instead.
//
// # Fixed slots rather than variable-length records
//
// Measured, not assumed (BenchmarkSlotsVsRecords; a record-ring prototype
// with the same index discipline, same 2 MiB of ring memory): records move
// packets 1.2 to 4.7 times faster, most for small packets (1.9-2.5x for
// 64 bytes in batches, 3.7-4.7x for a mix sent one at a time) and least
// at 1500 bytes (1.2-1.4x), because a 64-byte packet in a 2048-byte slot
// costs two cache lines where a record costs 1.1 and because the same
// memory holds 28 times more small records. Slots stay, for three reasons
// that outweigh that here. The ring is not the bottleneck: slots run at
// 19-34 M packets/s in batches, against the bridge's whole RX path at
// about 0.4 M/s (BENCHMARKS.md), so a faster ring changes no end-to-end
// number. A depth in packets is a contract: configuration (RxSlots,
// TxSlots), the bridge's drop accounting and its tests, the exact drop
// counts promised when the application stalls, and the remote transport's
// credits are all counted in packets; with records the capacity would
// depend on sizes. And a hostile peer is checked with one comparison per
// slot, where a record needs three and a wrap marker. The price is paid
// where it shows: single-packet sends reach about 5-8x the Unix socket,
// not the 10x goal, and the prototype's single-packet rate suggests
// records would (BENCHMARKS.md). Should a consumer ever be ring-bound,
// records are the measured way forward, as layout version 2, with Config
// keeping its meaning (room for at least RxSlots packets of the largest
// size).
//
// # Remote transport
//
// The wire format is in geneve.go: RFC 8926 GENEVE on UDP port 6081, VNI
// = stream id, protocol type 0x0800 or 0x86DD for data and 0x88B5 (IEEE
// 802 Local Experimental Ethertype 1) for fabric control packets (credits,
// keepalives, goodbye), whose options use the experimental option class
// 0xFFF0. Sending batches with sendmmsg; where the kernel offers UDP GSO a
// run of equal-sized packets is one entry cut into datagrams by the kernel
// or NIC, and where it offers UDP GRO the receiver takes coalesced runs
// and splits them; either side falls back to one datagram per packet
// (RemoteConfig.NoGSO, NoGRO force the fallback). Flow control is credit
// based with two water marks. A stream breaks (ErrPeerGone) when its peer
// says goodbye, stays silent for PeerTimeout (every stream sends a
// keepalive each PeerTimeout/4), or, once heard from, draws an ICMP port
// unreachable (IP_RECVERR). Packets that arrived before are delivered
// first.
package fabric
