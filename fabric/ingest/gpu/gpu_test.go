package gpu

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// RequireGPUEnv makes the GPU tests fail, instead of skipping, where no GPU
// can be used.
const RequireGPUEnv = "FB_REQUIRE_GPU"

// cudaOrSkip opens the first GPU, or skips t (fails it under
// FB_REQUIRE_GPU=1).
func cudaOrSkip(t testing.TB) *cudaDevice {
	t.Helper()
	dev, err := openCUDA(0, ptx)
	if err != nil {
		if os.Getenv(RequireGPUEnv) == "1" {
			t.Fatalf("%s=1 but no GPU: %v", RequireGPUEnv, err)
		}
		t.Skipf("no GPU: %v", err)
	}
	t.Cleanup(func() { dev.close() })
	return dev
}

func TestNoDriverLoadsNothing(t *testing.T) {
	d, err := openDriver("libcuda-fabricbridge-absent.so.1")
	if !errors.Is(err, ErrNoDriver) || d != nil {
		t.Fatalf("openDriver of a missing library = %v, %v; want nil, ErrNoDriver", d, err)
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(maps, []byte("libcuda-fabricbridge-absent")) {
		t.Error("the missing library shows in the process's mappings")
	}
	if _, err := os.Stat("/dev/nvidia0"); err == nil {
		return // a GPU machine: Open must work there, tested elsewhere
	}
	// On a machine without the driver, Open says so and nothing else.
	_, err = Open(nil, Options{})
	if err == nil {
		t.Skip("a CUDA driver loads here without /dev/nvidia0")
	}
	if !errors.Is(err, ErrNoDriver) {
		var ce *CUDAError
		if !errors.As(err, &ce) {
			t.Fatalf("Open without a GPU: %v; want ErrNoDriver or a CUDA error", err)
		}
	}
	t.Logf("Open without a GPU: %v", err)
}

// TestPTXCurrent regenerates the PTX with the go:generate command and
// compares it with the embedded one, as CI does for the XDP program.
func TestPTXCurrent(t *testing.T) {
	if _, err := exec.LookPath("clang"); err != nil {
		t.Skip("no clang to regenerate trigger.ptx")
	}
	src, err := os.ReadFile("gen.go")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^//go:generate (clang .*)$`).FindSubmatch(src)
	if m == nil {
		t.Fatal("no go:generate clang line in gen.go")
	}
	out := filepath.Join(t.TempDir(), "trigger.ptx")
	args := strings.Fields(string(m[1]))
	for i, a := range args {
		if a == "trigger.ptx" && args[i-1] == "-o" {
			args[i] = out
		}
	}
	cmd := exec.Command(args[0], args[1:]...)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", args, err, b)
	}
	fresh, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fresh, ptx) {
		t.Fatal("trigger.ptx is stale: run go generate ./fabric/ingest/gpu")
	}
}

// TestKernelInterface checks the PTX against what the host assumes: both
// entry points, their one pointer parameter, the static shared memory.
func TestKernelInterface(t *testing.T) {
	for _, name := range []string{"fb_trigger_persistent", "fb_trigger_batch"} {
		re := regexp.MustCompile(`\.visible \.entry ` + name + `\(\s*\.param \.u64 ` + name + `_param_0\s*\)`)
		if !re.Match(ptx) {
			t.Errorf("PTX has no entry %s(u64)", name)
		}
		sh := regexp.MustCompile(`\.shared \.align \d+ \.b8 _ZZ\d+` + name + `E2sh\[(\d+)\]`).FindSubmatch(ptx)
		if sh == nil {
			t.Errorf("PTX declares no block_shared for %s", name)
			continue
		}
		if n, _ := strconv.Atoi(string(sh[1])); n != staticShared {
			t.Errorf("%s: %d bytes of static shared memory, the host assumes %d", name, n, staticShared)
		}
	}
}

// TestBlockOnHost runs what a block does with a buffer before its turn
// (fb_block.h: parse, decode, sort, summarise) on the host, a thread per
// CUDA thread, against sequential code, on random buffers: quirks, new
// generations, corrupt records and counts, payloads that look like records.
func TestBlockOnHost(t *testing.T) {
	cc, err := exec.LookPath("clang")
	if err != nil {
		t.Skip("no clang to build testdata/block_host.cpp with")
	}
	bin := filepath.Join(t.TempDir(), "block_host")
	if out, err := exec.Command(cc, "-x", "c++", "-std=c++17", "-O1", "-Wall", "-Werror", "-pthread",
		fmt.Sprintf("-DFB_TRIGGER_THREADS_HOST=%d", threads), "-o", bin, "testdata/block_host.cpp").CombinedOutput(); err != nil {
		t.Fatalf("block_host.cpp does not build: %v\n%s", err, out)
	}
	buffers := "22" // every kind of buffer fill makes, twice
	if testing.Short() {
		buffers = "11"
	}
	out, err := exec.Command(bin, buffers).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("%s", bytes.TrimSpace(out))
}

// TestLayout compiles fb_trigger.h (and through it fb_ingest.h) with the
// system C compiler and compares every offset and size with the Go side.
func TestLayout(t *testing.T) {
	cc, err := exec.LookPath("clang")
	if err != nil {
		if cc, err = exec.LookPath("cc"); err != nil {
			t.Skip("no C compiler to check fb_trigger.h with")
		}
	}
	want := map[string]int{
		"sizeof fb_trigger_args": argsSize, "sizeof fb_trigger_ctrl": ctrlSize, "sizeof fb_trigger_job": jobSize,
		"sizeof fb_trigger_result": resultSize, "sizeof fb_trigger_state": stateSize,
		"sizeof fb_trigger_source": sourceSize, "sizeof fb_trigger_gap": gapSize,
		"FB_TRIGGER_THREADS": threads, "FB_TRIGGER_CHUNK": chunk, "FB_TRIGGER_MAX_GAPS": maxGaps,
		"FB_TRIGGER_MAX_GAPS=ingest.MaxGaps": ingest.MaxGaps,
		"FB_TRIGGER_CLOSED":                  resultClosed, "FB_TRIGGER_TRIGGERED": resultTriggered,
		"FB_TRIGGER_ESEQ": errSeq, "FB_TRIGGER_EDESC": errDesc, "FB_TRIGGER_ERECORD": errRecord,
		"FB_TRIGGER_ETRAILER": errTrailer, "FB_TRIGGER_EGAPS": errGaps,
		"fb_trigger_args.region": aRegion, "fb_trigger_args.ctrl": aCtrl, "fb_trigger_args.results": aResults,
		"fb_trigger_args.jobs": aJobs, "fb_trigger_args.state": aState, "fb_trigger_args.sources": aSources,
		"fb_trigger_args.gaps": aGaps, "fb_trigger_args.first_seq": aFirstSeq, "fb_trigger_args.threshold": aThreshold,
		"fb_trigger_args.desc_off": aDescOff, "fb_trigger_args.buffers_off": aBuffersOff,
		"fb_trigger_args.buffer_count": aBufferCount, "fb_trigger_args.buffer_size": aBufferSize,
		"fb_trigger_args.max_sources": aMaxSources, "fb_trigger_args.result_slots": aResultSlots,
		"fb_trigger_args.gap_capacity": aGapCapacity, "fb_trigger_args.stage_bytes": aStageBytes,
		"fb_trigger_ctrl.stop_seq": cStopSeq, "fb_trigger_ctrl.results_read": cResultsRead, "fb_trigger_ctrl.error": cError,
		"fb_trigger_ctrl.error_record": cErrorRecord, "fb_trigger_ctrl.error_seq": cErrorSeq,
		"fb_trigger_job.data": jData, "fb_trigger_job.seq": jSeq, "fb_trigger_job.publish_ns": jPublishNs,
		"fb_trigger_job.records": jRecords, "fb_trigger_job.bytes": jBytes, "fb_trigger_job.flags": jFlags,
		"fb_trigger_job.sources": jSources,
		"fb_trigger_result.seq1": rSeq1, "fb_trigger_result.publish_ns": rPublishNs,
		"fb_trigger_result.buffer_energy": rBufferEnergy, "fb_trigger_result.window_energy": rWindowEnergy,
		"fb_trigger_result.records": rRecords, "fb_trigger_result.flags": rFlags, "fb_trigger_result.gpu_ns": rGPUNs,
		"fb_trigger_state.turn": stTurn, "fb_trigger_state.window_energy": stWindowEnergy, "fb_trigger_state.windows": stWindows,
		"fb_trigger_state.triggers": stTriggers, "fb_trigger_state.source_slots": stSourceSlots,
		"fb_trigger_state.gaps_before": stGapsBefore, "fb_trigger_state.gap_count": stGapCount,
		"fb_trigger_state.failed": stFailed, "fb_trigger_state.buffers": stBuffers, "fb_trigger_state.records": stRecords,
		"fb_trigger_state.prof_cycles": stProfCycles, "fb_trigger_state.prof_run_cycles": stProfRunCyc,
		"fb_trigger_state.prof_run_ns": stProfRunNs, "FB_TRIGGER_PHASES": phases,
		"fb_trigger_source.records": sRecords, "fb_trigger_source.bytes": sBytes,
		"fb_trigger_source.dropped_here": sDroppedHere, "fb_trigger_source.sender_gaps": sSenderGaps,
		"fb_trigger_source.sender_backwards": sSenderBackwards, "fb_trigger_source.short_payloads": sShort,
		"fb_trigger_source.first_rx_ns": sFirstRxNs, "fb_trigger_source.last_rx_ns": sLastRxNs,
		"fb_trigger_source.next_ring": sNextRing, "fb_trigger_source.next_seq": sNextSeq,
		"fb_trigger_source.first_seq": sFirstSeq, "fb_trigger_source.last_seq": sLastSeq,
		"fb_trigger_source.have_seq": sHaveSeq, "fb_trigger_source.gaps": sGaps,
		"fb_trigger_source.reassigned": sReassigned, "fb_trigger_source.gen": sGen,
		"fb_trigger_gap.seq": gSeq, "fb_trigger_gap.key": gKey, "fb_trigger_gap.source": gSource,
		"fb_trigger_gap.sender": gSender, "fb_trigger_gap.want": gWant, "fb_trigger_gap.got": gGot,
		"sizeof fb_ingest_header": ingHeaderLen, "sizeof fb_ingest_desc": ingDescSize, "sizeof fb_ingest_record": ingRecordHeader,
		"FB_INGEST_RECORD_HEADER=ingest.RecordHeader": ingest.RecordHeader,
		"fb_ingest_header.published":                  ingPublished, "fb_ingest_header.source_count": ingSourceCount,
		"fb_ingest_header.producer_state": ingProducerState, "fb_ingest_header.buffer_count": ingBufferCount,
		"fb_ingest_header.buffer_size": ingBufferSize, "fb_ingest_header.desc_off": ingDescOff,
		"fb_ingest_header.max_sources": ingMaxSources, "fb_ingest_header.buffers_off": ingBuffersOff,
		"fb_ingest_desc.state": ingDState, "fb_ingest_desc.records": ingDRecords, "fb_ingest_desc.seq": ingDSeq,
		"fb_ingest_desc.bytes": ingDBytes, "fb_ingest_desc.flags": ingDFlags, "fb_ingest_desc.first_ns": ingDFirstNs,
		"fb_ingest_desc.last_ns": ingDLastNs, "fb_ingest_desc.publish_ns": ingDPublishNs,
		"fb_ingest_record.size": ingRSize, "fb_ingest_record.payload_len": ingRPayloadLen,
		"fb_ingest_record.source": ingRSource, "fb_ingest_record.rx_ns": ingRRxNs, "fb_ingest_record.seq": ingRSeq,
		"fb_ingest_record.source_gen": ingRSourceGen,
		"FB_INGEST_READY":             ingStateReady, "FB_INGEST_FREE": ingStateFree, "FB_INGEST_BUF_CONTINUED": ingBufContinued,
	}
	var prog strings.Builder
	prog.WriteString("#include <stdio.h>\n#include <stddef.h>\n#include \"fb_trigger.h\"\nint main(void) {\n")
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range want {
			if !yield(k) {
				return
			}
		}
	}) {
		expr := k
		switch {
		case strings.HasPrefix(k, "sizeof "):
			expr = "sizeof(struct " + strings.TrimPrefix(k, "sizeof ") + ")"
		case strings.Contains(k, "="):
			expr = strings.Split(k, "=")[0]
		case strings.Contains(k, "."):
			parts := strings.SplitN(k, ".", 2)
			expr = fmt.Sprintf("offsetof(struct %s, %s)", parts[0], parts[1])
		}
		fmt.Fprintf(&prog, "\tprintf(\"%s %%lu\\n\", (unsigned long)(%s));\n", k, expr)
	}
	prog.WriteString("\treturn 0;\n}\n")
	dir := t.TempDir()
	src := filepath.Join(dir, "layout.c")
	if err := os.WriteFile(src, []byte(prog.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	wd, _ := os.Getwd()
	bin := filepath.Join(dir, "layout")
	if out, err := exec.Command(cc, "-std=c11", "-Wall", "-Werror", "-I", wd, "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("fb_trigger.h does not compile: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		i := strings.LastIndexByte(line, ' ')
		k, v := line[:i], line[i+1:]
		n, _ := strconv.Atoi(v)
		if n != want[k] {
			t.Errorf("%s: C says %d, Go %d", k, n, want[k])
		}
		seen++
	}
	if seen != len(want) {
		t.Errorf("checked %d of %d", seen, len(want))
	}
}

// checkProtocol looks at what a persistent run left in the ring and the
// fake device: every buffer released exactly once, every descriptor free,
// results seen in publication order.
func checkProtocol(t *testing.T, f *fakeDevice, c *ingest.Consumer, first uint64, buffers uint64, seen []Result) {
	t.Helper()
	region, _ := c.InPlace()
	rel := slices.Clone(f.released)
	slices.Sort(rel)
	for i, s := range rel {
		if s != first+uint64(i) {
			t.Fatalf("released %v...: buffer %d released twice or never", rel[:min(len(rel), i+3)], first+uint64(i))
		}
	}
	if uint64(len(rel)) != buffers {
		t.Errorf("%d buffers released, %d processed", len(rel), buffers)
	}
	n := int(binary.LittleEndian.Uint32(region[ingBufferCount:]))
	descOff := binary.LittleEndian.Uint64(region[ingDescOff:])
	for k := range n {
		if s := regionLoad32(region, descOff+uint64(k)*ingDescSize); s != ingStateFree {
			t.Errorf("descriptor %d left in state %d", k, s)
		}
	}
	for i, r := range seen {
		if r.Seq != first+uint64(i) {
			t.Fatalf("result %d is buffer %d, want %d", i, r.Seq, first+uint64(i))
		}
	}
}

func TestFakeDeviceMatchesReference(t *testing.T) {
	for _, rc := range ringCases {
		ref, refBuffers := referenceRun(t, rc, rc.threshold)
		e := slices.Sorted(slices.Values(ref.Energies))
		t.Logf("%s: window energies %d..%d, median %d", rc.name, e[0], e[len(e)-1], e[len(e)/2])
		if ref.Triggers == 0 || ref.Triggers == ref.Windows || len(ref.Gaps) == 0 {
			t.Fatalf("%s: the script exercises too little: %d of %d windows trigger, %d gaps", rc.name, ref.Triggers, ref.Windows, len(ref.Gaps))
		}
		if rc.cfg.AlignWindows && ref.Windows >= refBuffers {
			t.Fatalf("%s: no window spans buffers (%d windows in %d buffers)", rc.name, ref.Windows, refBuffers)
		}
		for _, mode := range []Mode{Persistent, HostDriven} {
			t.Run(rc.name+"/"+mode.String(), func(t *testing.T) {
				f := newFake()
				t.Cleanup(func() { // after the consumer's release
					if f.unregisters != 2 {
						t.Errorf("%d host mappings unregistered, want 2 (ring and control block)", f.unregisters)
					}
				})
				got, st, seen, c := gpuRun(t, f, rc, Options{Mode: mode, Threshold: rc.threshold, Blocks: 3})
				sameAsReference(t, ref, refBuffers, got)
				if st.Buffers != got.Buffers || len(seen) != int(got.Buffers) {
					t.Errorf("host saw %d results (%d by OnResult), the kernel made %d", st.Buffers, len(seen), got.Buffers)
				}
				if mode == Persistent {
					checkProtocol(t, f, c, 0, got.Buffers, seen)
					if f.launches != 1 {
						t.Errorf("%d launches in persistent mode", f.launches)
					}
				} else if len(f.released) != 0 {
					t.Errorf("host-driven: the kernel released %d buffers itself", len(f.released))
				}
			})
		}
	}
}

// failingAlloc is the fake device, out of memory after left allocations.
type failingAlloc struct {
	*fakeDevice
	left int
}

func (f *failingAlloc) alloc(n int) (uint64, error) {
	if f.left--; f.left < 0 {
		return 0, errors.New("fake device: out of memory")
	}
	return f.fakeDevice.alloc(n)
}

// TestFakeOpenFails: an open that fails part-way returns the error and
// leaves nothing registered or allocated, wherever it failed.
func TestFakeOpenFails(t *testing.T) {
	for _, mode := range []Mode{Persistent, HostDriven} {
		for left := range 5 { // persistent allocates 4 times, host-driven 5
			_, c := newRing(t, ringCases[0].cfg, ingest.ConsumerOptions{})
			f := &failingAlloc{newFake(), left}
			g, err := open(f, c, Options{Mode: mode})
			if err == nil {
				g.release()
				if mode == HostDriven || left < 4 {
					t.Fatalf("%v, allocation %d failing: open succeeded", mode, left+1)
				}
				continue
			}
			if n := len(f.mems); n != 0 {
				t.Errorf("%v, allocation %d failing: %d regions still registered or allocated", mode, left+1, n)
			}
		}
	}
}

// TestFakeStop: a persistent kernel with nothing to do leaves when the
// context ends; one that finds a corrupt record stops every block and Run
// says where.
func TestFakeStop(t *testing.T) {
	rc := ringCases[0]
	t.Run("cancel", func(t *testing.T) {
		_, c := newRing(t, rc.cfg, ingest.ConsumerOptions{})
		f := newFake()
		g, err := open(f, c, Options{Blocks: 4})
		if err != nil {
			t.Fatal(err)
		}
		defer g.release()
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		start := time.Now()
		if err := g.Run(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Run = %v, want the context's error", err)
		}
		if alive, _ := f.running(); alive {
			t.Error("blocks still running after Run returned")
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("Run took %v to stop", el)
		}
	})
	t.Run("corrupt", func(t *testing.T) {
		// Every buffer full, every buffer its own window.
		r, c := newRing(t, ingest.Config{Buffers: 8, BufferSize: 4096, Window: time.Second}, ingest.ConsumerOptions{})
		// Fill the ring before the kernel starts, then break a record of
		// the third buffer.
		for i := 0; r.Writable(); i++ {
			r.Append(source(i%3), 1_000_000_000+uint64(i)*100, []byte{0, 0, 0, byte(i), 0, 1})
		}
		region, _ := c.InPlace()
		le := binary.LittleEndian
		bufOff, size := le.Uint64(region[ingBuffersOff:]), uint64(le.Uint32(region[ingBufferSize:]))
		le.PutUint32(region[bufOff+2*size+32:], 7) // the second record's size
		f := newFake()
		g, err := open(f, c, Options{Blocks: 2, KeepEnergies: true})
		if err != nil {
			t.Fatal(err)
		}
		defer g.release()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err = g.Run(ctx)
		if !errors.Is(err, ErrKernel) || !strings.Contains(err.Error(), "buffer 2, record 1") {
			t.Fatalf("Run = %v, want ErrKernel at buffer 2, record 1", err)
		}
		if alive, _ := f.running(); alive {
			t.Error("blocks still running after the error")
		}
		res, err := g.Results()
		if err != nil {
			t.Fatal(err)
		}
		if res.Windows != 2 {
			t.Errorf("%d windows closed, want the 2 before the corrupt buffer", res.Windows)
		}
	})
}

func TestGPUMatchesReference(t *testing.T) {
	dev := cudaOrSkip(t)
	t.Logf("device: %s, %d multiprocessors, %d bytes to stage a buffer", dev.name, dev.sms, dev.stageMax)
	for _, rc := range ringCases {
		ref, refBuffers := referenceRun(t, rc, rc.threshold)
		for _, mode := range []Mode{Persistent, HostDriven} {
			for _, blocks := range []int{1, 8} {
				t.Run(fmt.Sprintf("%s/%s/%d", rc.name, mode, blocks), func(t *testing.T) {
					gpuMatches(t, dev, rc, ref, refBuffers, Options{Mode: mode, Threshold: rc.threshold, Blocks: blocks})
				})
			}
		}
	}
}

// gpuMatches consumes rc's script on dev and fails t where the results
// differ from the reference's or come out of order.
func gpuMatches(t *testing.T, dev device, rc ringCase, ref *ingest.Reference, refBuffers uint64, opts Options) {
	t.Helper()
	got, _, seen, _ := gpuRun(t, dev, rc, opts)
	sameAsReference(t, ref, refBuffers, got)
	for i, r := range seen {
		if r.Seq != uint64(i) {
			t.Fatalf("result %d is buffer %d", i, r.Seq)
		}
	}
}
