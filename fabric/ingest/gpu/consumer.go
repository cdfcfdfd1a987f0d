package gpu

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// Mode is how buffers reach the GPU.
type Mode int

const (
	// Persistent runs one kernel for the consumer's life: its blocks poll
	// the descriptors in the registered ring, process buffers where they
	// lie (staged in shared memory) and release them; no host thread is
	// on a buffer's path.
	Persistent Mode = iota
	// HostDriven is the baseline: the CPU consumer wakes up on a buffer,
	// copies it (and any others ready) to device memory and launches a
	// kernel over them, waits, and releases them.
	HostDriven
)

func (m Mode) String() string {
	if m == HostDriven {
		return "host-driven"
	}
	return "persistent"
}

// Options tune a GPU consumer. Zero fields take defaults.
type Options struct {
	Mode Mode
	// Threshold is the summed window energy that triggers (as
	// ingest.Reference.Threshold).
	Threshold uint64
	// Blocks: in persistent mode, the blocks that hold buffers at once
	// (default 16, at most the ring's buffers and the GPU's
	// multiprocessors: every block must be resident); host-driven, the
	// most buffers one launch takes (default 32).
	Blocks int
	// Device is the CUDA device ordinal.
	Device int
	// KeepEnergies keeps every closed window's sum in Results.Energies.
	KeepEnergies bool
	// OnResult, if set, sees every buffer's result in publication order,
	// on Run's goroutine.
	OnResult func(Result)
}

// Result is what the kernel published for one buffer.
type Result struct {
	Seq          uint64
	Records      int
	BufferEnergy uint64 // hit energies in this buffer
	Closed       bool   // the buffer closed its window
	WindowEnergy uint64 // the closed window's sum
	Triggered    bool   // the window's sum reached the threshold
	PublishNs    uint64 // when the producer published the buffer
	SeenNs       uint64 // when the host saw the result (CLOCK_MONOTONIC)
}

// Results are the trigger's totals, ingest.Reference's fields: equal to
// the reference's on the same buffers (TestGPUMatchesReference).
type Results struct {
	Buffers, Records  uint64
	Windows, Triggers uint64
	Energies          []uint64
	Sources           []ingest.SourceCounts
	Gaps              []ingest.Gap
}

// Stats are a GPU consumer's counters.
type Stats struct {
	Buffers, Records uint64
	Launches         uint64  // host-driven kernel launches
	KernelSeconds    float64 // host-driven: device time of the launches
	// Latency is from each buffer's publication to the host seeing its
	// result.
	Latency ingest.HistogramSnapshot
}

// ErrKernel is a kernel that stopped on bad data in the ring; the error
// wrapping it says which buffer and record.
var ErrKernel = errors.New("gpu: the kernel found the ring corrupt")

// The kernel lists a gap unless it cannot be among the first maxGaps: per
// source, at most 64-k in a buffer that k gaps precede, and 2 more at the
// buffer's start, while fewer than 64 were seen: 64·65/2 + 2·64 < 2300.
// A list this long for every source is enough; a longer one is a waste of
// device memory for sources that do not all misbehave at once.
const (
	gapsPerSource = 2300
	maxGapList    = 1 << 22
)

const (
	resultSlots  = 1024
	hostParams   = 64   // in the host block: the kernel's argument and the pointer to it
	hostJobs     = 4096 // the job table
	defaultBatch = 32
	defaultPers  = 16
)

// Consumer runs the trigger on a GPU over an attached ingest consumer's
// ring. Not safe for concurrent use, except Stats.
type Consumer struct {
	dev  device
	cons *ingest.Consumer
	opts Options

	region    []byte
	regionDev uint64
	first     uint64
	buffers   int
	bufSize   int
	descOff   uint64
	bufOff    uint64
	maxSrc    int
	stage     int
	blocks    int

	host                                               []byte // ctrl | params | jobs | results, registered
	hostDev                                            uint64
	dmem                                               []uint64 // device allocations, freed at Close
	argsDev, stateDev, sourcesDev, gapsDev, stagingDev uint64
	gapCap                                             int

	ran      bool
	energies []uint64
	latency  ingest.Histogram
	nbuf     atomic.Uint64
	nrec     atomic.Uint64
	launches atomic.Uint64
	kernelNs atomic.Uint64
}

// Open loads the CUDA driver (ErrNoDriver if there is none) and prepares
// the trigger over c's ring: registers the ring for device access, loads
// the kernel and allocates its state. c belongs to the GPU consumer
// (which reads through it in host-driven mode, around it in persistent
// mode) until that is closed; close c after it.
func Open(c *ingest.Consumer, opts Options) (*Consumer, error) {
	dev, err := openCUDA(opts.Device, ptx)
	if err != nil {
		return nil, err
	}
	if c == nil {
		dev.close()
		return nil, errors.New("gpu: Open needs an attached ingest consumer")
	}
	g, err := open(dev, c, opts)
	if err != nil {
		dev.close()
		return nil, err
	}
	return g, nil
}

// Device names the GPU.
func (g *Consumer) Device() string { return g.dev.info().Name }

func open(dev device, c *ingest.Consumer, opts Options) (g *Consumer, err error) {
	region, next := c.InPlace()
	le := binary.LittleEndian
	g = &Consumer{dev: dev, cons: c, opts: opts, region: region, first: next,
		buffers: int(le.Uint32(region[ingBufferCount:])), bufSize: int(le.Uint32(region[ingBufferSize:])),
		descOff: le.Uint64(region[ingDescOff:]), bufOff: le.Uint64(region[ingBuffersOff:]),
		maxSrc: int(le.Uint32(region[ingMaxSources:])),
	}
	// The error returns leave g nil: release what this one holds.
	opened := g
	defer func() {
		if err != nil {
			opened.release()
		}
	}()
	info := dev.info()
	g.stage = min(g.bufSize, info.StageMax)
	switch {
	case opts.Mode == Persistent:
		g.blocks = opts.Blocks
		if g.blocks <= 0 {
			g.blocks = defaultPers
		}
		g.blocks = min(g.blocks, g.buffers)
		if info.Multiprocessors > 0 {
			g.blocks = min(g.blocks, info.Multiprocessors)
		}
	default:
		g.blocks = opts.Blocks
		if g.blocks <= 0 {
			g.blocks = defaultBatch
		}
		g.blocks = min(g.blocks, (hostJobs-0)/jobSize, resultSlots)
	}
	if g.regionDev, err = dev.register(region); err != nil {
		return nil, err
	}
	size := hostJobs + resultSlots*resultSize
	size = (size + 4095) &^ 4095
	if g.host, err = unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS|unix.MAP_POPULATE); err != nil {
		return nil, fmt.Errorf("gpu: mmap: %w", err)
	}
	if g.hostDev, err = dev.register(g.host); err != nil {
		return nil, err
	}
	g.gapCap = min(gapsPerSource*g.maxSrc, maxGapList)
	for _, a := range []struct {
		p    *uint64
		n    int
		zero bool
	}{
		{&g.argsDev, argsSize, false}, {&g.stateDev, stateSize, true}, {&g.sourcesDev, sourceSize * g.maxSrc, true},
		{&g.gapsDev, gapSize * g.gapCap, false}, // read up to the state's count only
	} {
		if *a.p, err = dev.alloc(a.n); err != nil {
			return nil, err
		}
		g.dmem = append(g.dmem, *a.p)
		if a.zero {
			if err = dev.copyIn(*a.p, make([]byte, a.n)); err != nil {
				return nil, err
			}
		}
	}
	if opts.Mode == HostDriven {
		if g.stagingDev, err = dev.alloc(g.blocks * g.bufSize); err != nil {
			return nil, err
		}
		g.dmem = append(g.dmem, g.stagingDev)
	}
	var args [argsSize]byte
	le.PutUint64(args[aRegion:], g.regionDev)
	le.PutUint64(args[aCtrl:], g.hostDev)
	le.PutUint64(args[aResults:], g.hostDev+hostJobs)
	le.PutUint64(args[aJobs:], g.hostDev+hostJobs-uint64(g.blocks*jobSize))
	le.PutUint64(args[aState:], g.stateDev)
	le.PutUint64(args[aSources:], g.sourcesDev)
	le.PutUint64(args[aGaps:], g.gapsDev)
	le.PutUint64(args[aFirstSeq:], g.first)
	le.PutUint64(args[aThreshold:], opts.Threshold)
	le.PutUint64(args[aDescOff:], g.descOff)
	le.PutUint64(args[aBuffersOff:], g.bufOff)
	le.PutUint32(args[aBufferCount:], uint32(g.buffers))
	le.PutUint32(args[aBufferSize:], uint32(g.bufSize))
	le.PutUint32(args[aMaxSources:], uint32(g.maxSrc))
	le.PutUint32(args[aResultSlots:], resultSlots)
	le.PutUint32(args[aGapCapacity:], uint32(g.gapCap))
	le.PutUint32(args[aStageBytes:], uint32(g.stage))
	if err = dev.copyIn(g.argsDev, args[:]); err != nil {
		return nil, err
	}
	var st [stateSize]byte
	le.PutUint64(st[stTurn:], g.first)
	if err = dev.copyIn(g.stateDev, st[:]); err != nil {
		return nil, err
	}
	le.PutUint64(g.host[hostParams-16:], g.argsDev)
	g.store64(cStopSeq, ^uint64(0))
	g.store64(cResultsRead, g.first)
	return g, nil
}

// The host block: the control block at 0, the kernel's parameter block at
// hostParams-16, the job table just below hostJobs, results from hostJobs.
func (g *Consumer) word64(off int) *uint64    { return (*uint64)(unsafe.Pointer(&g.host[off])) }
func (g *Consumer) word32(off int) *uint32    { return (*uint32)(unsafe.Pointer(&g.host[off])) }
func (g *Consumer) store64(off int, v uint64) { atomic.StoreUint64(g.word64(off), v) }
func (g *Consumer) load64(off int) uint64     { return atomic.LoadUint64(g.word64(off)) }
func (g *Consumer) params() []byte            { return g.host[hostParams-16 : hostParams] }
func (g *Consumer) job(i int) []byte {
	off := hostJobs - g.blocks*jobSize + i*jobSize
	return g.host[off : off+jobSize]
}
func (g *Consumer) result(seq uint64) int { return hostJobs + int(seq%resultSlots)*resultSize }

func regionLoad32(mem []byte, off uint64) uint32 {
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(&mem[off])))
}

func regionLoad64(mem []byte, off uint64) uint64 {
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&mem[off])))
}

// kernelError turns the control block's error into a Go error, or nil.
func (g *Consumer) kernelError() error {
	code := atomic.LoadUint32(g.word32(cError))
	if code == 0 {
		return nil
	}
	what := map[uint32]string{errSeq: "descriptor with the wrong sequence number", errDesc: "impossible descriptor",
		errRecord: "record outside its buffer or with no source", errTrailer: "bytes after the last record",
		errGaps: "gap list overflow"}[code]
	return fmt.Errorf("%w: %s in buffer %d, record %d", ErrKernel, what, g.load64(cErrorSeq), atomic.LoadUint32(g.word32(cErrorRecord)))
}

// take reads the result of seq if the kernel has published it.
func (g *Consumer) take(seq uint64) (Result, bool) {
	off := g.result(seq)
	if g.load64(off+rSeq1) != seq+1 {
		return Result{}, false
	}
	now := ingest.Now()
	le := binary.LittleEndian
	r := g.host[off : off+resultSize]
	flags := le.Uint32(r[rFlags:])
	res := Result{Seq: seq, Records: int(le.Uint32(r[rRecords:])), BufferEnergy: le.Uint64(r[rBufferEnergy:]),
		Closed: flags&resultClosed != 0, Triggered: flags&resultTriggered != 0, WindowEnergy: le.Uint64(r[rWindowEnergy:]),
		PublishNs: le.Uint64(r[rPublishNs:]), SeenNs: now}
	if now > res.PublishNs {
		g.latency.Observe(now - res.PublishNs)
	} else {
		g.latency.Observe(0)
	}
	g.nbuf.Add(1)
	g.nrec.Add(uint64(res.Records))
	if res.Closed && g.opts.KeepEnergies {
		g.energies = append(g.energies, res.WindowEnergy)
	}
	if g.opts.OnResult != nil {
		g.opts.OnResult(res)
	}
	return res, true
}

// Run consumes buffers until the producer closes and every buffer it
// published is processed, or ctx ends, or the kernel finds the ring
// corrupt (ErrKernel). Run once per Consumer.
func (g *Consumer) Run(ctx context.Context) error {
	if g.ran {
		return errors.New("gpu: Run called twice")
	}
	g.ran = true
	if g.opts.Mode == HostDriven {
		return g.runHostDriven(ctx)
	}
	return g.runPersistent(ctx)
}

func (g *Consumer) runPersistent(ctx context.Context) error {
	if err := g.dev.launch(kernelPersistent, g.blocks, g.stage, g.params()); err != nil {
		return err
	}
	next, stopAt := g.first, ^uint64(0)
	var runErr error
	for i := 0; next < stopAt; i++ {
		if _, ok := g.take(next); ok {
			next++
			g.store64(cResultsRead, next)
			continue
		}
		if err := g.kernelError(); err != nil {
			runErr = err
			break
		}
		if stopAt == ^uint64(0) && regionLoad32(g.region, ingProducerState) == ingProducerClose {
			// The producer publishes its last buffer before it marks
			// itself closed: published is final.
			stopAt = regionLoad64(g.region, ingPublished)
			g.store64(cStopSeq, stopAt)
			continue
		}
		if ctx.Err() != nil {
			runErr = ctx.Err()
			break
		}
		if i%1024 == 1023 {
			if alive, err := g.dev.running(); err != nil || !alive {
				runErr = errors.Join(err, g.kernelError())
				if runErr == nil {
					runErr = errors.New("gpu: the persistent kernel ended early")
				}
				break
			}
		}
		runtime.Gosched()
	}
	if runErr != nil {
		g.store64(cStopSeq, 0) // abort: every block leaves at its next poll
	}
	_, err := g.dev.wait(kernelPersistent)
	// A block may have published while the host was leaving.
	for ; ; next++ {
		if _, ok := g.take(next); !ok {
			break
		}
	}
	return errors.Join(runErr, err, g.kernelError())
}

func (g *Consumer) runHostDriven(ctx context.Context) error {
	batch := make([]ingest.Buffer, 0, g.blocks)
	le := binary.LittleEndian
	for {
		b, err := g.cons.Next(100 * time.Millisecond)
		switch {
		case errors.Is(err, ingest.ErrTimeout):
			if ctx.Err() != nil {
				return ctx.Err()
			}
			continue
		case errors.Is(err, ingest.ErrClosed):
			return nil
		case err != nil:
			return err
		}
		batch = append(batch[:0], b)
		for len(batch) < g.blocks {
			b, ok, err := g.cons.Poll()
			if err != nil || !ok {
				break
			}
			batch = append(batch, b)
		}
		sources := min(regionLoad32(g.region, ingSourceCount), uint32(g.maxSrc))
		for i := range batch {
			b := &batch[i]
			dst := g.stagingDev + uint64(i*g.bufSize)
			if err := g.dev.copyInAsync(dst, b.Data()); err != nil {
				return err
			}
			j := g.job(i)
			le.PutUint64(j[jData:], dst)
			le.PutUint64(j[jSeq:], b.Seq)
			le.PutUint64(j[jPublishNs:], b.PublishNs)
			le.PutUint32(j[jRecords:], uint32(b.Records))
			le.PutUint32(j[jBytes:], uint32(b.Bytes))
			le.PutUint32(j[jFlags:], b.Flags)
			le.PutUint32(j[jSources:], sources)
		}
		g.store64(cResultsRead, batch[0].Seq)
		if err := g.dev.launch(kernelBatch, len(batch), g.stage, g.params()); err != nil {
			return err
		}
		secs, err := g.dev.wait(kernelBatch)
		if err != nil {
			return err
		}
		g.launches.Add(1)
		g.kernelNs.Add(uint64(secs * 1e9))
		if err := g.kernelError(); err != nil {
			return err
		}
		for i := range batch {
			if _, ok := g.take(batch[i].Seq); !ok {
				return fmt.Errorf("gpu: no result for buffer %d after its launch", batch[i].Seq)
			}
			if err := g.cons.Release(&batch[i]); err != nil {
				return err
			}
		}
	}
}

// Stats returns a snapshot; safe from any goroutine.
func (g *Consumer) Stats() Stats {
	return Stats{Buffers: g.nbuf.Load(), Records: g.nrec.Load(), Launches: g.launches.Load(),
		KernelSeconds: float64(g.kernelNs.Load()) / 1e9, Latency: g.latency.Snapshot()}
}

// Results copies the trigger's totals out of device memory; call it after
// Run has returned.
func (g *Consumer) Results() (*Results, error) {
	le := binary.LittleEndian
	var st [stateSize]byte
	if err := g.dev.copyOut(st[:], g.stateDev); err != nil {
		return nil, err
	}
	r := &Results{
		Buffers: le.Uint64(st[stBuffers:]), Records: le.Uint64(st[stRecords:]),
		Windows: le.Uint64(st[stWindows:]), Triggers: le.Uint64(st[stTriggers:]),
		Energies: slices.Clone(g.energies),
	}
	if n := int(le.Uint32(st[stSourceSlots:])); n > 0 {
		src := make([]byte, n*sourceSize)
		if err := g.dev.copyOut(src, g.sourcesDev); err != nil {
			return nil, err
		}
		r.Sources = make([]ingest.SourceCounts, n)
		for i := range r.Sources {
			s := src[i*sourceSize:]
			r.Sources[i] = ingest.SourceCounts{
				Records: le.Uint64(s[sRecords:]), Bytes: le.Uint64(s[sBytes:]),
				DroppedHere: le.Uint64(s[sDroppedHere:]), SenderGaps: le.Uint64(s[sSenderGaps:]),
				SenderBackwards: le.Uint64(s[sSenderBackwards:]), Short: le.Uint64(s[sShort:]),
				FirstSeq: le.Uint32(s[sFirstSeq:]), LastSeq: le.Uint32(s[sLastSeq:]),
				FirstRxNs: le.Uint64(s[sFirstRxNs:]), LastRxNs: le.Uint64(s[sLastRxNs:]),
				Reassigned: le.Uint64(s[sReassigned:]),
			}
		}
	}
	if n := min(int(le.Uint32(st[stGapCount:])), g.gapCap); n > 0 {
		raw := make([]byte, n*gapSize)
		if err := g.dev.copyOut(raw, g.gapsDev); err != nil {
			return nil, err
		}
		type keyed struct {
			seq uint64
			key uint32
			gap ingest.Gap
		}
		all := make([]keyed, n)
		for i := range all {
			e := raw[i*gapSize:]
			all[i] = keyed{le.Uint64(e[gSeq:]), le.Uint32(e[gKey:]), ingest.Gap{Source: le.Uint16(e[gSource:]),
				Sender: le.Uint16(e[gSender:]) != 0, Want: le.Uint32(e[gWant:]), Got: le.Uint32(e[gGot:])}}
		}
		slices.SortFunc(all, func(a, b keyed) int {
			if a.seq != b.seq {
				return cmp.Compare(a.seq, b.seq)
			}
			return cmp.Compare(a.key, b.key)
		})
		for _, k := range all[:min(n, ingest.MaxGaps)] {
			r.Gaps = append(r.Gaps, k.gap)
		}
	}
	return r, nil
}

func (g *Consumer) release() error {
	var errs []error
	for _, p := range g.dmem {
		errs = append(errs, g.dev.free(p))
	}
	g.dmem = nil
	if g.host != nil {
		if g.hostDev != 0 {
			errs = append(errs, g.dev.unregister(g.host))
		}
		errs = append(errs, unix.Munmap(g.host))
		g.host = nil
	}
	if g.regionDev != 0 {
		errs = append(errs, g.dev.unregister(g.region))
		g.regionDev = 0
	}
	return errors.Join(errs...)
}

// Close frees the device memory, unregisters the ring and releases the
// GPU. The ingest consumer stays open: the caller closes it.
func (g *Consumer) Close() error {
	if g.dev == nil {
		return nil
	}
	err := g.release()
	err = errors.Join(err, g.dev.close())
	g.dev = nil
	return err
}
