package control

import (
	"os"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
)

// BenchmarkMillionFlows is issue 17's scale on one box: 200 applications
// registered at once, 100 of them holding 1,000,000 flows between them
// (FB_MILLION_FLOWS replaces the number), on the XDP data plane with its
// flow table sized as interfaces[].flow_capacity: 1048576 sizes it
// (FB_MILLION_HEAP_PROFILE names a file for a heap profile with the flows
// held). An op
// is one more claim and its release. Besides the op's time it reports what
// holding the flows costs the daemon's Go heap (bytes and objects a flow)
// and its garbage collector: a forced full collection's time with the
// flows held (the mark work every cycle repeats), the longest
// stop-the-world pause seen, and the collector's share of the CPU the
// process used while the ops ran.
func BenchmarkMillionFlows(b *testing.B) {
	n := 1_000_000
	if s := os.Getenv("FB_MILLION_FLOWS"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil {
			b.Fatalf("FB_MILLION_FLOWS: %v", err)
		}
	}
	const capacity = 1 << 20
	var before, held runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	dp := openRealPlaneSized(b, bridge.PathAuto, capacity)
	r, apps := benchRegistry(b, dp, 200)
	start := time.Now()
	fillFlows(b, r, apps[:100], n)
	fill := time.Since(start)
	runtime.GC()
	runtime.ReadMemStats(&held)
	if path := os.Getenv("FB_MILLION_HEAP_PROFILE"); path != "" {
		writeHeapProfile(b, path) // what holds the flows
	}
	heap := float64(held.HeapAlloc) - float64(before.HeapAlloc)
	objects := float64(held.HeapObjects) - float64(before.HeapObjects)
	var gc time.Duration
	const collections = 3
	for range collections {
		start := time.Now()
		runtime.GC()
		gc += time.Since(start)
	}
	gc /= collections

	// The collector's own work: idle-time marking is left out, as it
	// takes only CPU that nothing else wanted.
	cpu := []metrics.Sample{
		{Name: "/cpu/classes/gc/mark/assist:cpu-seconds"}, {Name: "/cpu/classes/gc/mark/dedicated:cpu-seconds"},
		{Name: "/cpu/classes/gc/pause:cpu-seconds"}, {Name: "/cpu/classes/total:cpu-seconds"}, {Name: "/cpu/classes/idle:cpu-seconds"},
	}
	read := func() (gc, busy float64) {
		metrics.Read(cpu)
		v := func(i int) float64 { return cpu[i].Value.Float64() }
		return v(0) + v(1) + v(2), v(3) - v(4)
	}
	gc0, busy0 := read()
	b.ReportAllocs()
	b.ResetTimer()
	claimLoop(b, r, apps[0], benchRemote(n+1))
	b.StopTimer()
	gc1, busy1 := read()
	var pause uint64
	var stats runtime.MemStats
	runtime.ReadMemStats(&stats)
	for _, p := range stats.PauseNs {
		pause = max(pause, p)
	}
	share := 0.0
	if busy1 > busy0 {
		share = 100 * (gc1 - gc0) / (busy1 - busy0)
	}
	b.ReportMetric(heap/float64(n), "heap-B/flow")
	b.ReportMetric(objects/float64(n), "heap-objects/flow")
	b.ReportMetric(float64(gc.Microseconds())/1000, "full-gc-ms")
	b.ReportMetric(float64(pause)/1000, "max-pause-µs")
	b.ReportMetric(share, "gc-cpu-%")
	b.Logf("%d flows of 100 applications (200 registered) filled in %v; Go heap %.0f MiB for them (%.0f B, %.1f objects a flow); a full collection %v, longest pause %v; XDP flow table of %d: %d MiB of kernel memory",
		n, fill.Round(time.Millisecond), heap/(1<<20), heap/float64(n), objects/float64(n), gc.Round(time.Millisecond),
		time.Duration(pause), capacity, capacity*fbebpf.FlowEntryBytes>>20)
}

func writeHeapProfile(tb testing.TB, path string) {
	f, err := os.Create(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := pprof.WriteHeapProfile(f); err != nil {
		tb.Fatal(err)
	}
}

// TestTwoHundredApplications: 200 applications registered at once on the
// XDP plane, half of them holding flows, keep every realisation of the
// tables equal to a compile from scratch; when they all go, nothing of
// theirs is left in the kernel or the Go tables.
func TestTwoHundredApplications(t *testing.T) {
	dp := openRealPlaneSized(t, bridge.PathAuto, 1<<16)
	r, apps := benchRegistry(t, dp, 200)
	fillFlows(t, r, apps[:100], 20_000)
	checkRealised(t, r, dp, "200 applications, 100 with flows")
	for _, a := range apps {
		if err := r.unregister(a); err != nil {
			t.Fatal(err)
		}
	}
	if got := dp.b.Tables().NumFlows(); got != 0 {
		t.Errorf("%d flows left in the Go tables", got)
	}
	if xdp, _, err := dp.b.KernelFlows(); err != nil || len(xdp) != 0 {
		t.Errorf("%d flows left in the XDP map (%v)", len(xdp), err)
	}
	if n := len(r.snapshot()); n != 0 {
		t.Errorf("%d applications left", n)
	}
}
