package gpu

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// stagingCandidate is a way of staging a buffer (Options.Staging and what
// goes with it) that TestGPUStaging weighs against the default.
type stagingCandidate struct {
	name string
	opts Options // Mode persistent; Staging, Blocks, SliceBytes
}

// The candidates, the current default first. Shared staging wants helpers:
// with 16 blocks, 15 copy a 64 KiB buffer's 4 KiB slices; with more
// blocks, more and smaller slices.
var stagingCandidates = []stagingCandidate{
	{"burst, 16 blocks", Options{Staging: StagingBurst, Blocks: 16}},
	{"shared, 16 blocks, 4 KiB slices", Options{Staging: StagingShared, Blocks: 16, SliceBytes: 4096}},
	{"shared, 32 blocks, 2 KiB slices", Options{Staging: StagingShared, Blocks: 32, SliceBytes: 2048}},
	{"shared, 64 blocks, 1 KiB slices", Options{Staging: StagingShared, Blocks: 64, SliceBytes: 1024}},
}

// stagingLimit bounds each case of TestGPUStaging: a candidate that hangs
// fails its case (and skips the rest of its own) and the others still
// report. A correct case takes well under a second.
const stagingLimit = 10 * time.Second

// stagingReps is how many paced runs of 1024-record buffers each candidate
// gets, taken in turns with the others so that drift in the machine falls
// on all alike.
const stagingReps = 5

// TestFakeStaging runs every candidate over the three rings on the fake
// device: the host side of each (options, the shared staging's memory)
// gives the reference's results.
func TestFakeStaging(t *testing.T) {
	for _, rc := range ringCases {
		ref, refBuffers := referenceRun(t, rc, rc.threshold)
		for _, sc := range stagingCandidates {
			t.Run(rc.name+"/"+sc.name, func(t *testing.T) {
				f := newFake()
				opts := sc.opts
				opts.Threshold = rc.threshold
				got, _, seen, c := gpuRun(t, f, rc, opts)
				sameAsReference(t, ref, refBuffers, got)
				checkProtocol(t, f, c, 0, got.Buffers, seen)
			})
		}
	}
}

func TestFakeStagingOptions(t *testing.T) {
	rc := ringCases[0]
	for _, bad := range []Options{{Staging: 7}, {Staging: StagingShared, SliceBytes: 1000}} {
		_, c := newRing(t, rc.cfg, ingest.ConsumerOptions{})
		if g, err := open(newFake(), c, bad); err == nil {
			g.release()
			t.Errorf("open with %+v: no error", bad)
		}
	}
	if StagingDefault.String() != "default ("+DefaultStaging.String()+")" || DefaultStaging == StagingDefault {
		t.Errorf("DefaultStaging is %v", DefaultStaging)
	}
}

// stagingResult is what TestGPUStaging found for one candidate.
type stagingResult struct {
	correct     []string   // failed correctness cases
	paced       []uint64   // 1024-record buffers, every repetition's samples
	p99s        []float64  // each repetition's p99, µs
	small       latencies  // 64-record buffers, once
	drain       throughput // the full ring, 16 blocks or the candidate's
	profile     string     // the last 1024-record repetition's
	failedCases int
}

// TestGPUStaging decides between the staging candidates in one run: each
// is checked against the CPU reference on the three rings (1 block and its
// own count), then measured on paced 1024-record buffers (the latency the
// issue's goal is about, stagingReps times, in turns), 64-record buffers
// and a drained full ring, and a table compares them. Every case is
// bounded by stagingLimit.
func TestGPUStaging(t *testing.T) {
	t.Log("\n" + weighStaging(t, cudaOrSkip(t), scale{buffers: measureBuffers, latency: latencyBuffers}, stagingReps))
}

// TestFakeWeighStaging runs TestGPUStaging's harness, small, on the fake
// device: it works, and prints its table, before a GPU's time is spent.
func TestFakeWeighStaging(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	table := weighStaging(t, newFake(), scale{buffers: 16, latency: 200}, 2)
	t.Log("\n" + table)
	if !strings.Contains(table, "STAGING: decision: lowest") {
		t.Error("no decision in the table")
	}
}

func weighStaging(t *testing.T, dev device, sc scale, reps int) string {
	defer func(l time.Duration) { runLimit = l }(runLimit)
	runLimit = stagingLimit
	res := make([]stagingResult, len(stagingCandidates))
	for _, rc := range ringCases {
		ref, refBuffers := referenceRun(t, rc, rc.threshold)
		for i, sc := range stagingCandidates {
			for _, blocks := range []int{1, sc.opts.Blocks} {
				if len(res[i].correct) > 0 {
					break // one failure decides, and a hang costs stagingLimit a case
				}
				name := fmt.Sprintf("correct/%s/%s/%d", rc.name, sc.name, blocks)
				ok := t.Run(name, func(t *testing.T) {
					opts := sc.opts
					opts.Threshold, opts.Blocks = rc.threshold, blocks
					gpuMatches(t, dev, rc, ref, refBuffers, opts)
				})
				if !ok {
					res[i].correct = append(res[i].correct, fmt.Sprintf("%s/%d", rc.name, blocks))
				}
			}
		}
	}
	for rep := range reps {
		for i, cand := range stagingCandidates {
			if len(res[i].correct) > 0 || res[i].failedCases > 0 {
				continue
			}
			t.Run(fmt.Sprintf("paced1024/%s/%d", cand.name, rep), func(t *testing.T) {
				res[i].failedCases++
				l := gpuLatency(t, dev, sc, cand.opts, measureRecords)
				res[i].failedCases--
				res[i].paced = append(res[i].paced, l.samples...)
				res[i].p99s = append(res[i].p99s, us(l.quantile(0.99)))
				res[i].profile = l.profile
				t.Logf("%s: %v", cand.name, l)
			})
		}
	}
	for i, cand := range stagingCandidates {
		if len(res[i].correct) > 0 || res[i].failedCases > 0 {
			continue
		}
		t.Run("paced64/"+cand.name, func(t *testing.T) {
			res[i].failedCases++
			res[i].small = gpuLatency(t, dev, sc, cand.opts, 64)
			res[i].failedCases--
			t.Logf("%s: %v", cand.name, res[i].small)
		})
		t.Run("drain/"+cand.name, func(t *testing.T) {
			res[i].failedCases++
			res[i].drain = bestThroughput(t, dev, sc, cand.opts)
			res[i].failedCases--
			t.Logf("%s: %v", cand.name, res[i].drain)
		})
	}
	// What TestGPUMeasure's larger drains would become with shared staging
	// the default (4 KiB slices), next to burst's, in this run.
	var drains strings.Builder
	for _, blocks := range []int{64, 128} {
		for _, st := range []Staging{StagingBurst, StagingShared} {
			t.Run(fmt.Sprintf("drain/%v/%d", st, blocks), func(t *testing.T) {
				best := bestThroughput(t, dev, sc, Options{Staging: st, Blocks: blocks})
				fmt.Fprintf(&drains, "STAGING: drain, %-6v %3d blocks: %.1f M records/s\n", st, blocks,
					float64(best.records)/best.elapsed.Seconds()/1e6)
			})
		}
	}
	return stagingTable(res, sc) + drains.String()
}

// stagingTable compares the candidates and names the one with the lowest
// p99 over all its 1024-record samples among those correct everywhere.
func stagingTable(res []stagingResult, sc scale) string {
	var b strings.Builder
	fmt.Fprintf(&b, "STAGING: paced, one buffer per %v, %d buffers a repetition; latency publish to result, µs\n", latencyInterval, sc.latency)
	fmt.Fprintf(&b, "STAGING: %-34s %8s %8s %8s %8s  %-34s %8s %9s  %s\n", "candidate", "p50", "p99", "p99.9", "max",
		"p99 per repetition", "64 p99", "drain M/s", "reference")
	best := -1
	var bestP99 float64
	for i, r := range res {
		cand := stagingCandidates[i]
		if len(r.paced) == 0 {
			fmt.Fprintf(&b, "STAGING: %-34s no 1024-record run completed; not equal to the reference in: %s\n", cand.name,
				strings.Join(r.correct, " "))
			continue
		}
		all := latencies{samples: slices.Sorted(slices.Values(r.paced))}
		reps := make([]string, len(r.p99s))
		for k, p := range r.p99s {
			reps[k] = fmt.Sprintf("%.1f", p)
		}
		small, drain := "-", "-"
		if len(r.small.samples) > 0 {
			small = fmt.Sprintf("%.1f", us(r.small.quantile(0.99)))
		}
		if r.drain.elapsed > 0 {
			drain = fmt.Sprintf("%.1f", float64(r.drain.records)/r.drain.elapsed.Seconds()/1e6)
		}
		correct := "equal"
		if len(r.correct) > 0 {
			correct = "DIFFERS/FAILED: " + strings.Join(r.correct, " ")
		}
		if r.failedCases > 0 {
			correct += fmt.Sprintf(" (%d measurement cases failed)", r.failedCases)
		}
		p99 := us(all.quantile(0.99))
		fmt.Fprintf(&b, "STAGING: %-34s %8.1f %8.1f %8.1f %8.1f  %-34s %8s %9s  %s\n", cand.name, us(all.quantile(0.5)), p99,
			us(all.quantile(0.999)), us(time.Duration(all.samples[len(all.samples)-1])), strings.Join(reps, " "), small, drain, correct)
		if r.profile != "" {
			fmt.Fprintf(&b, "STAGING:     %s\n", r.profile)
		}
		if len(r.correct) == 0 && r.failedCases == 0 && (best < 0 || p99 < bestP99) {
			best, bestP99 = i, p99
		}
	}
	if best < 0 {
		b.WriteString("STAGING: decision: no candidate completed correctly\n")
		return b.String()
	}
	win := stagingCandidates[best].opts
	fmt.Fprintf(&b, "STAGING: decision: lowest 1024-record p99 among correct candidates: %q, %.1f µs (goal < 50 µs: %s)\n",
		stagingCandidates[best].name, bestP99, verdict(bestP99 < 50))
	var change []string
	if win.Staging != DefaultStaging {
		change = append(change, "DefaultStaging = Staging"+strings.ToUpper(win.Staging.String()[:1])+win.Staging.String()[1:])
	}
	if win.Blocks != defaultPers {
		change = append(change, fmt.Sprintf("defaultPers = %d", win.Blocks))
	}
	if win.Staging == StagingShared && win.SliceBytes != defaultSliceBytes {
		change = append(change, fmt.Sprintf("defaultSliceBytes = %d", win.SliceBytes))
	}
	if len(change) == 0 {
		b.WriteString("STAGING: decision: keep the defaults\n")
	} else {
		fmt.Fprintf(&b, "STAGING: decision: in consumer.go set %s\n", strings.Join(change, ", "))
	}
	return b.String()
}
