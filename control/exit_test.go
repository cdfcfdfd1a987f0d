package control

import (
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// exitFlows is how many flows the exiting application holds in
// TestExitReleasesAtScale; FB_EXIT_FLOWS replaces it.
func exitFlows(tb testing.TB) int {
	if s := os.Getenv("FB_EXIT_FLOWS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			tb.Fatalf("FB_EXIT_FLOWS: %v", err)
		}
		return n
	}
	return 100_000
}

// exitRelease has apps[0] hold n flows and go (its lease ends), while
// apps[1] connects and releases one flow after another. It returns how
// long the release of apps[0]'s flows took and the latencies of apps[1]'s
// claims (connect and release) made while it ran, and before it for a
// reference.
func exitRelease(tb testing.TB, r *registry, apps []*app, n int) (release time.Duration, during, idle []time.Duration) {
	tb.Helper()
	other := apps[1]
	// The other's one held flow gives it a port to go on connecting from
	// once apps[0] holds the rest of the range.
	if _, err := r.connect(other, classifier.ProtoTCP, benchLocal, benchRemote(n+2000)); err != nil {
		tb.Fatal(err)
	}
	fillFlows(tb, r, apps[:1], n)
	var claimErr error
	claim := func(i int) time.Duration {
		start := time.Now()
		c, err := r.connect(other, classifier.ProtoTCP, benchLocal, benchRemote(n+1+i%1000))
		if err == nil {
			err = r.release(other, c.id)
		}
		if err != nil {
			claimErr = err
		}
		return time.Since(start)
	}
	for i := 0; i < 200 && claimErr == nil; i++ {
		idle = append(idle, claim(i))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; claimErr == nil; i++ {
			select {
			case <-stop:
				return
			default:
			}
			during = append(during, claim(i))
		}
	}()
	start := time.Now()
	err := r.unregister(apps[0])
	release = time.Since(start)
	close(stop)
	wg.Wait()
	if err != nil {
		tb.Fatal(err)
	}
	if claimErr != nil {
		tb.Fatalf("the other application's claim: %v", claimErr)
	}
	return release, during, idle
}

// quantile is the q-quantile of ds (sorted in place).
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(q*float64(len(ds))))]
}

// TestExitReleasesAtScale: an application that exits holding 100,000 flows
// has them all released within a second, on the XDP path and on the
// AF_PACKET path's nftables sets, and meanwhile another application's
// claims go on without waiting for the release; afterwards every
// realisation of the tables holds exactly the other's entries.
func TestExitReleasesAtScale(t *testing.T) {
	if testing.Short() {
		t.Skip("fills 100,000 flows")
	}
	for _, p := range realPaths {
		t.Run(p.name, func(t *testing.T) {
			dp := openRealPlane(t, p.path)
			r, apps := benchRegistry(t, dp, 2)
			n := exitFlows(t)
			release, during, idle := exitRelease(t, r, apps, n)
			t.Logf("%s: %d flows released in %v; another application's claims meanwhile: %d, p50 %v p99 %v max %v (before: p50 %v p99 %v max %v)",
				p.name, n, release.Round(time.Millisecond), len(during), quantile(during, 0.5), quantile(during, 0.99), quantile(during, 1),
				quantile(idle, 0.5), quantile(idle, 0.99), quantile(idle, 1))
			checkRealised(t, r, dp, "after the exit") // the other's one flow
			if raceEnabled {
				return // timings mean nothing under the race detector
			}
			if release > time.Second {
				t.Errorf("releasing %d flows took %v, more than a second", n, release)
			}
			// Stalled would mean waiting for the whole release; a claim may
			// wait for one chunk of it.
			if worst := quantile(during, 1); worst > release/4 && worst > 100*time.Millisecond {
				t.Errorf("a claim during the release waited %v (the release took %v)", worst, release)
			}
		})
	}
}
