package ebpf

import (
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// benchRepeat is how many times one BPF_PROG_TEST_RUN call runs a program;
// large, so that the system call's cost spreads thin.
const benchRepeat = 100_000

// BenchmarkXDP measures the classifier per frame under BPF_PROG_TEST_RUN
// and, in the same iterations on the same frame, a program that only returns
// XDP_PASS, whose ratio drifts less with the machine's load than absolute
// times. The goal is measured against a real peer instead:
// BenchmarkYardstick.
func BenchmarkXDP(b *testing.B) {
	testenv.RequirePrivileged(b)
	p, err := Load()
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	ref := classifier.New(nil, 0)
	for _, c := range framegen.BenchCases() {
		t, err := classifier.Compile(c.Rules)
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Update(t); err != nil {
			b.Fatal(err)
		}
		ref.SetTables(t)
		if m := ref.Classify(c.Frame); m.Verdict != c.Want {
			b.Fatalf("%s: the frame is %v, want %v", c.Name, m.Verdict, c.Want)
		}
		b.Run(c.Name, func(b *testing.B) {
			var prog, trivial time.Duration
			runs := 0
			for b.Loop() {
				_, d, err := p.objs.Fabricbridge.Benchmark(c.Frame, benchRepeat, nil)
				if err != nil {
					b.Fatal(err)
				}
				_, dt, err := p.objs.PassAll.Benchmark(c.Frame, benchRepeat, nil)
				if err != nil {
					b.Fatal(err)
				}
				prog += d
				trivial += dt
				runs++
			}
			b.ReportMetric(float64(prog.Nanoseconds())/float64(runs), "ns/frame")
			b.ReportMetric(float64(trivial.Nanoseconds())/float64(runs), "trivial-ns/frame")
			b.ReportMetric(float64(prog)/float64(trivial), "x-trivial")
		})
	}
}
