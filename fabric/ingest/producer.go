package ingest

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Source names one sender as the offload engine sees it: its address
// (IPv4 as IPv4-mapped IPv6), its port, and the local port it sends to.
type Source struct {
	Addr    [16]byte
	SrcPort uint16
	DstPort uint16
}

// SourceOf builds a Source from an address and ports.
func SourceOf(addr netip.Addr, srcPort, dstPort uint16) Source {
	return Source{Addr: addr.As16(), SrcPort: srcPort, DstPort: dstPort}
}

// AddrPort is the sender's address (IPv4 unmapped) and port.
func (s Source) AddrPort() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(s.Addr).Unmap(), s.SrcPort)
}

func (s Source) String() string { return fmt.Sprintf("%v->:%d", s.AddrPort(), s.DstPort) }

// Ring is the producer's end of a CLOP: it packs datagrams into the open
// buffer and publishes buffers when they fill or their window closes. One
// goroutine at a time calls Append, Tick and Flush (the offload engine
// serialises its per-queue loops with a lock per ring and batch); Stats is
// safe from anywhere. It never reads back anything the consumer could have
// written except a descriptor's state word, and only "free" makes a buffer
// its own again: a consumer that scribbles can lose its own data, never make
// the producer overwrite a buffer it has not released.
type Ring struct {
	cfg  Config
	l    layout
	reg  *region
	mem  []byte
	name string

	// Private producer state.
	seq         uint64 // the open buffer's (or the next one's) sequence number
	open        bool
	off         int // write offset in the open buffer
	records     int
	firstNs     uint64
	lastNs      uint64
	windowStart uint64
	windowEnd   uint64
	carry       bool // aligned windows: the next buffer continues this window
	buf         []byte
	lastSrc     Source
	lastIdx     int // index of lastSrc, -1 before the first record
	table       sourceTable
	st          counters
	synced      counters // st as last copied to shared
	syncedSrc   int
	// released is the producer's view of the consumer: every buffer
	// with a lower sequence number has been released (releasedBelow).
	released uint64
	// publishedNs[k] is when the buffer last published from slot k was
	// published; unreleased[k] says its release is not yet timed.
	publishedNs []uint64
	unreleased  []bool

	// Latency of each buffer, written by the producer goroutine only.
	wireToPublish    Histogram
	publishToRelease Histogram

	shared sharedStats
	srv    *server
	evfd   int
	closed bool
}

// counters are the producer's own, copied to sharedStats at each publish,
// Tick and Flush so that the hot path does no atomic work per datagram.
type counters struct {
	records, bytes, published, noBuffer, tooBig, sourceFull, sourceEvicted uint64
}

type sharedStats struct {
	mu sync.Mutex
	c  counters
	n  int
}

// Stats are a ring's producer-side counters.
type Stats struct {
	Records    uint64 // datagrams written into buffers
	Bytes      uint64 // their payload bytes
	Published  uint64 // buffers published
	NoBuffer   uint64 // datagrams dropped: the next buffer was not released yet
	TooBig     uint64 // datagrams dropped: larger than a buffer
	SourceFull uint64 // datagrams dropped: the source table was full of sources that may not be evicted yet
	// SourceEvicted counts table entries given to a new source because
	// their source had gone idle (Config.SourceIdle).
	SourceEvicted uint64
	Sources       int  // entries of the source table in use
	Hugetlb       bool // backed by hugetlb pages
	Locked        bool // locked in memory
	Attached      bool // a consumer is attached: it sees every buffer published from now on

	// WireToPublish holds, per published buffer, the time from its
	// earliest record's receive timestamp to its publication: the window
	// wait plus the engine's own delay, what a consumer cannot win back.
	WireToPublish HistogramSnapshot
	// PublishToRelease holds, per released buffer, the time from its
	// publication until the producer saw the consumer release it. The
	// producer looks when it opens a buffer and at each Tick, so a release
	// is timed late by at most the time between those; a consumer that
	// releases out of order has its later buffers timed when the earlier
	// one is released or reused.
	PublishToRelease HistogramSnapshot
}

// Dropped is the sum of all drops.
func (s Stats) Dropped() uint64 { return s.NoBuffer + s.TooBig + s.SourceFull }

// Create makes a ring and starts accepting a consumer under cfg.Name.
func Create(cfg Config) (*Ring, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	path, _ := socketPath(cfg.Name)
	reg, l, err := newRegion(cfg, shortName(cfg.Name))
	if err != nil {
		return nil, err
	}
	evfd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		reg.close()
		return nil, fmt.Errorf("ingest: eventfd: %w", err)
	}
	r := &Ring{
		cfg: cfg, l: l, reg: reg, mem: reg.mem, name: cfg.Name,
		table:       newSourceTable(cfg.MaxSources),
		lastIdx:     -1,
		evfd:        evfd,
		publishedNs: make([]uint64, l.buffers),
		unreleased:  make([]bool, l.buffers),
	}
	storeU32(r.mem, hProdState, sideOpen)
	if r.srv, err = serve(path, r); err != nil {
		unix.Close(evfd)
		reg.close()
		return nil, err
	}
	return r, nil
}

func shortName(name string) string {
	for i := len(name) - 1; i >= 0; i-- {
		if name[i] == '/' {
			return name[i+1:]
		}
	}
	return name
}

// LockError says why the region is not locked in memory, or nil.
func (r *Ring) LockError() error { return r.reg.lockErr }

// Append adds one datagram received at rxNs (CLOCK_MONOTONIC, the XDP
// timestamp) from src. It reports whether the datagram was stored; a drop
// is counted. Every datagram from a source advances that source's
// sequence, stored or not, so the consumer sees drops as gaps.
func (r *Ring) Append(src Source, rxNs uint64, payload []byte) bool {
	size := (RecordHeader + len(payload) + RecordAlign - 1) &^ (RecordAlign - 1)
	idx := r.lastIdx
	if idx < 0 || src != r.lastSrc {
		var ok bool
		if idx, ok = r.sourceIndex(src, rxNs); !ok {
			r.st.sourceFull++
			return false
		}
		r.lastSrc, r.lastIdx = src, idx
	}
	e := &r.table.e[idx]
	e.lastNs = max(e.lastNs, rxNs)
	seq := e.seq
	e.seq = seq + 1
	if size > r.l.bufferSize {
		r.st.tooBig++
		return false
	}
	if r.open {
		switch {
		case rxNs >= r.windowEnd:
			r.publish(BufWindow)
		case r.off+size > r.l.bufferSize:
			flags := uint32(BufFull)
			if r.cfg.AlignWindows {
				flags |= BufContinued
				r.carry = true
			}
			r.publish(flags)
		}
	}
	if !r.open && !r.acquire(rxNs) {
		r.st.noBuffer++
		return false
	}
	b := r.buf[r.off : r.off+size]
	le := binary.LittleEndian
	le.PutUint32(b[rSize:], uint32(size))
	le.PutUint16(b[rPayloadLen:], uint16(len(payload)))
	le.PutUint16(b[rSource:], uint16(idx))
	le.PutUint64(b[rRxNs:], rxNs)
	le.PutUint32(b[rSeq:], seq)
	le.PutUint32(b[rSourceGen:], e.gen)
	copy(b[RecordHeader:], payload)
	e.lastBuf = r.seq + 1
	r.off += size
	r.records++
	// Several receive queues feed one ring, a batch at a time: a record
	// can be stamped before the one that opened the buffer.
	r.firstNs = min(r.firstNs, rxNs)
	r.lastNs = max(r.lastNs, rxNs)
	r.st.records++
	r.st.bytes += uint64(len(payload))
	return true
}

// sourceIndex finds or registers src, taking over the entry of the least
// recently seen source if the table is full and that source may be evicted.
// A new entry is written whole before a record that names it is published
// (or, for a fresh entry, before the count that makes it visible).
func (r *Ring) sourceIndex(src Source, rxNs uint64) (int, bool) {
	t := &r.table
	if i, ok := t.index[src]; ok {
		t.touch(int(i))
		return int(i), true
	}
	n := len(t.index)
	if n < r.l.maxSources {
		r.writeSource(n, src, rxNs)
		t.add(n, src, rxNs)
		storeU32(r.mem, hSourceCount, uint32(n+1))
		return n, true
	}
	j := t.lru()
	if !r.evictable(j, rxNs) {
		return 0, false
	}
	r.writeSource(j, src, rxNs)
	t.reassign(j, src, rxNs)
	r.st.sourceEvicted++
	return j, true
}

// evictable reports whether entry j's source may give its entry up at
// rxNs: it has been idle for SourceIdle, and the consumer has released
// every buffer holding one of its records, so no record it will read can
// name the entry's previous source.
func (r *Ring) evictable(j int, rxNs uint64) bool {
	if r.cfg.SourceIdle < 0 {
		return false
	}
	e := &r.table.e[j]
	if rxNs < e.lastNs || rxNs-e.lastNs < uint64(r.cfg.SourceIdle) {
		return false
	}
	return e.lastBuf == 0 || e.lastBuf-1 < r.releasedBelow()
}

// releasedBelow advances and returns r.released: the consumer has
// released every buffer with a lower sequence number. A buffer the
// producer has filled again since was released; of the others, published
// and not refilled, a free state word says the consumer released it.
// Each call costs what the consumer released since the last one.
func (r *Ring) releasedBelow() uint64 {
	n := uint64(r.l.buffers)
	refilled := r.seq // buffers before seq-N were refilled (seq-N too if seq is open)
	if r.open {
		refilled++
	}
	if refilled > n {
		r.released = max(r.released, refilled-n)
	}
	var now uint64
	for r.released < r.seq && loadU32(r.mem, r.l.desc(int(r.released%n))+dState) == stateFree {
		if now == 0 {
			now = Now()
		}
		r.timeRelease(int(r.released%n), now)
		r.released++
	}
	return r.released
}

// timeRelease records the release of the buffer last published from slot
// k, seen at now, unless it was recorded already.
func (r *Ring) timeRelease(k int, now uint64) {
	if !r.unreleased[k] {
		return
	}
	r.unreleased[k] = false
	r.publishToRelease.Observe(now - min(now, r.publishedNs[k]))
}

// writeSource fills entry j of the shared source table.
func (r *Ring) writeSource(j int, src Source, rxNs uint64) {
	e := r.mem[r.l.source(j):][:sourceSize]
	copy(e[sAddr:sAddr+16], src.Addr[:])
	le := binary.LittleEndian
	le.PutUint16(e[sSrcPort:], src.SrcPort)
	le.PutUint16(e[sDstPort:], src.DstPort)
	var flags uint32
	if !netip.AddrFrom16(src.Addr).Is4In6() {
		flags = 1
	}
	le.PutUint32(e[sFlags:], flags)
	le.PutUint64(e[sFirstNs:], rxNs)
}

// acquire opens buffer seq mod N if the consumer has released it.
func (r *Ring) acquire(rxNs uint64) bool {
	k := int(r.seq % uint64(r.l.buffers))
	if loadU32(r.mem, r.l.desc(k)+dState) != stateFree {
		return false
	}
	if r.unreleased[k] {
		r.releasedBelow() // times this buffer's release and any before it
	}
	r.open, r.off, r.records = true, 0, 0
	r.firstNs, r.lastNs = rxNs, rxNs
	switch w := r.l.windowNs; {
	case r.carry && rxNs < r.windowEnd:
		// the aligned window goes on
	case r.cfg.AlignWindows:
		r.windowStart = rxNs - rxNs%w
		r.windowEnd = r.windowStart + w
	default:
		r.windowStart, r.windowEnd = rxNs, rxNs+w
	}
	r.carry = false
	off := r.l.buffer(k)
	r.buf = r.mem[off : off+uint64(r.l.bufferSize)]
	return true
}

// publish hands the open buffer to the consumer: the descriptor is written
// whole, then its state is stored ready, then the published count; a
// sleeping consumer is woken.
func (r *Ring) publish(flags uint32) {
	k := int(r.seq % uint64(r.l.buffers))
	d := r.mem[r.l.desc(k):][:descSize]
	le := binary.LittleEndian
	le.PutUint32(d[dRecords:], uint32(r.records))
	le.PutUint64(d[dSeq:], r.seq)
	le.PutUint32(d[dBytes:], uint32(r.off))
	le.PutUint32(d[dFlags:], flags)
	le.PutUint64(d[dFirstNs:], r.firstNs)
	le.PutUint64(d[dLastNs:], r.lastNs)
	le.PutUint64(d[dWindowNs:], r.windowStart)
	now := Now()
	le.PutUint64(d[dPublishNs:], now)
	r.publishedNs[k], r.unreleased[k] = now, true
	r.wireToPublish.Observe(now - min(now, r.firstNs))
	storeU32(r.mem, r.l.desc(k)+dState, stateReady)
	r.seq++
	storeU64(r.mem, hPublished, r.seq)
	r.open, r.buf = false, nil
	r.st.published++
	// The state store above and this read-modify-write are the
	// producer's half of the tripwire: a consumer that armed before the
	// store is seen here; one that arms after it sees the buffer.
	if atomic.CompareAndSwapUint32(word32(r.mem, hConsArmed), 1, 0) {
		var one = [8]byte{1}
		_, _ = unix.Write(r.evfd, one[:])
	}
	r.sync()
}

// Tick publishes the open buffer if its window has closed by now
// (CLOCK_MONOTONIC ns, see Now). The engine calls it whenever it is not
// busy; Deadline says when it must.
func (r *Ring) Tick(now uint64) {
	if r.open && now >= r.windowEnd {
		r.publish(BufWindow)
		return
	}
	r.releasedBelow()
	r.sync()
}

// Writable reports whether Append is sure to find room now, whatever the
// datagram: the buffer after the open one (or the next, if none is open)
// has been released. It may say no while a small record would still fit.
// An engine that can hold datagrams back (and a test that must lose none)
// asks before appending.
func (r *Ring) Writable() bool {
	next := r.seq
	if r.open {
		next++
	}
	k := int(next % uint64(r.l.buffers))
	return loadU32(r.mem, r.l.desc(k)+dState) == stateFree
}

// Deadline is when the open buffer's window closes; ok is false when no
// buffer is open.
func (r *Ring) Deadline() (ns uint64, ok bool) { return r.windowEnd, r.open }

// Flush publishes the open buffer now, whatever its window.
func (r *Ring) Flush() {
	if r.open {
		r.publish(BufFlushed)
		return
	}
	r.sync()
}

func (r *Ring) sync() {
	if r.st == r.synced && r.syncedSrc == len(r.table.index) {
		return
	}
	r.synced, r.syncedSrc = r.st, len(r.table.index)
	r.shared.mu.Lock()
	r.shared.c = r.st
	r.shared.n = len(r.table.index)
	r.shared.mu.Unlock()
	storeU64(r.mem, hRecords, r.st.records)
	storeU64(r.mem, hDropped, r.st.noBuffer+r.st.tooBig+r.st.sourceFull)
}

// Stats returns the counters as of the last publish, Tick or Flush.
func (r *Ring) Stats() Stats {
	r.shared.mu.Lock()
	c, n := r.shared.c, r.shared.n
	r.shared.mu.Unlock()
	return Stats{
		Records: c.records, Bytes: c.bytes, Published: c.published,
		NoBuffer: c.noBuffer, TooBig: c.tooBig, SourceFull: c.sourceFull,
		SourceEvicted: c.sourceEvicted, Sources: n,
		Hugetlb: r.l.flags&FlagHugetlb != 0, Locked: r.l.flags&FlagLocked != 0,
		Attached:         r.srv.attached(),
		WireToPublish:    r.wireToPublish.Snapshot(),
		PublishToRelease: r.publishToRelease.Snapshot(),
	}
}

// Name is the name consumers open the ring by.
func (r *Ring) Name() string { return r.name }

// Size is the region's length in bytes.
func (r *Ring) Size() int { return len(r.mem) }

// Close flushes the open buffer, marks the ring closed for the consumer,
// stops accepting consumers and releases the producer's mapping (an
// attached consumer keeps its own until it closes). Call it from the
// goroutine that appends, after the last Append.
func (r *Ring) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	r.Flush()
	storeU32(r.mem, hProdState, sideClosed)
	var one = [8]byte{1}
	_, _ = unix.Write(r.evfd, one[:])
	err := r.srv.close()
	unix.Close(r.evfd)
	if cerr := r.reg.close(); err == nil {
		err = cerr
	}
	r.mem = nil
	return err
}
