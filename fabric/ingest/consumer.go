package ingest

import (
	"encoding/binary"
	"fmt"
	"net"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ConsumerOptions tune a consumer. Zero fields take defaults.
type ConsumerOptions struct {
	// Spin is how long Next polls for the next buffer before it arms the
	// tripwire and sleeps; default 50 µs. Negative: never sleep, poll
	// until the timeout (what a GPU kernel does; costs a core).
	Spin time.Duration
	// Budget is the latency budget: a buffer whose first record waited
	// longer than this from RX to the consumer's wake-up is a violation.
	// Default 1 ms, NA62's L0 budget.
	Budget time.Duration
	// NoYield: the goroutine calling Next has a thread of its own
	// (LockRealtime), so polling does not yield the processor. On a
	// locked thread a yield hands the Go processor to another thread and
	// back: two thread switches per poll.
	NoYield bool
}

// DefaultSpin is the consumer's default polling period before sleeping:
// a little longer than a kernel wake-up costs.
const DefaultSpin = 50 * time.Microsecond

// Consumer is the reading end of a ring. It validates everything it reads
// from the region — descriptor fields, record sizes, source indices — and
// on any inconsistency stops for good with ErrCorruption: a broken
// producer cannot make it read outside a buffer. Not safe for concurrent
// use, except Stats.
type Consumer struct {
	reg     *region
	mem     []byte
	l       layout
	conn    *net.UnixConn
	connFd  int
	evfd    int
	spin    time.Duration
	noYield bool
	budget  uint64

	next   uint64   // sequence number of the next buffer
	held   []uint64 // per buffer index: seq+1 while the caller holds it
	err    error
	gone   bool // the producer closed its end
	pfd    [2]unix.PollFd
	evbuf  [8]byte
	closed bool

	latency, handoff                      Histogram
	buffers, stale, violations, sleeps    atomic.Uint64
	recordsSeen, releasedBuffers, maxHeld atomic.Uint64
}

// Open attaches to the ring served under name (see Config.Name).
func Open(name string, opts ConsumerOptions) (*Consumer, error) {
	path, err := socketPath(name)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	if opts.Spin == 0 {
		opts.Spin = DefaultSpin
	}
	if opts.Budget <= 0 {
		opts.Budget = time.Millisecond
	}
	conn, memfd, evfd, size, err := dial(path)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Consumer, error) {
		conn.Close()
		unix.Close(memfd)
		unix.Close(evfd)
		return nil, err
	}
	reg, err := attachRegion(memfd, size)
	if err != nil {
		return fail(err)
	}
	l, err := readHeader(reg.mem)
	if err != nil {
		unix.Munmap(reg.mem)
		return fail(err)
	}
	c := &Consumer{
		reg: reg, mem: reg.mem, l: l, conn: conn, evfd: evfd,
		spin: opts.Spin, noYield: opts.NoYield, budget: uint64(opts.Budget.Nanoseconds()),
		held: make([]uint64, l.buffers),
	}
	rc, err := conn.SyscallConn()
	if err == nil {
		err = rc.Control(func(fd uintptr) { c.connFd = int(fd) })
	}
	if err != nil {
		reg.close()
		conn.Close()
		unix.Close(evfd)
		return nil, fmt.Errorf("ingest: %w", err)
	}
	c.start()
	if err := ack(conn); err != nil {
		c.Close()
		return nil, fmt.Errorf("ingest: handshake: %w", err)
	}
	conn.SetDeadline(time.Time{})
	return c, nil
}

// start takes over from any consumer before: it begins at the producer's
// next buffer and releases every buffer published before it attached
// (held by a consumer that died, or filled while nobody read), counting
// them as stale. A buffer published concurrently has a sequence number at
// least the one read here and is left alone.
func (c *Consumer) start() {
	storeU32(c.mem, hConsState, sideOpen)
	c.next = loadU64(c.mem, hPublished)
	for k := range c.l.buffers {
		d := c.l.desc(k)
		if loadU32(c.mem, d+dState) == stateReady && binary.LittleEndian.Uint64(c.mem[d+dSeq:]) < c.next {
			storeU32(c.mem, d+dState, stateFree)
			c.stale.Add(1)
		}
	}
	storeU64(c.mem, hConsNextSeq, c.next)
}

// Buffer is one published buffer, held by the consumer until Release. Its
// data lies in the shared region: do not keep it, or any Record's payload,
// after releasing it.
type Buffer struct {
	Index     int    // buffer index k, 0..N-1
	Seq       uint64 // publication number; Index = Seq mod N
	Records   int    // records in the buffer
	Bytes     int    // bytes of records
	Flags     uint32 // BufWindow, BufFull, BufFlushed, BufContinued
	FirstNs   uint64 // earliest RX time of its records (CLOCK_MONOTONIC)
	LastNs    uint64 // latest RX time of its records
	WindowNs  uint64 // start of its window
	PublishNs uint64 // when the producer published it
	WakeNs    uint64 // when Next returned it
	data      []byte
	sources   uint32
}

// Latency is the buffer's wire-to-consumer latency: from its earliest
// record's RX timestamp to the consumer's wake-up.
func (b *Buffer) Latency() time.Duration {
	if b.WakeNs < b.FirstNs {
		return 0
	}
	return time.Duration(b.WakeNs - b.FirstNs)
}

// Data is the buffer's records as they lie in memory (the record layout is
// beside the record header offsets in layout.go), for consumers that parse
// them themselves.
func (b *Buffer) Data() []byte { return b.data }

// Iter iterates over the buffer's records.
func (b *Buffer) Iter() RecordIter {
	return RecordIter{data: b.data, left: b.Records, sources: b.sources}
}

// Record is one datagram in a buffer.
type Record struct {
	Source uint16 // index into the source table (Consumer.Source)
	// SourceGen is the source entry's generation: it changes when the
	// entry goes to another source (Config.SourceIdle), and Seq starts
	// again at 0 with it.
	SourceGen uint32
	Seq       uint32 // per-source sequence: a gap is datagrams dropped at this box
	RxNs      uint64 // RX timestamp (CLOCK_MONOTONIC)
	Payload   []byte // the UDP payload, in the shared buffer
}

// RecordIter walks a buffer's records, checking each: a record that would
// reach outside the buffer, a source index outside the table or a count
// that disagrees with the descriptor ends the walk with ErrCorruption.
type RecordIter struct {
	data    []byte
	off     int
	left    int
	sources uint32
	rec     Record
	err     error
}

// Next advances to the next record; false at the end or on an error.
func (it *RecordIter) Next() bool {
	if it.err != nil {
		return false
	}
	if it.left == 0 {
		if it.off != len(it.data) {
			it.err = fmt.Errorf("%w: %d bytes after the last record", ErrCorruption, len(it.data)-it.off)
		}
		return false
	}
	rest := it.data[it.off:]
	if len(rest) < RecordHeader {
		it.err = fmt.Errorf("%w: %d records missing at offset %d", ErrCorruption, it.left, it.off)
		return false
	}
	le := binary.LittleEndian
	size := int(le.Uint32(rest[rSize:]))
	plen := int(le.Uint16(rest[rPayloadLen:]))
	src := le.Uint16(rest[rSource:])
	switch {
	case size < RecordHeader || size%RecordAlign != 0 || size > len(rest):
		it.err = fmt.Errorf("%w: record size %d at offset %d of %d", ErrCorruption, size, it.off, len(it.data))
	case plen > size-RecordHeader:
		it.err = fmt.Errorf("%w: payload %d in a %d-byte record", ErrCorruption, plen, size)
	case uint32(src) >= it.sources:
		it.err = fmt.Errorf("%w: source %d of %d", ErrCorruption, src, it.sources)
	}
	if it.err != nil {
		return false
	}
	it.rec = Record{Source: src, SourceGen: le.Uint32(rest[rSourceGen:]), Seq: le.Uint32(rest[rSeq:]), RxNs: le.Uint64(rest[rRxNs:]),
		Payload: rest[RecordHeader : RecordHeader+plen : RecordHeader+plen]}
	it.off += size
	it.left--
	return true
}

// Record is the current record.
func (it *RecordIter) Record() *Record { return &it.rec }

// Err is why the walk stopped early, or nil.
func (it *RecordIter) Err() error { return it.err }

// Poll returns the next buffer if one is ready; ok is false if not.
func (c *Consumer) Poll() (b Buffer, ok bool, err error) {
	if c.closed {
		return b, false, ErrClosed
	}
	if c.err != nil {
		return b, false, c.err
	}
	// Closed is read first: the producer publishes its last buffer
	// before it marks itself closed, so nothing is missed.
	closed := c.producerClosed()
	if c.ready() {
		b, err = c.take()
		return b, err == nil, err
	}
	if closed {
		return b, false, ErrClosed
	}
	return b, false, nil
}

func (c *Consumer) producerClosed() bool {
	return c.gone || loadU32(c.mem, hProdState) == sideClosed
}

func (c *Consumer) ready() bool {
	k := c.next % uint64(c.l.buffers)
	return loadU32(c.mem, c.l.desc(int(k))+dState) == stateReady && c.held[k] == 0
}

// Next waits up to timeout (negative: for ever) for the next buffer: it
// polls for the spin period, then arms the tripwire (a flag the producer
// checks after publishing) and sleeps on the wake-up eventfd. When the
// producer has closed and every published buffer is taken it returns
// ErrClosed; ErrTimeout when the time is up.
func (c *Consumer) Next(timeout time.Duration) (Buffer, error) {
	if c.closed {
		return Buffer{}, ErrClosed
	}
	if c.err != nil {
		return Buffer{}, c.err
	}
	if !c.ready() {
		if err := c.wait(timeout); err != nil {
			return Buffer{}, err
		}
	}
	return c.take()
}

func (c *Consumer) wait(timeout time.Duration) error {
	start := time.Now()
	expired := func() bool { return timeout >= 0 && time.Since(start) >= timeout }
	spin := c.spin
	if spin < 0 {
		spin = timeout
	}
	if spin != 0 {
		for i := 1; ; i++ {
			if c.ready() {
				return nil
			}
			// Yield while polling: the producer may be a goroutine of
			// this process waiting for the processor.
			if !c.noYield {
				runtime.Gosched()
			}
			if i&15 == 0 {
				if el := time.Since(start); (spin >= 0 && el >= spin) || expired() {
					break
				}
			}
		}
	}
	armed := word32(c.mem, hConsArmed)
	for {
		atomic.SwapUint32(armed, 1) // a full barrier before the re-check
		closed := c.producerClosed()
		if c.ready() {
			atomic.StoreUint32(armed, 0)
			return nil
		}
		if closed {
			atomic.StoreUint32(armed, 0)
			return ErrClosed
		}
		ms := -1
		if timeout >= 0 {
			left := timeout - time.Since(start)
			if left <= 0 {
				atomic.StoreUint32(armed, 0)
				return ErrTimeout
			}
			ms = int((left + time.Millisecond - 1) / time.Millisecond)
		}
		c.sleeps.Add(1)
		c.pfd[0] = unix.PollFd{Fd: int32(c.evfd), Events: unix.POLLIN}
		c.pfd[1] = unix.PollFd{Fd: int32(c.connFd), Events: unix.POLLIN | unix.POLLRDHUP}
		if _, err := unix.Poll(c.pfd[:], ms); err != nil && err != unix.EINTR {
			atomic.StoreUint32(armed, 0)
			return fmt.Errorf("ingest: poll: %w", err)
		}
		if c.pfd[0].Revents&unix.POLLIN != 0 {
			_, _ = unix.Read(c.evfd, c.evbuf[:])
		}
		if c.pfd[1].Revents != 0 {
			// The producer never writes after the handshake: readable
			// means its end closed.
			c.gone = true
		}
	}
}

// take validates and returns the ready buffer at c.next.
func (c *Consumer) take() (Buffer, error) {
	wake := Now()
	k := int(c.next % uint64(c.l.buffers))
	d := c.mem[c.l.desc(k):][:descSize]
	le := binary.LittleEndian
	b := Buffer{
		Index: k, Seq: le.Uint64(d[dSeq:]),
		Records: int(le.Uint32(d[dRecords:])), Bytes: int(le.Uint32(d[dBytes:])),
		Flags:   le.Uint32(d[dFlags:]),
		FirstNs: le.Uint64(d[dFirstNs:]), LastNs: le.Uint64(d[dLastNs:]),
		WindowNs: le.Uint64(d[dWindowNs:]), PublishNs: le.Uint64(d[dPublishNs:]),
		WakeNs: wake,
	}
	switch {
	case b.Seq != c.next:
		c.err = fmt.Errorf("%w: buffer %d carries sequence %d, want %d", ErrCorruption, k, b.Seq, c.next)
	case b.Bytes > c.l.bufferSize || b.Records < 1 || b.Records > b.Bytes/RecordHeader:
		c.err = fmt.Errorf("%w: buffer %d holds %d records in %d bytes (of %d)", ErrCorruption, k, b.Records, b.Bytes, c.l.bufferSize)
	case b.LastNs < b.FirstNs:
		c.err = fmt.Errorf("%w: buffer %d ends at %d before it starts at %d", ErrCorruption, k, b.LastNs, b.FirstNs)
	}
	if c.err != nil {
		return Buffer{}, c.err
	}
	b.sources = min(loadU32(c.mem, hSourceCount), uint32(c.l.maxSources))
	off := c.l.buffer(k)
	b.data = c.mem[off : off+uint64(b.Bytes) : off+uint64(b.Bytes)]
	c.held[k] = b.Seq + 1
	c.next++
	storeU64(c.mem, hConsNextSeq, c.next)

	c.buffers.Add(1)
	lat := b.Latency()
	c.latency.Observe(uint64(lat))
	if b.WakeNs > b.PublishNs {
		c.handoff.Observe(b.WakeNs - b.PublishNs)
	} else {
		c.handoff.Observe(0)
	}
	if uint64(lat) > c.budget {
		c.violations.Add(1)
	}
	return b, nil
}

// Release gives a buffer back to the producer. Buffers may be released in
// any order, but the producer fills them in ring order, so one held buffer
// stalls it when it comes round again.
func (c *Consumer) Release(b *Buffer) error {
	if c.closed {
		return ErrClosed
	}
	if b.Index < 0 || b.Index >= len(c.held) || c.held[b.Index] != b.Seq+1 {
		return fmt.Errorf("%w: buffer %d (sequence %d)", ErrReleased, b.Index, b.Seq)
	}
	c.held[b.Index] = 0
	storeU32(c.mem, c.l.desc(b.Index)+dState, stateFree)
	c.releasedBuffers.Add(1)
	storeU64(c.mem, hConsReleased, c.releasedBuffers.Load())
	b.data = nil
	return nil
}

// Source returns entry i of the source table. An entry names the source
// of the records that refer to it while the buffers holding them are not
// released; a full table may give it to another source afterwards
// (Config.SourceIdle, Record.SourceGen).
func (c *Consumer) Source(i uint16) (Source, bool) {
	if c.closed {
		return Source{}, false
	}
	n := min(loadU32(c.mem, hSourceCount), uint32(c.l.maxSources))
	if uint32(i) >= n {
		return Source{}, false
	}
	e := c.mem[c.l.source(int(i)):][:sourceSize]
	var s Source
	copy(s.Addr[:], e[sAddr:sAddr+16])
	s.SrcPort = binary.LittleEndian.Uint16(e[sSrcPort:])
	s.DstPort = binary.LittleEndian.Uint16(e[sDstPort:])
	return s, true
}

// Sources is the number of entries in the source table.
func (c *Consumer) Sources() int {
	if c.closed {
		return 0
	}
	return int(min(loadU32(c.mem, hSourceCount), uint32(c.l.maxSources)))
}

// Info describes the ring as its header does.
type Info struct {
	Buffers, BufferSize, MaxSources int
	Window                          time.Duration
	AlignedWindows, Hugetlb, Locked bool
	BufferID                        uint32
	RegionBytes                     int
}

// Info reads the ring's configuration (as mapped at Open).
func (c *Consumer) Info() Info {
	return Info{
		Buffers: c.l.buffers, BufferSize: c.l.bufferSize, MaxSources: c.l.maxSources,
		Window:         time.Duration(c.l.windowNs),
		AlignedWindows: c.l.flags&FlagAlignedWindows != 0,
		Hugetlb:        c.l.flags&FlagHugetlb != 0, Locked: c.l.flags&FlagLocked != 0,
		BufferID: c.l.bufferID, RegionBytes: int(c.l.size),
	}
}

// ConsumerStats are a consumer's counters and latency histograms.
type ConsumerStats struct {
	Buffers    uint64 // buffers taken
	Released   uint64 // buffers released
	Stale      uint64 // buffers published before this consumer attached, released unread
	Violations uint64 // buffers over the latency budget
	Sleeps     uint64 // times Next slept in the kernel
	// Latency is from each buffer's first RX timestamp to the consumer's
	// wake-up; Handoff from its publication to the wake-up (the part the
	// window does not explain).
	Latency, Handoff HistogramSnapshot
}

// Stats returns a snapshot; safe to call from any goroutine while the
// consumer is open.
func (c *Consumer) Stats() ConsumerStats {
	return ConsumerStats{
		Buffers: c.buffers.Load(), Released: c.releasedBuffers.Load(), Stale: c.stale.Load(),
		Violations: c.violations.Load(), Sleeps: c.sleeps.Load(),
		Latency: c.latency.Snapshot(), Handoff: c.handoff.Snapshot(),
	}
}

// ProducerCounters are the records written and dropped as the producer
// last published them in the header (informational: the producer's Stats
// are authoritative).
func (c *Consumer) ProducerCounters() (records, dropped uint64) {
	if c.closed {
		return 0, 0
	}
	return loadU64(c.mem, hRecords), loadU64(c.mem, hDropped)
}

// Close detaches: the producer learns it from the connection and a new
// consumer may attach (and will release whatever this one still held).
func (c *Consumer) Close() error {
	if c.closed {
		return nil
	}
	c.closed = true
	storeU32(c.mem, hConsState, sideClosed)
	err := c.conn.Close()
	if rerr := c.reg.close(); err == nil {
		err = rerr
	}
	unix.Close(c.evfd)
	c.mem = nil
	return err
}
