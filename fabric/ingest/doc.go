// Package ingest is the persistent buffer ring of fabricbridge's UDP
// offload path: NaNet's CLOP (circular list of persistent buffers) in
// shared memory. The offload engine (package bridge/ingest) appends the
// payloads of trigger datagrams, already stripped by the XDP program, as
// records into the open buffer; a buffer is published to the consumer when
// it is full or its time window closes, and comes back when the consumer
// releases it. The consumer is a trigger — a GPU kernel reading the region
// in place after cudaHostRegister, or the CPU Reference in this package.
//
// # One ring per ingest buffer, records tagged with their source
//
// NaNet kept one CLOP per stream (per source port). Here every ingest rule
// names one ring (its buffer id), and each record carries a source index
// into a table of (address, source port, destination port). Tagging wins
// for a trigger: it reads all sources of a time window together, so one
// ring already delivers them merged in arrival (RX time) order, which is
// what NaNet-10's merger rebuilt from separate streams; one ring means one
// place to poll and one event per window however many boards send;
// memory is N×B whatever the number of sources. Separate rings remain one
// configuration away: give each source its own ingest rule and buffer id.
//
// # A bounded source table
//
// The table has Config.MaxSources entries. When it is full, a new source
// takes over the entry of the least recently seen source, provided that
// source has sent nothing for Config.SourceIdle and the consumer has
// released every buffer holding one of its records; otherwise the new
// source's datagram is dropped and counted (Stats.SourceFull). So a burst
// of new sources, spoofed addresses or ports included, fills the table for
// as long as it lasts plus SourceIdle, never for good, and the sources in
// the table when it starts keep their entries while they go on sending. An
// entry given to another source (Stats.SourceEvicted) has its
// generation incremented, which every record carries (source_gen), and the
// new source's sequence starts at 0: a consumer tracking a source by its
// index starts afresh when the generation changes, and an evicted source
// that comes back is a new source, maybe in another entry. Because no
// unreleased buffer names an entry's previous source, a consumer reading
// the entry for a record it holds always reads the record's source.
//
// # Several receive queues, one ring
//
// The NIC spreads flows over receive queues by hashing their addresses and
// ports (RSS; on veth, the sender's transmit queue, itself chosen by flow
// hash or XPS), so all datagrams of one source arrive on one queue, in
// order. The engine runs a loop per queue and appends a queue's batch under
// a per-ring lock, so each queue's datagrams keep their order and the ring
// keeps one producer at a time: per-source order holds. Order across
// sources is arrival order per queue, interleaved batch by batch between
// queues; record RX times within a buffer are therefore not monotonic, and
// first_ns/last_ns are the earliest and latest of them. A record is never
// held back for its window: one that waited in a queue while another
// queue's traffic opened a later window lands in the later buffer, and its
// own rx_ns says where it belongs. A source whose flow moves to another
// queue (the NIC's indirection table changed) may see one batch
// reordered, which the per-source sequence cannot show (it is assigned
// here); the sender's own sequence numbers do (Reference counts
// SenderBackwards).
// With Config.AlignWindows, windows are aligned on the RX clock
// ([k·W, (k+1)·W)), so a buffer is exactly one time window of every source
// and rings on different hosts cut time identically.
//
// # Protocol
//
// The producer fills buffer k = seq mod N, strictly in ring order, only if
// its descriptor's state is free. It writes records, then the descriptor,
// then stores state = ready (release), then the header's published count,
// then, if the consumer armed its wake-up flag, clears it (an atomic
// read-modify-write) and signals the eventfd. When buffer seq mod N is not
// free the datagram is dropped and counted (Stats.NoBuffer): a buffer the
// consumer holds is never overwritten. The consumer waits for
// descriptor (next mod N) to be ready with sequence number next, reads it,
// and stores state = free (release) when done; buffers may be released in
// any order. A sleeping consumer stores 1 into the armed flag with an
// atomic exchange, re-checks the state, and only then sleeps (CLAN's
// tripwire); a GPU kernel simply polls the state word.
//
// A consumer that attaches starts at the producer's published count and
// releases, as stale, every buffer published before (filled while nobody
// read, or held by a consumer that died). Consumers find the ring by name:
// a Unix socket (in Dir(), or a path) over which the producer hands the
// region's sealed memfd and the wake-up eventfd to one consumer at a time;
// the socket's closing tells each side that the other is gone.
//
// # Trust
//
// The consumer validates everything it reads: the header against the
// mapping's size, each descriptor's sequence number, byte and record
// counts, and each record's size, payload length and source index, so a
// broken producer ends the walk with ErrCorruption instead of a read
// outside the buffer. The producer reads back only the state words, and
// only "free" hands a buffer back to it, so a scribbling consumer can lose
// its own data but never make the producer overwrite a held buffer or
// index outside the region. The memfd is sealed against resizing.
//
// # Region layout (version 1)
//
// Little-endian (the host's order; big-endian builds do not compile).
// Offsets in bytes from the start of the region, which is page aligned
// (2 MiB aligned in size when on hugetlb pages). The producer zeroes the
// region, writes the header, and stores the magic last. fb_ingest.h in
// this directory declares the same layout for C and CUDA.
//
//	Header, offset 0, 4096 bytes:
//	  0    u32  magic         0x4e494246 ("FBIN")
//	  4    u32  version       1
//	  8    u32  header_len    4096
//	  12   u32  flags         1 hugetlb, 2 locked, 4 aligned windows
//	  16   u64  region_len    total bytes (= the memfd's size)
//	  24   u32  buffer_count  N, 2..65536
//	  28   u32  buffer_size   B, a multiple of 4096
//	  32   u64  desc_off      descriptor array (N × 64 bytes)
//	  40   u64  sources_off   source table (max_sources × 32 bytes)
//	  48   u32  max_sources
//	  52   u32  record_align  8
//	  56   u64  buffers_off   buffer k at buffers_off + k·B (page aligned)
//	  64   u64  window_ns
//	  72   u32  buffer_id     the ingest rule's buffer (stream) id
//	  producer's line (the producer writes, the consumer reads):
//	  128  u64  published     buffers published so far (next sequence number)
//	  136  u32  source_count  valid entries in the source table (never decreases)
//	  140  u32  producer_state 1 open, 2 closed
//	  144  u64  records       records written (informational)
//	  152  u64  dropped       datagrams dropped (informational)
//	  160  u32  cons_armed    1: the consumer sleeps; the producer clears it and signals
//	  consumer's line (the consumer writes):
//	  256  u32  consumer_state 1 attached, 2 closed
//	  264  u64  next_seq      the consumer's next sequence number (informational)
//	  272  u64  released      buffers released (informational)
//	Descriptor k, at desc_off + 64·k:
//	  0    u32  state         0 free (producer's), 1 ready (consumer's)
//	  4    u32  records       records in the buffer, >= 1
//	  8    u64  seq           publication number; k = seq mod N
//	  16   u32  bytes         bytes of records from the buffer's start, <= B
//	  20   u32  flags         1 window closed, 2 full, 4 flushed, 8 window continues
//	  24   u64  first_ns      earliest RX time of its records (CLOCK_MONOTONIC)
//	  32   u64  last_ns       latest RX time of its records
//	  40   u64  window_ns     start of the buffer's window
//	  48   u64  publish_ns    when it was published
//	  56   u64  reserved
//	Source entry j, at sources_off + 32·j:
//	  0    16 bytes address  IPv6, or IPv4-mapped (::ffff:a.b.c.d)
//	  16   u16  src_port
//	  18   u16  dst_port
//	  20   u32  flags         1 IPv6
//	  24   u64  first_ns      RX time of its first datagram
//	Record, at any multiple of 8 inside a buffer, the first at offset 0:
//	  0    u32  size          bytes to the next record: 24 + payload, rounded up to 8
//	  4    u16  payload_len
//	  6    u16  source        index into the source table
//	  8    u64  rx_ns         RX timestamp (CLOCK_MONOTONIC: from XDP, or the
//	                          packet socket's stamp on the AF_PACKET path)
//	  16   u32  seq           per-source sequence: every datagram of the source
//	                          that reached the producer, stored or dropped
//	  20   u32  source_gen    the source entry's generation: how many sources
//	                          held the entry before this one
//	  24   payload
//
// # Reading the region from CUDA
//
// The region is an ordinary shared mapping of a memfd, page aligned and
// (when the system allows) locked and on huge pages, so a CUDA consumer
// can pin it for device access without copying: receive the memfd as Open
// does (or map it in a Go process and pass the pointer to C), mmap it
// MAP_SHARED, then cudaHostRegister(base, region_len,
// cudaHostRegisterMapped | cudaHostRegisterPortable) and
// cudaHostGetDevicePointer. A persistent kernel polls descriptor
// (next mod N)'s state with volatile loads (PCIe reads of host memory),
// reads first_ns..bytes after seeing ready (the producer's release store
// orders them), processes the records in place (their payloads are
// 8-byte aligned), then issues __threadfence_system() and stores state = 0
// to release. It must check the same bounds as RecordIter. The wake-up
// eventfd is only for CPU consumers that sleep.
//
// # Latency
//
// Every buffer's latency is measured from its first record's RX timestamp
// (taken by the XDP program) to the consumer's wake-up on it, into a
// histogram (ConsumerStats.Latency), with a budget and a violation count.
// The first record waits for its window to close unless the buffer fills
// first, so the window bounds the latency at low rates: choose it well
// under the budget.
//
// Beyond the window, the latency is two thread wake-ups (the engine's on
// the first frame, the consumer's on the publication), and on a machine
// whose CPUs are shared its tail is those threads waiting for a CPU:
// milliseconds, even tens of them, on a loaded 2-vCPU VM, and none of it
// garbage collection. A consumer that must keep the tail short runs on a
// real-time thread (LockRealtime, with ConsumerOptions.NoYield), as the
// engine can (bridge/ingest Config.Priority); a process that hosts such
// threads needs more Go processors (GOMAXPROCS) than it has real-time
// threads, or they wait for a processor instead of a CPU. See BENCHMARKS.md,
// Ingest, for what it bought.
package ingest
