package gpu

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// fakeDevice runs the kernels' state machine on the CPU, one goroutine per
// block, over the same memory the GPU would see: registered host memory is
// reached at its own address (as with unified addressing) and device
// memory is Go memory. Everything the host side does — registering the
// ring, filling arguments, polling results, stopping — runs unchanged.
type fakeDevice struct {
	mu      sync.Mutex
	mems    map[uint64][]byte
	blocks  sync.WaitGroup
	alive   atomic.Int32
	stage   int
	smCount int

	// What the protocol tests look at.
	released    []uint64 // sequence numbers, in the order buffers were released
	relMu       sync.Mutex
	launches    int
	unregisters int
}

func newFake() *fakeDevice {
	return &fakeDevice{mems: map[uint64][]byte{}, stage: 64 << 10, smCount: 8}
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

// at returns n bytes of whatever memory holds address a.
func (f *fakeDevice) at(a uint64, n int) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	for base, m := range f.mems {
		if a >= base && a+uint64(n) <= base+uint64(len(m)) {
			return m[a-base : a-base+uint64(n) : a-base+uint64(n)]
		}
	}
	panic(fmt.Sprintf("fake device: no memory at %#x+%d", a, n))
}

func (f *fakeDevice) info() deviceInfo {
	return deviceInfo{Name: "fake", Multiprocessors: f.smCount, StageMax: f.stage}
}

func (f *fakeDevice) register(mem []byte) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mems[addrOf(mem)] = mem
	return addrOf(mem), nil
}

func (f *fakeDevice) unregister(mem []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.mems[addrOf(mem)]; !ok {
		return fmt.Errorf("fake device: %#x not registered", addrOf(mem))
	}
	delete(f.mems, addrOf(mem))
	f.unregisters++
	return nil
}

func (f *fakeDevice) alloc(n int) (uint64, error) {
	m := make([]byte, n)
	return f.register(m)
}

func (f *fakeDevice) free(p uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.mems, p)
	return nil
}

func (f *fakeDevice) copyIn(dst uint64, src []byte) error {
	copy(f.at(dst, len(src)), src)
	return nil
}

func (f *fakeDevice) copyOut(dst []byte, src uint64) error {
	copy(dst, f.at(src, len(dst)))
	return nil
}

func (f *fakeDevice) copyInAsync(dst uint64, src []byte) error { return f.copyIn(dst, src) }

func (f *fakeDevice) launch(k kernel, blocks, stage int, params []byte) error {
	a := f.readArgs(binary.LittleEndian.Uint64(params))
	a.stage = stage
	f.launches++
	for b := range blocks {
		f.blocks.Add(1)
		f.alive.Add(1)
		go func() {
			defer f.blocks.Done()
			defer f.alive.Add(-1)
			if k == kernelPersistent {
				f.persistent(a, b, blocks)
			} else {
				f.batch(a, b)
			}
		}()
	}
	return nil
}

func (f *fakeDevice) wait(kernel) (float64, error) {
	f.blocks.Wait()
	return 0, nil
}

func (f *fakeDevice) running() (bool, error) { return f.alive.Load() > 0, nil }
func (f *fakeDevice) close() error           { return nil }

type fakeArgs struct {
	region, ctrl, results, jobs, state, sources, gaps, firstSeq, threshold, descOff, buffersOff uint64
	bufferCount, bufferSize, maxSources, resultSlots, gapCapacity, stageBytes                   uint32
	stage                                                                                       int
}

func (f *fakeDevice) readArgs(p uint64) fakeArgs {
	b := f.at(p, argsSize)
	le := binary.LittleEndian
	u64 := func(o int) uint64 { return le.Uint64(b[o:]) }
	u32 := func(o int) uint32 { return le.Uint32(b[o:]) }
	return fakeArgs{u64(aRegion), u64(aCtrl), u64(aResults), u64(aJobs), u64(aState), u64(aSources), u64(aGaps),
		u64(aFirstSeq), u64(aThreshold), u64(aDescOff), u64(aBuffersOff),
		u32(aBufferCount), u32(aBufferSize), u32(aMaxSources), u32(aResultSlots), u32(aGapCapacity), u32(aStageBytes), 0}
}

func (f *fakeDevice) p32(a uint64) *uint32 { return (*uint32)(unsafe.Pointer(&f.at(a, 4)[0])) }
func (f *fakeDevice) p64(a uint64) *uint64 { return (*uint64)(unsafe.Pointer(&f.at(a, 8)[0])) }

type fakeJob struct {
	data                            []byte
	seq, publishNs                  uint64
	records, bytes, flags, nsources uint32
}

func (f *fakeDevice) fail(a fakeArgs, code uint32, seq uint64, record uint32) {
	if atomic.AddUint32(f.p32(a.state+stFailed), 1) == 1 {
		atomic.StoreUint64(f.p64(a.ctrl+cErrorSeq), seq)
		atomic.StoreUint32(f.p32(a.ctrl+cErrorRecord), record)
		atomic.StoreUint32(f.p32(a.ctrl+cError), code)
	}
}

func (f *fakeDevice) stopped(a fakeArgs, seq uint64) bool {
	return seq >= atomic.LoadUint64(f.p64(a.ctrl+cStopSeq)) || atomic.LoadUint32(f.p32(a.state+stFailed)) != 0
}

func (f *fakeDevice) persistent(a fakeArgs, block, blocks int) {
	for seq := a.firstSeq + uint64(block); ; seq += uint64(blocks) {
		j, ok := f.waitReady(a, seq)
		if !ok {
			return
		}
		desc := a.region + a.descOff + (seq%uint64(a.bufferCount))*ingDescSize
		f.process(a, j, desc, true)
		if atomic.LoadUint32(f.p32(a.state+stFailed)) != 0 {
			return
		}
	}
}

func (f *fakeDevice) waitReady(a fakeArgs, seq uint64) (fakeJob, bool) {
	desc := a.region + a.descOff + (seq%uint64(a.bufferCount))*ingDescSize
	for {
		if atomic.LoadUint32(f.p32(desc+ingDState)) == ingStateReady {
			got := atomic.LoadUint64(f.p64(desc + ingDSeq))
			if got == seq {
				break
			}
			if got > seq {
				f.fail(a, errSeq, seq, 0)
				return fakeJob{}, false
			}
		}
		if f.stopped(a, seq) {
			return fakeJob{}, false
		}
		runtime.Gosched()
	}
	d := f.at(desc, ingDescSize)
	le := binary.LittleEndian
	j := fakeJob{seq: seq, publishNs: le.Uint64(d[ingDPublishNs:]), records: le.Uint32(d[ingDRecords:]),
		bytes: le.Uint32(d[ingDBytes:]), flags: le.Uint32(d[ingDFlags:])}
	first, last := le.Uint64(d[ingDFirstNs:]), le.Uint64(d[ingDLastNs:])
	j.nsources = min(atomic.LoadUint32(f.p32(a.region+ingSourceCount)), a.maxSources)
	if j.bytes > a.bufferSize || j.records < 1 || j.records > j.bytes/ingRecordHeader || last < first {
		f.fail(a, errDesc, seq, 0)
		return fakeJob{}, false
	}
	j.data = f.at(a.region+a.buffersOff+(seq%uint64(a.bufferCount))*uint64(a.bufferSize), int(j.bytes))
	return j, true
}

func (f *fakeDevice) batch(a fakeArgs, block int) {
	jb := f.at(a.jobs+uint64(block*jobSize), jobSize)
	le := binary.LittleEndian
	j := fakeJob{seq: le.Uint64(jb[jSeq:]), publishNs: le.Uint64(jb[jPublishNs:]), records: le.Uint32(jb[jRecords:]),
		bytes: le.Uint32(jb[jBytes:]), flags: le.Uint32(jb[jFlags:]), nsources: le.Uint32(jb[jSources:])}
	if j.bytes > a.bufferSize || j.records < 1 || j.records > j.bytes/ingRecordHeader {
		f.fail(a, errDesc, j.seq, 0)
		return
	}
	j.data = f.at(le.Uint64(jb[jData:]), int(j.bytes))
	f.process(a, j, 0, false)
}

// fakeSource is struct fb_trigger_source.
type fakeSource struct {
	records, bytes, droppedHere, senderGaps, senderBackwards, short, firstRx, lastRx, reassigned uint64
	nextRing, nextSeq, firstSeq, lastSeq, haveSeq, gaps, gen                                     uint32
}

func (f *fakeDevice) loadSource(a fakeArgs, i int) fakeSource {
	b := f.at(a.sources+uint64(i*sourceSize), sourceSize)
	le := binary.LittleEndian
	return fakeSource{le.Uint64(b[sRecords:]), le.Uint64(b[sBytes:]), le.Uint64(b[sDroppedHere:]), le.Uint64(b[sSenderGaps:]),
		le.Uint64(b[sSenderBackwards:]), le.Uint64(b[sShort:]), le.Uint64(b[sFirstRxNs:]), le.Uint64(b[sLastRxNs:]),
		le.Uint64(b[sReassigned:]), le.Uint32(b[sNextRing:]), le.Uint32(b[sNextSeq:]), le.Uint32(b[sFirstSeq:]),
		le.Uint32(b[sLastSeq:]), le.Uint32(b[sHaveSeq:]), le.Uint32(b[sGaps:]), le.Uint32(b[sGen:])}
}

func (f *fakeDevice) storeSource(a fakeArgs, i int, s fakeSource) {
	b := f.at(a.sources+uint64(i*sourceSize), sourceSize)
	le := binary.LittleEndian
	for o, v := range map[int]uint64{sRecords: s.records, sBytes: s.bytes, sDroppedHere: s.droppedHere, sSenderGaps: s.senderGaps,
		sSenderBackwards: s.senderBackwards, sShort: s.short, sFirstRxNs: s.firstRx, sLastRxNs: s.lastRx,
		sReassigned: s.reassigned} {
		le.PutUint64(b[o:], v)
	}
	for o, v := range map[int]uint32{sNextRing: s.nextRing, sNextSeq: s.nextSeq, sFirstSeq: s.firstSeq, sLastSeq: s.lastSeq,
		sHaveSeq: s.haveSeq, sGaps: s.gaps, sGen: s.gen} {
		le.PutUint32(b[o:], v)
	}
}

// process is trigger.cu's process, one record at a time.
func (f *fakeDevice) process(a fakeArgs, j fakeJob, desc uint64, persistent bool) {
	le := binary.LittleEndian
	data := j.data
	staged := int(j.bytes) <= a.stage
	if staged {
		data = append([]byte(nil), j.data...)
		if persistent {
			f.releaseDesc(desc, j.seq)
		}
	}
	// Walk and decode.
	type rec struct {
		off, ring, sender, energy, gen uint32
		src, plen                      uint16
		rx                             uint64
	}
	var recs []rec
	var bad uint32
	var energy uint64
	maxSrc := 0
	off := uint32(0)
	for len(recs) < int(j.records) {
		if j.bytes-off < ingRecordHeader {
			bad = errRecord
			break
		}
		size, plen, src := le.Uint32(data[off:]), uint32(le.Uint16(data[off+4:])), le.Uint16(data[off+6:])
		if size < ingRecordHeader || size%8 != 0 || size > j.bytes-off || plen > size-ingRecordHeader || uint32(src) >= j.nsources {
			bad = errRecord
			break
		}
		r := rec{off: off, src: src, plen: uint16(plen), ring: le.Uint32(data[off+ingRSeq:]), rx: le.Uint64(data[off+ingRRxNs:]),
			gen: le.Uint32(data[off+ingRSourceGen:])}
		p := data[off+ingRecordHeader : off+ingRecordHeader+plen]
		if plen >= 4 {
			r.sender = binary.BigEndian.Uint32(p)
			for k := 4; k+2 <= len(p); k += 2 {
				r.energy += uint32(binary.BigEndian.Uint16(p[k:]))
			}
		}
		energy += uint64(r.energy)
		maxSrc = max(maxSrc, int(src))
		recs = append(recs, r)
		off += size
	}
	if bad == 0 && off != j.bytes {
		bad = errTrailer
	}
	// Wait for the turn.
	turn := f.p64(a.state + stTurn)
	for atomic.LoadUint64(turn) != j.seq {
		if f.stopped(a, j.seq) {
			return
		}
		runtime.Gosched()
	}
	st := f.at(a.state, stateSize)
	gapsBefore := le.Uint32(st[stGapsBefore:])
	gaps := uint32(0)
	sources := map[int]fakeSource{}
	gap := func(s *fakeSource, src uint16, index uint32, sender uint16, want, got uint32) {
		gaps++
		if gapsBefore >= maxGaps || s.gaps >= maxGaps {
			return
		}
		s.gaps++
		k := le.Uint32(st[stGapCount:])
		le.PutUint32(st[stGapCount:], k+1)
		if k >= a.gapCapacity {
			f.fail(a, errGaps, j.seq, index)
			return
		}
		g := f.at(a.gaps+uint64(k)*gapSize, gapSize)
		le.PutUint64(g[gSeq:], j.seq)
		le.PutUint32(g[gKey:], index*2+uint32(sender))
		le.PutUint16(g[gSource:], src)
		le.PutUint16(g[gSender:], sender)
		le.PutUint32(g[gWant:], want)
		le.PutUint32(g[gGot:], got)
	}
	for i, r := range recs {
		s, ok := sources[int(r.src)]
		if !ok {
			s = f.loadSource(a, int(r.src))
		}
		fresh := s.records == 0
		if !fresh && r.gen != s.gen {
			s.reassigned++
			s.haveSeq, fresh = 0, true
		}
		s.gen = r.gen
		s.records++
		s.bytes += uint64(r.plen)
		if fresh {
			s.firstRx = r.rx
		} else if r.ring != s.nextRing {
			gap(&s, r.src, uint32(i), 0, s.nextRing, r.ring)
			s.droppedHere += uint64(r.ring - s.nextRing)
		}
		s.nextRing = r.ring + 1
		s.lastRx = r.rx
		if r.plen < 4 {
			s.short++
		} else {
			switch d := int32(r.sender - s.nextSeq); {
			case s.haveSeq == 0:
				s.firstSeq, s.haveSeq, s.nextSeq = r.sender, 1, r.sender+1
			case d == 0:
				s.nextSeq++
			case d > 0:
				gap(&s, r.src, uint32(i), 1, s.nextSeq, r.sender)
				s.senderGaps += uint64(d)
				s.nextSeq = r.sender + 1
			default:
				s.senderBackwards++
			}
			s.lastSeq = r.sender
		}
		sources[int(r.src)] = s
	}
	for i, s := range sources {
		f.storeSource(a, i, s)
	}
	// finish
	window := le.Uint64(st[stWindowEnergy:]) + energy
	le.PutUint64(st[stBuffers:], le.Uint64(st[stBuffers:])+1)
	le.PutUint64(st[stRecords:], le.Uint64(st[stRecords:])+uint64(len(recs)))
	if len(recs) > 0 && uint32(maxSrc+1) > le.Uint32(st[stSourceSlots:]) {
		le.PutUint32(st[stSourceSlots:], uint32(maxSrc+1))
	}
	le.PutUint32(st[stGapsBefore:], min(gapsBefore+gaps, maxGaps))
	if bad != 0 {
		le.PutUint64(st[stWindowEnergy:], window)
		f.fail(a, bad, j.seq, uint32(len(recs)))
		return
	}
	defer atomic.StoreUint64(turn, j.seq+1)
	flags := uint32(0)
	if j.flags&ingBufContinued == 0 {
		le.PutUint64(st[stWindows:], le.Uint64(st[stWindows:])+1)
		flags |= resultClosed
		if window >= a.threshold {
			le.PutUint64(st[stTriggers:], le.Uint64(st[stTriggers:])+1)
			flags |= resultTriggered
		}
		le.PutUint64(st[stWindowEnergy:], 0)
	} else {
		le.PutUint64(st[stWindowEnergy:], window)
	}
	for j.seq-atomic.LoadUint64(f.p64(a.ctrl+cResultsRead)) >= uint64(a.resultSlots) {
		if f.stopped(a, j.seq) {
			return
		}
		runtime.Gosched()
	}
	slot := a.results + (j.seq%uint64(a.resultSlots))*resultSize
	r := f.at(slot, resultSize)
	le.PutUint64(r[rPublishNs:], j.publishNs)
	le.PutUint64(r[rBufferEnergy:], energy)
	le.PutUint64(r[rWindowEnergy:], window)
	le.PutUint32(r[rRecords:], uint32(len(recs)))
	le.PutUint32(r[rFlags:], flags)
	atomic.StoreUint64(f.p64(slot+rSeq1), j.seq+1)
	if persistent && !staged {
		f.releaseDesc(desc, j.seq)
	}
}

func (f *fakeDevice) releaseDesc(desc, seq uint64) {
	f.relMu.Lock()
	f.released = append(f.released, seq)
	f.relMu.Unlock()
	atomic.StoreUint32(f.p32(desc+ingDState), ingStateFree)
}
