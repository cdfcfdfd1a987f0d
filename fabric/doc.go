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
// peer's ring positions and each record's length — is validated before use,
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
// (2), u32 descriptor count (4), u32 zero, u64 region length. The
// application answers with the same 24-byte layout (count and length zero);
// either side refuses a different magic or version with ErrBadMagic or
// ErrVersion. The socket stays open: its closing is how each side learns
// that the other is gone (a crashed process closes its sockets too). The
// eventfds are non-blocking; a signal is a write of the 8-byte value 1.
//
// # Region layout (version 2)
//
// All integers are little-endian (the host's order; big-endian builds are
// refused at compile time). Offsets are in bytes from the start of the
// region. The bridge zeroes the region, writes the header, and writes the
// magic last. Version 1, fixed slots, is refused with ErrVersion.
//
//	Header, offset 0, 128 bytes:
//	  0   u32  magic        0x54534246
//	  4   u32  version      2
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
//	  8   u64  data_off     data area offset (multiple of 64)
//	  16  u32  depth        most records queued at once; power of two, 2..1048576
//	  20  u32  max_record   largest record in bytes, multiple of 64, 64..65536
//	                        (largest packet: max_record - 8)
//	  24  u32  data_len     data area bytes, exactly (depth + 1) * max_record,
//	                        at most 2^30
//	  28  u32  reserved 0
//	Control block, 384 bytes (this version places RX's at 128, TX's at 512):
//	  0   u32  write_pos    producer's byte position after its last
//	                        published record                 (producer line)
//	  4   u32  lazy_read_pos producer's last-seen read_pos (informational)
//	  8   u64  drops        packets the producer dropped (informational)
//	  16  u32  cons_armed   1: consumer sleeps, signal it on new data
//	  128 u32  read_pos     consumer's byte position after its last
//	                        released record                  (consumer line)
//	  132 u32  read_count   records (not skip records) released so far;
//	                        read_pos and read_count are one u64 word, written
//	                        and read with single 64-bit atomic accesses
//	  136 u32  lazy_write_pos consumer's last-seen write_pos (informational)
//	  140 u32  prod_armed   1: producer sleeps, signal it on free space
//	  256 128 bytes reserved, zero
//	Record, at an offset o of the data area (o a multiple of 8):
//	  0   u32  len          payload bytes, <= max_record - 8;
//	                        or 0xFFFFFFFF: a skip record
//	  4   u32  meta         producer-defined (the bridge: classifier rule id)
//	  8   len bytes of packet (an IP packet, starting at the IP header),
//	      then zero to 7 bytes of padding: the record takes
//	      8 + (len rounded up to a multiple of 8) bytes
//	This version places the RX data area at 4096 and TX's right after it.
//
// Positions are free-running u32 byte counters, starting at 0; the ring holds
// write_pos - read_pos bytes (mod 2^32), never more than data_len. Each side
// also keeps the offset in the data area of its own position: it starts at 0,
// advances by the length of each record passed, and returns to 0 on reaching
// data_len or after a skip record. (data_len need not divide 2^32, so the
// offset is not the position modulo anything: track it.) Records never cross
// the end of the data area: when the next record does not fit in the data_len
// - o bytes left, the producer writes a skip record (only its len word
// matters) at o, which stands for those bytes, and puts the record at offset
// 0. A skip record is written only right before a record that needs it.
//
// Producer: queue at most depth records (its own count of records written,
// minus read_count). Write records from write_pos on, then store write_pos
// with release order, then, if cons_armed is 1, atomically exchange it 1→0
// and signal the data eventfd. (An armed flag sits on the line of the side
// that clears it, which it writes anyway, so a busy ring moves no extra cache
// line.) To learn about space, load the read_pos/read_count word with acquire
// order. Counting records is enough: with data_len = (depth + 1) × max_record,
// a ring holding fewer than depth records always has room for one more of the
// largest size, skip record included. (Let S be max_record. At most one skip
// record, shorter than S, lies in the queued bytes, so they number less than
// depth × S. If the record fits before the end, at least S bytes are free. If
// not, the producer's offset is above data_len - S = depth × S and the queued
// bytes cannot cross the end (if they did, the free bytes would be the gap
// between the two offsets, less than S, so more than depth × S would be
// queued), so the consumer's offset exceeds depth × S -
// (depth - 1) × S = S: the skip record and a record at offset 0 both fit.) A
// producer that finds room in records but not in bytes has met a consumer
// whose read_pos lags its read_count, and treats it as corruption.
//
// Consumer: load write_pos with acquire order, copy records from its offset
// until its position reaches write_pos, store the read_pos/read_count word
// with release order (one store, so the producer never sees a count ahead of
// the position), then likewise wake a producer whose prod_armed is 1 through
// the space eventfd. The lazy_* words mirror what each side last saw of the
// other; nobody reads them back, so any store will do.
//
// A sleeper atomically exchanges 1 into its armed word, re-reads the other
// side's position, and only then sleeps. The position store and the flag
// test, and the flag set and the position re-read, must each be ordered
// store-before-load (C11 seq_cst, or an atomic read-modify-write such as x86
// XCHG on either side): this is the Dekker pattern that guarantees no wake-up
// is lost.
//
// Validation, all in u32 modular arithmetic. A newly read write_pos must be a
// multiple of 8 and satisfy write_pos - read_pos <= data_len and write_pos -
// read_pos >= old_write_pos - read_pos (it never moves back). A newly read
// read_pos must be a multiple of 8 and satisfy read_pos - old_read_pos <=
// write_pos - old_read_pos (between what was seen before and what was
// written), and read_count likewise between the count seen before and the
// records written. A record at offset o, with A = write_pos - read_pos bytes
// published ahead of the consumer: a skip record needs data_len - o <= A;
// any other record needs len <= max_record - 8, and its record length L <=
// data_len - o (it does not cross the end) and L <= A (it was published).
// Everything else — a skip record that was not needed, padding contents,
// meta — cannot hurt the reader and is not checked. The RX ring never blocks
// its producer (the bridge drops the newest packets and adds them to drops);
// the TX ring blocks the application instead.
//
// # Variable-length records rather than fixed slots
//
// Measured, not assumed (BenchmarkRingRate against version 1's slots in the
// same runs; numbers and commands in BENCHMARKS.md). Version 1 gave every
// packet a fixed slot of max_record bytes. Records pack packets: a 64-byte
// packet takes 72 bytes instead of two cache lines of a 2048-byte slot, so
// small packets share lines and the same lines hold more of them. The bare
// ring moved 2.4-2.5x more 64-byte packets in batches, 2-5x more of a mix of
// sizes, and 1.05-1.3x more 1500-byte ones; a stream sending 64-byte
// packets in batches went from 14-27 M to 30-80 M per second. Single small
// packets gained nothing measurable (the stream's own per-call work, not the
// ring, bounds them; the bare ring was even 0.8x the slots there), and
// single-packet sends remain short of 10x a Unix datagram socket.
//
// What slots offered is kept. depth is still a count of packets: the bridge
// drops exactly what exceeds RxSlots, and the remote transport's credits and
// the application's windows stay in packets. Config keeps its meaning at the
// price of one extra max_record of memory per ring. A hostile peer costs
// three comparisons per record instead of one, which did not show in the
// measurements. The packet cap is also why small records do not reach the
// rate of an uncapped record ring for single packets: 1024 of them fill only
// 72 KiB, so a producer that outruns its consumer works on a full ring.
//
// # Calls: concurrency, Close and counters
//
// Send, SendMeta, TryRecv, TryRecvMeta, Recv and RecvTimeout may be called
// from several goroutines at once, and Close from any goroutine at any
// time. Each direction of a Stream has a gate (gate.go) instead of a
// sync.Mutex and an atomic counter: one 64-bit word holds the direction's
// packet count and its flags (busy, waiter, closed, broken). An
// uncontended call enters with one load and one compare-and-swap, which
// also finds a closed or broken stream, and leaves with one atomic add
// that clears busy and adds the packets it moved, so Stats is exact and
// costs nothing extra: two locked instructions per call where the mutex
// and counter took three (BenchmarkCall, one core: the stream's own work
// per Send and TryRecv of one packet went from 47-56 ns to 33-43 ns, the
// ring's being 29-40 ns; BENCHMARKS.md). Contenders queue on a mutex behind the gate and
// are poked by the caller that leaves. Close sets closed in both gates
// (new calls fail at once), wakes every waiter, and then takes both gates
// for good before it unmaps the region, so no call is ever inside the
// mapping when it goes away. A Send that blocks for space adds what it
// queued to the count before it sleeps. The two gates and the fields each
// direction writes sit on separate cache lines.
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
