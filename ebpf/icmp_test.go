package ebpf

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

// TestEqualOnICMPErrors is the differential proof for ICMP errors: messages
// quoting tuples of random rule sets (and tuples they do not hold), every
// error type and some other types, whole, truncated at every byte and with
// single bytes corrupted anywhere, get the same classification and metadata
// from the program and the reference.
func TestEqualOnICMPErrors(t *testing.T) {
	p := newPair(t)
	const ruleSets, corruptions = 12, 24
	var byFlow, byListener, passed, checked int
	for seed := range uint64(ruleSets) {
		rng := rand.New(rand.NewPCG(seed, 0x1c))
		rs := framegen.RandomRuleSet(rng)
		if err := p.install(rs); err != nil {
			t.Fatal(err)
		}
		flowIDs := map[uint32]bool{}
		for _, f := range rs.Flows {
			flowIDs[f.ID] = true
		}
		for _, spec := range framegen.ICMPErrorSpecs(rng, rs) {
			frame := spec.Build()
			variants := [][]byte{frame}
			for n := range len(frame) {
				variants = append(variants, frame[:n])
			}
			for range corruptions {
				bad := bytes.Clone(frame)
				bad[rng.IntN(len(bad))] = byte(rng.Uint32())
				variants = append(variants, bad)
			}
			for i, f := range variants {
				v, err := p.compare(f)
				if err != nil {
					t.Fatalf("seed %d, %v, frame (%d bytes) % x:\n%v\nrules: %+v", seed, spec, len(f), f, err, rs)
				}
				checked++
				if i != 0 {
					continue
				}
				switch m := p.ref.Classify(f); {
				case v == classifier.VerdictSteer && flowIDs[m.RuleID]:
					byFlow++
				case v == classifier.VerdictSteer:
					byListener++
				case v == classifier.VerdictPass:
					passed++
				}
			}
		}
	}
	t.Logf("%d frames agreed; whole ICMP messages steered by a flow %d, by a listener %d, passed %d", checked, byFlow, byListener, passed)
	if byFlow == 0 || byListener == 0 || passed == 0 {
		t.Errorf("ICMP paths not all reached: steered by a flow %d, by a listener %d, passed %d", byFlow, byListener, passed)
	}
}

// TestFuzzCorpusReachesICMPErrors: the committed seeds hold ICMP errors that
// the fuzz rule sets steer, IPv4 and IPv6, and ICMP messages they pass.
func TestFuzzCorpusReachesICMPErrors(t *testing.T) {
	seen := map[string]int{}
	for _, s := range readSeeds(t) {
		if !strings.HasPrefix(s.name, "icmp-") {
			continue
		}
		m := s.classify()
		seen[fmt.Sprintf("%v v6=%v", m.Verdict, m.Flags&classifier.FlagIPv6 != 0)]++
	}
	for _, k := range []string{"steer v6=false", "steer v6=true", "pass v6=false", "pass v6=true"} {
		if seen[k] == 0 {
			t.Errorf("no icmp-* seed reaches %q; seen %v", k, seen)
		}
	}
}
