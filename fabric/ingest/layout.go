package ingest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Layout constants: the contract with every consumer, including C and CUDA
// programs (fb_ingest.h spells the same numbers). Changing any of them
// means bumping Version, so that mismatched sides refuse each other.
//
// A region is little-endian (the host's order; big-endian builds do not
// compile), page aligned, and 2 MiB aligned in size when on hugetlb pages.
// It holds the header page, then N descriptors, then the source table, then
// N buffers of B bytes each, page aligned; the header gives each part's
// offset. The producer zeroes the region, writes the header and stores the
// magic last. The protocol over this layout is in docs/ingest.md.
const (
	// Magic is the first word of an ingest region: the bytes "FBIN".
	Magic uint32 = 0x4e494246
	// Version is the layout version this package writes and accepts.
	Version uint32 = 1

	headerLen      = 4096 // the header page
	descSize       = 64   // one buffer descriptor: one cache line
	sourceSize     = 32   // one source-table entry
	RecordHeader   = 24   // bytes in front of every record's payload
	RecordAlign    = 8    // records start on multiples of this
	pageSize       = 4096
	hugePageSize   = 2 << 20
	maxBuffers     = 1 << 16
	minBufferSize  = pageSize
	maxBufferSize  = 1 << 30
	maxRegionBytes = 1 << 40
)

// Header offsets. The header, at offset 0, headerLen bytes:
//
//	0    u32  magic           Magic, "FBIN"
//	4    u32  version         Version
//	8    u32  header_len      4096
//	12   u32  flags           FlagHugetlb, FlagLocked, FlagAlignedWindows
//	16   u64  region_len      total bytes (= the memfd's size)
//	24   u32  buffer_count    N, 2..65536
//	28   u32  buffer_size     B, a multiple of 4096
//	32   u64  desc_off        descriptor array (N × 64 bytes)
//	40   u64  sources_off     source table (max_sources × 32 bytes)
//	48   u32  max_sources
//	52   u32  record_align    RecordAlign
//	56   u64  buffers_off     buffer k at buffers_off + k·B (page aligned)
//	64   u64  window_ns
//	72   u32  buffer_id       the ingest rule's buffer (stream) id
//	producer's line (the producer writes, the consumer reads):
//	128  u64  published       buffers published so far (the next sequence number)
//	136  u32  source_count    valid entries in the source table (never decreases)
//	140  u32  producer_state  sideOpen, sideClosed
//	144  u64  records         records written (informational)
//	152  u64  dropped         datagrams dropped (informational)
//	160  u32  cons_armed      1: the consumer sleeps; the producer clears it and signals
//	consumer's line (the consumer writes):
//	256  u32  consumer_state  1 attached, 2 closed
//	264  u64  next_seq        the consumer's next sequence number (informational)
//	272  u64  released        buffers released (informational)
const (
	hMagic        = 0
	hVersion      = 4
	hHeaderLen    = 8
	hFlags        = 12
	hRegionLen    = 16
	hBufferCount  = 24
	hBufferSize   = 28
	hDescOff      = 32
	hSourcesOff   = 40
	hMaxSources   = 48
	hRecordAlign  = 52
	hBuffersOff   = 56
	hWindowNs     = 64
	hBufferID     = 72
	hPublished    = 128 // producer line
	hSourceCount  = 136
	hProdState    = 140
	hRecords      = 144
	hDropped      = 152
	hConsArmed    = 160
	hConsState    = 256 // consumer line
	hConsNextSeq  = 264
	hConsReleased = 272
)

// Header flags.
const (
	FlagHugetlb        = 1 << 0 // the region is backed by hugetlb pages
	FlagLocked         = 1 << 1 // the region is locked in memory (mlock)
	FlagAlignedWindows = 1 << 2 // windows are aligned to multiples of the window on the RX clock
)

// Descriptor offsets. Descriptor k, one cache line at desc_off + 64·k:
//
//	0   u32  state       stateFree (the producer's), stateReady (the consumer's)
//	4   u32  records     records in the buffer, at least 1
//	8   u64  seq         publication number; k = seq mod N
//	16  u32  bytes       bytes of records from the buffer's start, at most B
//	20  u32  flags       BufWindow, BufFull, BufFlushed, BufContinued
//	24  u64  first_ns    earliest RX time of its records (CLOCK_MONOTONIC)
//	32  u64  last_ns     latest RX time of its records
//	40  u64  window_ns   start of the buffer's window
//	48  u64  publish_ns  when it was published
//	56  u64  reserved
const (
	dState     = 0
	dRecords   = 4
	dSeq       = 8
	dBytes     = 16
	dFlags     = 20
	dFirstNs   = 24
	dLastNs    = 32
	dWindowNs  = 40
	dPublishNs = 48
)

// Descriptor states. Only these two words are written by both sides: the
// producer stores ready, the consumer stores free.
const (
	stateFree  = 0
	stateReady = 1
)

// Buffer flags: why a buffer was published.
const (
	BufWindow    = 1 << 0 // its time window closed
	BufFull      = 1 << 1 // the next record did not fit
	BufFlushed   = 1 << 2 // the producer flushed it (closing)
	BufContinued = 1 << 3 // aligned windows: the window goes on in the next buffer
)

// Source-table offsets. Entry j, at sources_off + 32·j:
//
//	0   16 bytes  address   IPv6, or IPv4-mapped (::ffff:a.b.c.d)
//	16  u16       src_port
//	18  u16       dst_port
//	20  u32       flags     1: IPv6
//	24  u64       first_ns  RX time of its first datagram
const (
	sAddr    = 0
	sSrcPort = 16
	sDstPort = 18
	sFlags   = 20
	sFirstNs = 24
)

// Record header offsets. A record starts at a multiple of RecordAlign
// inside a buffer, the first at offset 0:
//
//	0   u32  size         bytes to the next record: RecordHeader + payload, rounded up to 8
//	4   u16  payload_len
//	6   u16  source       index into the source table
//	8   u64  rx_ns        RX timestamp (CLOCK_MONOTONIC: from XDP, or the packet
//	                      socket's stamp on the AF_PACKET path)
//	16  u32  seq          per-source sequence: every datagram of the source that
//	                      reached the producer, stored or dropped
//	20  u32  source_gen   the source entry's generation: how many sources held
//	                      the entry before this one (a change restarts seq)
//	24  payload, 8-byte aligned
const (
	rSize       = 0
	rPayloadLen = 4
	rSource     = 6
	rRxNs       = 8
	rSeq        = 16
	rSourceGen  = 20
)

// Producer and consumer states in the header.
const (
	sideNone   = 0
	sideOpen   = 1
	sideClosed = 2
)

// Errors.
var (
	ErrBadMagic   = errors.New("ingest: not an ingest region (bad magic)")
	ErrVersion    = errors.New("ingest: layout version mismatch")
	ErrBadLayout  = errors.New("ingest: malformed region layout")
	ErrBadConfig  = errors.New("ingest: invalid configuration")
	ErrCorruption = errors.New("ingest: producer corrupted shared state")
	ErrTimeout    = errors.New("ingest: timeout")
	ErrClosed     = errors.New("ingest: closed")
	ErrBusy       = errors.New("ingest: another consumer is attached")
	ErrReleased   = errors.New("ingest: buffer already released")
)

// Defaults of the source table (Config.MaxSources, Config.SourceIdle).
const (
	DefaultMaxSources = 256
	MaxSourcesCap     = 1 << 16 // the most Config.MaxSources may be
	DefaultSourceIdle = time.Second
)

// Config sizes a ring. Zero fields take defaults.
type Config struct {
	// Name is how consumers find the ring: a plain name ([A-Za-z0-9._-],
	// a socket in Dir()) or a path containing a slash (the socket itself).
	Name string
	// Buffers is N, the number of buffers, 2..65536; default 64.
	Buffers int
	// BufferSize is B in bytes, a multiple of 4096 in 4096..1 GiB;
	// default 1 MiB. A datagram needs RecordHeader bytes more than its
	// payload, rounded up to RecordAlign.
	BufferSize int
	// Window is how long a buffer may collect records before it is
	// published: from its first record's RX time, or, with AlignWindows,
	// to the end of the aligned window that record falls in. Default
	// 100 µs; at least 1 µs.
	Window time.Duration
	// AlignWindows makes windows [k·Window, (k+1)·Window) on the RX clock,
	// the same for every ring: NaNet-10's merger, so a buffer holds
	// exactly one window of all sources (split over several buffers,
	// flagged BufContinued, if it does not fit one).
	AlignWindows bool
	// MaxSources bounds the source table, 1..65536; default 256. A new
	// source finding the table full takes over the entry of the least
	// recently seen source if that one may be evicted (see SourceIdle);
	// otherwise its datagram is dropped and counted (Stats.SourceFull).
	MaxSources int
	// SourceIdle is how long a source must have sent nothing before its
	// entry may go to a new source; the entry must also no longer be named
	// by a record in a buffer the consumer holds or has yet to read, so
	// with no consumer attached only sources none of whose datagrams
	// were stored are evicted. An evicted source that sends again is a new
	// source: it gets an entry (maybe another one), its sequence starts
	// again at 0, and the entry's generation (Record.SourceGen) changes.
	// Default 1 s; negative: never evict, the table fills for good.
	SourceIdle time.Duration
	// BufferID is the ingest buffer (the rule's Stream id) this ring
	// serves; informational, for consumers and metrics.
	BufferID uint32
	// NoHugepages skips the attempt to use hugetlb pages.
	NoHugepages bool
}

func (c Config) withDefaults() Config {
	if c.Buffers == 0 {
		c.Buffers = 64
	}
	if c.BufferSize == 0 {
		c.BufferSize = 1 << 20
	}
	if c.Window == 0 {
		c.Window = 100 * time.Microsecond
	}
	if c.MaxSources == 0 {
		c.MaxSources = DefaultMaxSources
	}
	if c.SourceIdle == 0 {
		c.SourceIdle = DefaultSourceIdle
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	if _, err := socketPath(c.Name); err != nil {
		errs = append(errs, err)
	}
	if c.Buffers < 2 || c.Buffers > maxBuffers {
		errs = append(errs, fmt.Errorf("buffers %d outside 2..%d", c.Buffers, maxBuffers))
	}
	if c.BufferSize < minBufferSize || c.BufferSize > maxBufferSize || c.BufferSize%pageSize != 0 {
		errs = append(errs, fmt.Errorf("buffer size %d: a multiple of %d in %d..%d", c.BufferSize, pageSize, minBufferSize, maxBufferSize))
	}
	if c.Window < time.Microsecond {
		errs = append(errs, fmt.Errorf("window %v under 1µs", c.Window))
	}
	if c.MaxSources < 1 || c.MaxSources > MaxSourcesCap {
		errs = append(errs, fmt.Errorf("max sources %d outside 1..%d", c.MaxSources, MaxSourcesCap))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	return nil
}

// layout is where everything is in a region.
type layout struct {
	buffers, bufferSize, maxSources int
	descOff, sourcesOff, buffersOff uint64
	size                            uint64
	windowNs                        uint64
	flags                           uint32
	bufferID                        uint32
}

func roundUp(n, to uint64) uint64 { return (n + to - 1) / to * to }

func computeLayout(c Config, huge bool) layout {
	l := layout{buffers: c.Buffers, bufferSize: c.BufferSize, maxSources: c.MaxSources,
		windowNs: uint64(c.Window.Nanoseconds()), bufferID: c.BufferID}
	l.descOff = headerLen
	l.sourcesOff = roundUp(l.descOff+uint64(c.Buffers)*descSize, pageSize)
	l.buffersOff = roundUp(l.sourcesOff+uint64(c.MaxSources)*sourceSize, pageSize)
	l.size = l.buffersOff + uint64(c.Buffers)*uint64(c.BufferSize)
	if huge {
		l.size = roundUp(l.size, hugePageSize)
		l.flags |= FlagHugetlb
	}
	if c.AlignWindows {
		l.flags |= FlagAlignedWindows
	}
	return l
}

// writeHeader fills a zeroed region's header; the magic goes last so a
// reader never sees a half-written header with a valid magic.
func writeHeader(mem []byte, l layout) {
	le := binary.LittleEndian
	le.PutUint32(mem[hVersion:], Version)
	le.PutUint32(mem[hHeaderLen:], headerLen)
	le.PutUint32(mem[hFlags:], l.flags)
	le.PutUint64(mem[hRegionLen:], l.size)
	le.PutUint32(mem[hBufferCount:], uint32(l.buffers))
	le.PutUint32(mem[hBufferSize:], uint32(l.bufferSize))
	le.PutUint64(mem[hDescOff:], l.descOff)
	le.PutUint64(mem[hSourcesOff:], l.sourcesOff)
	le.PutUint32(mem[hMaxSources:], uint32(l.maxSources))
	le.PutUint32(mem[hRecordAlign:], RecordAlign)
	le.PutUint64(mem[hBuffersOff:], l.buffersOff)
	le.PutUint64(mem[hWindowNs:], l.windowNs)
	le.PutUint32(mem[hBufferID:], l.bufferID)
	storeU32(mem, hMagic, Magic)
}

// readHeader validates a mapped region of size bytes and returns its
// layout. Every offset and count is checked against the mapping, so that
// nothing later can index outside it.
func readHeader(mem []byte) (layout, error) {
	var l layout
	size := uint64(len(mem))
	if size < headerLen {
		return l, fmt.Errorf("%w: %d bytes, under the %d-byte header", ErrBadLayout, size, headerLen)
	}
	le := binary.LittleEndian
	if m := loadU32(mem, hMagic); m != Magic {
		return l, fmt.Errorf("%w: %#08x", ErrBadMagic, m)
	}
	if v := le.Uint32(mem[hVersion:]); v != Version {
		return l, fmt.Errorf("%w: region has version %d, this build reads %d", ErrVersion, v, Version)
	}
	bad := func(format string, args ...any) (layout, error) {
		return layout{}, fmt.Errorf("%w: "+format, append([]any{ErrBadLayout}, args...)...)
	}
	if h := le.Uint32(mem[hHeaderLen:]); h != headerLen {
		return bad("header length %d", h)
	}
	if r := le.Uint64(mem[hRegionLen:]); r != size {
		return bad("region length %d, mapping %d", r, size)
	}
	if a := le.Uint32(mem[hRecordAlign:]); a != RecordAlign {
		return bad("record alignment %d", a)
	}
	l.flags = le.Uint32(mem[hFlags:])
	l.buffers = int(le.Uint32(mem[hBufferCount:]))
	l.bufferSize = int(le.Uint32(mem[hBufferSize:]))
	l.maxSources = int(le.Uint32(mem[hMaxSources:]))
	l.descOff = le.Uint64(mem[hDescOff:])
	l.sourcesOff = le.Uint64(mem[hSourcesOff:])
	l.buffersOff = le.Uint64(mem[hBuffersOff:])
	l.windowNs = le.Uint64(mem[hWindowNs:])
	l.bufferID = le.Uint32(mem[hBufferID:])
	l.size = size
	switch {
	case l.buffers < 2 || l.buffers > maxBuffers:
		return bad("%d buffers", l.buffers)
	case l.bufferSize < minBufferSize || l.bufferSize > maxBufferSize || l.bufferSize%RecordAlign != 0:
		return bad("buffer size %d", l.bufferSize)
	case l.maxSources < 1 || l.maxSources > MaxSourcesCap:
		return bad("%d sources", l.maxSources)
	case l.descOff < headerLen || l.descOff%descSize != 0 || l.descOff+uint64(l.buffers)*descSize > size:
		return bad("descriptors at %d", l.descOff)
	case l.sourcesOff < headerLen || l.sourcesOff%8 != 0 || l.sourcesOff+uint64(l.maxSources)*sourceSize > size:
		return bad("source table at %d", l.sourcesOff)
	case l.buffersOff < headerLen || l.buffersOff%pageSize != 0 || l.buffersOff+uint64(l.buffers)*uint64(l.bufferSize) > size:
		return bad("buffers at %d", l.buffersOff)
	case overlaps(l.descOff, uint64(l.buffers)*descSize, l.sourcesOff, uint64(l.maxSources)*sourceSize),
		overlaps(l.descOff, uint64(l.buffers)*descSize, l.buffersOff, uint64(l.buffers)*uint64(l.bufferSize)),
		overlaps(l.sourcesOff, uint64(l.maxSources)*sourceSize, l.buffersOff, uint64(l.buffers)*uint64(l.bufferSize)):
		return bad("descriptors, sources and buffers overlap")
	case l.windowNs == 0:
		return bad("zero window")
	}
	return l, nil
}

func overlaps(a, alen, b, blen uint64) bool { return a < b+blen && b < a+alen }

func (l *layout) desc(k int) uint64   { return l.descOff + uint64(k)*descSize }
func (l *layout) source(j int) uint64 { return l.sourcesOff + uint64(j)*sourceSize }
func (l *layout) buffer(k int) uint64 { return l.buffersOff + uint64(k)*uint64(l.bufferSize) }
