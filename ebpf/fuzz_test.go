package ebpf

import (
	"math/rand/v2"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/framegen"
)

// FuzzEqual drives fuzzed frames through the XDP program and the Go
// reference; ruleSet picks one of a few fixed random rule sets. The seed
// corpus in testdata/fuzz/FuzzEqual holds one frame of every header mix.
func FuzzEqual(f *testing.F) {
	p := newPair(f)
	const sets = 4
	var rs [sets]*classifier.RuleSet
	for i := range rs {
		rs[i] = framegen.RandomRuleSet(rand.New(rand.NewPCG(uint64(i), 0xf022)))
	}
	installed := -1
	f.Fuzz(func(t *testing.T, ruleSet uint8, frame []byte) {
		if len(frame) > 3000 {
			return // beyond what a test run takes; no NIC delivers it to XDP either
		}
		if i := int(ruleSet % sets); i != installed {
			if err := p.install(rs[i]); err != nil {
				t.Fatal(err)
			}
			installed = i
		}
		if _, err := p.compare(frame); err != nil {
			t.Fatalf("rule set %d, frame % x:\n%v", ruleSet%sets, frame, err)
		}
	})
}
