// Package ingest is fabricbridge's UDP offload engine, NaNet's UDP offload
// in software. The XDP program (package ebpf) has already checked each
// trigger datagram, stripped its headers and written a
// classifier.IngestMeta in front of the payload, and redirected it to an
// AF_XDP socket dedicated to ingest (the program's IngestXSKMap). The
// engine reads those sockets — one loop per receive queue — takes source,
// ports, RX timestamp and buffer id from the metadata without parsing a
// header, and appends the payload to the persistent buffer ring
// (fabric/ingest) of that buffer id. One copy per datagram, from the UMEM
// frame into the ring, and no allocation.
//
// Several receive queues may feed one ring: each queue's loop appends its
// batch under the ring's lock, so the ring has one producer at a time and
// a queue's datagrams stay in order. A source's datagrams stay in order
// because its flow hashes to one queue (see "Several receive queues, one
// ring" in docs/ingest.md).
//
// Where XDP cannot attach, the bridge runs on AF_PACKET and classifies
// frames itself; an engine made by StartFed then takes its ingest
// datagrams through Feeders (see bridge.Bridge.StartOffload), stripped by
// classifier.Ingest into the same IngestMeta and payload, so that the
// rings, and their consumers, cannot tell the paths apart — except by
// latency: the packet socket hands frames over a block at a time (a 1 ms
// block timeout), and RX times are its CLOCK_REALTIME stamps moved onto
// CLOCK_MONOTONIC.
//
// Sockets come from bridge/xsk. On a queue that the bridge already serves,
// the kernel allows one UMEM: pass the bridge's (Config.Umem) and the
// engine's socket shares it and its fill ring.
package offload

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge/xsk"
	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// Config says where the engine receives. Zero fields take defaults.
type Config struct {
	// Program is the attached XDP classifier (the bridge's, or one the
	// caller loaded and attached); the engine's sockets go into its
	// IngestXSKMap.
	Program *fbebpf.Program
	// Ifindex is the interface, in the namespace of the thread calling
	// Start.
	Ifindex int
	// Queues are the receive queues to serve; default queue 0.
	Queues []int
	// Umem, if set, returns the UMEM another socket on the queue already
	// uses (the bridge's): the engine's socket then shares it and
	// its fill ring. If nil the engine makes its own UMEM per queue.
	Umem func(queue int) *xsk.Umem
	// FrameCount sizes the engine's own UMEMs (default 4096 frames of
	// 2048 bytes, all of them for receiving); Bind chooses their mode.
	FrameCount int
	Bind       xsk.BindMode
	// BusyPoll, if positive, turns on busy polling on the sockets.
	BusyPoll time.Duration
	// Spin is how long an idle loop polls before it sleeps in the kernel;
	// default 20 µs. While a ring has an open buffer the loop polls until
	// its window closes, so windows close on time.
	Spin time.Duration
	// Priority, if positive, runs each loop on a thread of its own at this
	// SCHED_FIFO real-time priority (1-99, needs CAP_SYS_NICE; see
	// fabric/ingest.LockRealtime): a loop woken by a frame, or due to
	// close a window, preempts ordinary threads at once instead of
	// waiting for its turn on a busy machine. Such a loop polls without
	// yielding (a yield on a locked thread costs two thread switches),
	// so while traffic keeps a window open it holds its CPU against
	// every ordinary thread (up to the kernel's real-time limit), and
	// the process needs a Go processor (GOMAXPROCS) per real-time
	// thread plus its other work's. Measured in docs/performance.md#the-latency-tail:
	// p99.9 cut from tens of ms to about 1 ms on a loaded 2-vCPU VM.
	Priority int

	// manual (tests): no loops run; tests call poll and tick themselves.
	manual bool
}

// Engine moves ingest frames from AF_XDP sockets into rings.
type Engine struct {
	cfg     Config
	queues  []*queue // replaced (never changed in place) under mu; see AddQueue
	rings   atomic.Pointer[map[uint32]*attached]
	mu      sync.Mutex // serialises Attach, Detach, NewFeeder, AddQueue, Close
	feeders []*Feeder  // fed engines only; under mu
	fed     bool
	kick    chan struct{} // fed: a feeder appended, a window may have opened
	done    chan struct{} // closed by Close
	wakefd  int
	stop    atomic.Bool
	wg      sync.WaitGroup
	closed  bool
}

// attached is a ring in the engine. Loops hold mu while they append to or
// tick the ring, so it has one producer at a time, and Detach can wait
// for the last one.
type attached struct {
	mu   sync.Mutex
	ring *ingest.Ring
	gone bool
}

// queue is one receive queue's socket and loop state.
type queue struct {
	e     *Engine
	id    int
	umem  *xsk.Umem
	own   bool // the engine made umem
	sock  *xsk.Socket
	fill  xsk.Refiller
	descs [xsk.MaxBatch]xsk.Desc
	addrs [xsk.MaxBatch]uint64
	pfd   [2]unix.PollFd
	c     counters
}

type counters struct {
	received, appended, dropped, noRing, malformed, refused atomic.Uint64
}

// Stats are the engine's counters summed over queues.
type Stats struct {
	Received  uint64 // frames read from the ingest sockets
	Appended  uint64 // payloads stored in a ring
	Dropped   uint64 // refused by their ring (no free buffer, too big, too many sources: see the ring's Stats)
	NoRing    uint64 // no ring attached for their buffer id
	Malformed uint64 // metadata missing, not ingest metadata, or inconsistent with the frame
	// Refused counts, on a fed engine, the frames its feeders' classifiers
	// judged malformed (classifier.VerdictMalformed: bad UDP length,
	// truncated, a fragment an ingest rule matched), which never reach a
	// ring. On the XDP path the program counts them
	// (ebpf.Counters.Verdicts[VerdictMalformed]) and the engine never sees
	// them.
	Refused uint64
	// KernelDrops and FillRingEmpty are the kernel's counters for the
	// engine's sockets: frames lost because the RX ring was full (the
	// engine fell behind), and times it found no frame to receive into.
	KernelDrops, FillRingEmpty uint64
	// Queues are the same counters per receive queue, in the order the
	// engine came to serve them: Config.Queues, then AddQueue's (their
	// Queues field is nil).
	Queues []QueueStats
}

// QueueStats are one receive queue's counters.
type QueueStats struct {
	Queue int
	Stats
}

// Start opens an ingest socket on every queue, registers it in the
// program's IngestXSKMap and starts one loop per queue. Call it on a thread
// in the interface's network namespace.
func Start(cfg Config) (*Engine, error) {
	if cfg.Priority < 0 || cfg.Priority > 99 {
		return nil, fmt.Errorf("ingest: real-time priority %d outside 1-99", cfg.Priority)
	}
	if cfg.Program == nil {
		return nil, errors.New("ingest: no XDP program")
	}
	if len(cfg.Queues) == 0 {
		cfg.Queues = []int{0}
	}
	if cfg.FrameCount == 0 {
		cfg.FrameCount = 4096
	}
	if cfg.Spin == 0 {
		cfg.Spin = 20 * time.Microsecond
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("ingest: eventfd: %w", err)
	}
	e := &Engine{cfg: cfg, wakefd: wakefd, done: make(chan struct{})}
	empty := map[uint32]*attached{}
	e.rings.Store(&empty)
	for _, id := range cfg.Queues {
		q, err := e.openQueue(id)
		if err != nil {
			e.closeQueues()
			unix.Close(wakefd)
			return nil, fmt.Errorf("ingest: queue %d: %w", id, err)
		}
		e.queues = append(e.queues, q)
	}
	xm := cfg.Program.IngestXSKMap()
	for _, q := range e.queues {
		if err := xm.Put(uint32(q.id), uint32(q.sock.FD())); err != nil {
			e.unregister()
			e.closeQueues()
			unix.Close(wakefd)
			return nil, fmt.Errorf("ingest: queue %d: IngestXSKMap: %w", q.id, err)
		}
	}
	if err := e.startLoops(e.queues); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

// startLoops starts a loop on each of qs and waits until every one runs as
// configured.
func (e *Engine) startLoops(qs []*queue) error {
	if e.cfg.manual {
		return nil
	}
	started := make(chan error, len(qs))
	for _, q := range qs {
		e.wg.Add(1)
		go q.loop(started)
	}
	var errs []error
	for range qs {
		if err := <-started; err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// AddQueue serves one more receive queue, as Start serves each of
// Config.Queues: a socket on it (sharing Config.Umem's UMEM if set), in the
// program's IngestXSKMap under the queue's index, which is where the
// program looks up a datagram's socket, and a loop. It is for a queue that
// came into use after Start (`ethtool -L`); a queue the engine serves
// already is left as it is, loop and counters. Call it on a thread in the
// interface's network namespace.
func (e *Engine) AddQueue(id int) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case e.closed:
		return errors.New("ingest: engine closed")
	case e.fed:
		return errors.New("ingest: a fed engine has no sockets: its feeders follow the bridge's queues")
	}
	for _, q := range e.queues {
		if q.id == id {
			return nil
		}
	}
	q, err := e.openQueue(id)
	if err != nil {
		return fmt.Errorf("ingest: queue %d: %w", id, err)
	}
	xm := e.cfg.Program.IngestXSKMap()
	if err := xm.Put(uint32(id), uint32(q.sock.FD())); err != nil {
		q.close()
		return fmt.Errorf("ingest: queue %d: IngestXSKMap: %w", id, err)
	}
	if err := e.startLoops([]*queue{q}); err != nil {
		_ = xm.Delete(uint32(id))
		q.close()
		return err
	}
	// Stats may range over the old slice, outside the lock.
	e.queues = append(slices.Clip(e.queues), q)
	return nil
}

func (e *Engine) openQueue(id int) (*queue, error) {
	q := &queue{e: e, id: id}
	if e.cfg.Umem != nil {
		if q.umem = e.cfg.Umem(id); q.umem == nil {
			return nil, errors.New("no UMEM for the queue")
		}
		// The fill ring is the bridge's: frames return to it after use.
		sock, err := q.umem.Open(xsk.SocketConfig{Ifindex: e.cfg.Ifindex, Queue: id, TxSize: -1, BusyPoll: e.cfg.BusyPoll})
		if err != nil {
			return nil, err
		}
		q.sock = sock
	} else {
		umem, err := xsk.NewUmem(xsk.UmemConfig{FrameCount: e.cfg.FrameCount})
		if err != nil {
			return nil, err
		}
		n := e.cfg.FrameCount
		sock, err := umem.Open(xsk.SocketConfig{
			Ifindex: e.cfg.Ifindex, Queue: id, Bind: e.cfg.Bind,
			// Room for twice the frames: see xsk.Refiller.
			RxSize: n, TxSize: -1, FillSize: 2 * n, CompletionSize: xsk.MaxBatch,
			BusyPoll: e.cfg.BusyPoll,
		})
		if err != nil {
			umem.Close()
			return nil, err
		}
		frames := make([]uint64, n)
		if umem.Alloc(frames) != n || sock.Fill.Fill(frames) != n {
			umem.Close()
			return nil, errors.New("the fill ring refused the initial frames")
		}
		q.umem, q.own, q.sock = umem, true, sock
	}
	q.fill = xsk.Refiller{Ring: q.sock.Fill, Pending: make([]uint64, 0, xsk.MaxBatch)}
	q.pfd = [2]unix.PollFd{{Fd: int32(q.sock.FD()), Events: unix.POLLIN}, {Fd: int32(e.wakefd), Events: unix.POLLIN}}
	return q, nil
}

// Attach makes the engine the producer of r for datagrams of ingest buffer
// id (the rule's Stream). From now on only the engine may touch r, until
// Detach returns.
func (e *Engine) Attach(id uint32, r *ingest.Ring) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return errors.New("ingest: engine closed")
	}
	old := *e.rings.Load()
	if _, ok := old[id]; ok {
		return fmt.Errorf("ingest: buffer id %d already has a ring", id)
	}
	next := make(map[uint32]*attached, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[id] = &attached{ring: r}
	e.rings.Store(&next)
	return nil
}

// Detach removes the ring of buffer id; when it returns no loop touches the
// ring any more, and the caller may flush and close it.
func (e *Engine) Detach(id uint32) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	old := *e.rings.Load()
	a, ok := old[id]
	if !ok {
		return fmt.Errorf("ingest: no ring for buffer id %d", id)
	}
	next := make(map[uint32]*attached, len(old))
	for k, v := range old {
		if k != id {
			next[k] = v
		}
	}
	e.rings.Store(&next)
	a.mu.Lock()
	a.gone = true
	a.mu.Unlock()
	return nil
}

// loop serves the queue until Close; it reports on started whether it
// runs as configured.
func (q *queue) loop(started chan<- error) {
	defer q.e.wg.Done()
	rt := q.e.cfg.Priority > 0
	if rt {
		unlock, err := ingest.LockRealtime(q.e.cfg.Priority)
		if err != nil {
			started <- fmt.Errorf("ingest: queue %d: %w", q.id, err)
			return
		}
		defer unlock()
	}
	started <- nil
	idleSince := time.Time{}
	for !q.e.stop.Load() {
		if q.poll() > 0 {
			idleSince = time.Time{}
			continue
		}
		// Idle. Windows must close on time: while any buffer is open, keep
		// polling; otherwise spin a little, then sleep. Polling yields the
		// processor at every turn, so a consumer goroutine sharing it (or
		// the application's other work) runs between polls instead of
		// waiting for the scheduler to preempt this loop; a real-time
		// loop has its thread to itself and does not yield.
		if !rt {
			runtime.Gosched()
		}
		if _, open := q.e.tick(); open {
			continue
		}
		if idleSince.IsZero() {
			idleSince = time.Now()
			continue
		}
		if time.Since(idleSince) < q.e.cfg.Spin {
			continue
		}
		q.sleep()
		idleSince = time.Time{}
	}
}

// poll moves one batch from the socket into rings and returns its size.
func (q *queue) poll() int {
	if len(q.fill.Pending) > 0 {
		q.fill.Refill(nil)
	}
	rx := q.sock.RX
	n := rx.Receive(q.descs[:])
	if n == 0 {
		if q.e.cfg.BusyPoll > 0 || q.sock.Fill.NeedWakeup() {
			q.sock.WakeRX()
		}
		return 0
	}
	var a appender
	a.begin(q.e)
	for i := range n {
		d := &q.descs[i]
		q.addrs[i] = d.Addr
		a.frame(q.umem.Meta(d.Addr, classifier.IngestMetaSize), q.umem.Bytes(d.Addr, int(d.Len)))
	}
	a.end()
	// Payloads are copied into the rings: the frames go back at once.
	q.fill.Refill(q.addrs[:n])
	if q.sock.Fill.NeedWakeup() {
		q.sock.WakeRX()
	}
	q.c.add(&a.c)
	return n
}

// appender moves one batch of ingest frames into rings. It keeps the ring
// of the last buffer id locked until the id changes or the batch ends, so a
// ring takes a queue's batch whole: one lock per batch, not per datagram,
// and several queues' loops never append to one ring at once.
type appender struct {
	rings map[uint32]*attached
	cur   *attached
	curID uint32
	c     batchCounts
}

type batchCounts struct{ received, appended, dropped, noRing, malformed, refused uint64 }

func (a *appender) begin(e *Engine) { a.rings = *e.rings.Load() }

// frame takes one frame as the XDP program leaves it: meta is the
// metadata area in front of it (nil if there is none), frame the stripped
// datagram.
func (a *appender) frame(meta, frame []byte) {
	a.c.received++
	if meta == nil || classifier.Verdict(meta[classifier.IngestMetaSize-2]) != classifier.VerdictIngest {
		a.c.malformed++
		return
	}
	m := classifier.UnmarshalIngestMeta(meta)
	a.add(&m, frame)
}

// add appends the payload m describes in frame to the ring of m.BufferID.
func (a *appender) add(m *classifier.IngestMeta, frame []byte) {
	end := int(m.PayloadOffset) + int(m.PayloadLen)
	if m.Verdict != classifier.VerdictIngest || end > len(frame) {
		a.c.malformed++
		return
	}
	if a.cur == nil || m.BufferID != a.curID {
		a.end()
		r := a.rings[m.BufferID]
		if r == nil {
			a.c.noRing++
			return
		}
		r.mu.Lock()
		if r.gone {
			r.mu.Unlock()
			a.c.noRing++
			return
		}
		a.cur, a.curID = r, m.BufferID
	}
	src := ingest.Source{Addr: m.Src, SrcPort: m.SrcPort, DstPort: m.DstPort}
	if a.cur.ring.Append(src, m.RxTimestampNs, frame[m.PayloadOffset:end]) {
		a.c.appended++
	} else {
		a.c.dropped++
	}
}

// end lets go of the ring the batch holds.
func (a *appender) end() {
	if a.cur != nil {
		a.cur.mu.Unlock()
		a.cur = nil
	}
}

func (c *counters) add(b *batchCounts) {
	c.received.Add(b.received)
	c.appended.Add(b.appended)
	if b.dropped != 0 {
		c.dropped.Add(b.dropped)
	}
	if b.noRing != 0 {
		c.noRing.Add(b.noRing)
	}
	if b.malformed != 0 {
		c.malformed.Add(b.malformed)
	}
	if b.refused != 0 {
		c.refused.Add(b.refused)
	}
	*b = batchCounts{}
}

// tick closes the windows that are due on every ring and reports whether
// a buffer is still open somewhere, and the earliest time one closes.
func (e *Engine) tick() (next uint64, open bool) {
	now := ingest.Now()
	for _, a := range *e.rings.Load() {
		a.mu.Lock()
		if !a.gone {
			a.ring.Tick(now)
			if d, o := a.ring.Deadline(); o && (!open || d < next) {
				next, open = d, true
			}
		}
		a.mu.Unlock()
	}
	return next, open
}

// sleep waits, with no buffer open, until a frame arrives or Close. The
// wake-up eventfd is written only by Close and never drained, so every
// loop sees it.
func (q *queue) sleep() {
	q.pfd[0].Revents, q.pfd[1].Revents = 0, 0
	_, _ = unix.Poll(q.pfd[:], 100)
}

// Stats sums the counters of every queue.
func (e *Engine) Stats() Stats {
	var s Stats
	e.mu.Lock()
	queues := e.queues
	e.mu.Unlock()
	for _, q := range queues {
		qs := QueueStats{Queue: q.id, Stats: q.c.stats()}
		if st, err := q.sock.Statistics(); err == nil {
			qs.KernelDrops = st.RxDropped + st.RxRingFull
			qs.FillRingEmpty = st.RxFillRingEmpty
		}
		s.add(&qs.Stats)
		s.Queues = append(s.Queues, qs)
	}
	e.mu.Lock()
	for _, f := range e.feeders {
		qs := QueueStats{Queue: f.queue, Stats: f.c.stats()}
		s.add(&qs.Stats)
		s.Queues = append(s.Queues, qs)
	}
	e.mu.Unlock()
	return s
}

func (c *counters) stats() Stats {
	return Stats{
		Received: c.received.Load(), Appended: c.appended.Load(), Dropped: c.dropped.Load(),
		NoRing: c.noRing.Load(), Malformed: c.malformed.Load(), Refused: c.refused.Load(),
	}
}

func (s *Stats) add(o *Stats) {
	s.Received += o.Received
	s.Appended += o.Appended
	s.Dropped += o.Dropped
	s.NoRing += o.NoRing
	s.Malformed += o.Malformed
	s.Refused += o.Refused
	s.KernelDrops += o.KernelDrops
	s.FillRingEmpty += o.FillRingEmpty
}

// Close stops the loops, removes the sockets from the IngestXSKMap and
// closes them (and the engine's own UMEMs). Attached rings stay open: they
// belong to the caller, who may close them once Close returns; from then
// on no loop and no feeder touches them.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	e.stop.Store(true)
	close(e.done)
	if e.wakefd >= 0 {
		var one = [8]byte{1}
		unix.Write(e.wakefd, one[:])
	}
	e.wg.Wait()
	// A feeder may still be in a batch: taking each ring's lock waits for
	// it, and gone keeps it and every later one out.
	for _, a := range *e.rings.Load() {
		a.mu.Lock()
		a.gone = true
		a.mu.Unlock()
	}
	e.unregister()
	err := e.closeQueues()
	if e.wakefd >= 0 {
		unix.Close(e.wakefd)
	}
	return err
}

func (e *Engine) unregister() {
	if e.fed {
		return
	}
	xm := e.cfg.Program.IngestXSKMap()
	for _, q := range e.queues {
		_ = xm.Delete(uint32(q.id))
	}
}

func (e *Engine) closeQueues() error {
	e.mu.Lock()
	qs := e.queues
	e.queues = nil
	e.mu.Unlock()
	var errs []error
	for _, q := range qs {
		errs = append(errs, q.close())
	}
	return errors.Join(errs...)
}

// close closes q's socket, and its UMEM if the engine made it.
func (q *queue) close() error {
	if q.own {
		return q.umem.Close()
	}
	return q.sock.Close()
}
