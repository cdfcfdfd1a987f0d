package ebpf

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

// fuzzRuleSets is how many fixed rule sets FuzzEqual chooses from.
const fuzzRuleSets = 4

func fuzzRuleSet(i int) *classifier.RuleSet {
	return framegen.RandomRuleSet(rand.New(rand.NewPCG(uint64(i), 0xf022)))
}

// FuzzEqual drives fuzzed frames through the XDP program and the Go
// reference; ruleSet picks one of a few fixed random rule sets. The seed
// corpus in testdata/fuzz/FuzzEqual holds one frame of every header mix
// (mix-*), frames that the rule sets ingest or refuse (ingest-*), and ICMP
// messages that they steer or pass (icmp-*).
func FuzzEqual(f *testing.F) {
	p := newPair(f)
	const sets = fuzzRuleSets
	var rs [sets]*classifier.RuleSet
	for i := range rs {
		rs[i] = fuzzRuleSet(i)
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

// TestFuzzCorpusReachesIngest keeps the committed seed corpus honest: some
// seeds must be ingested (stripped whole and short, IPv4 and IPv6) and some
// refused by an ingest rule under the rule sets FuzzEqual installs.
func TestFuzzCorpusReachesIngest(t *testing.T) {
	seen := map[string]int{}
	for _, s := range readSeeds(t) {
		m := s.classify()
		switch {
		case m.Verdict == classifier.VerdictIngest:
			im, _, _ := classifier.Ingest(s.frame, &m)
			seen[fmt.Sprintf("ingest v6=%v short=%v", im.Flags&classifier.FlagIPv6 != 0, im.PayloadOffset > 0)]++
		case m.Verdict == classifier.VerdictMalformed && m.RuleID != 0:
			seen["refused"]++
		}
	}
	for _, k := range []string{"ingest v6=false short=false", "ingest v6=true short=false", "ingest v6=false short=true", "ingest v6=true short=true", "refused"} {
		if seen[k] == 0 {
			t.Errorf("no seed reaches %q; seen %v", k, seen)
		}
	}
}

// seed is one file of the FuzzEqual seed corpus.
type seed struct {
	name  string
	set   *classifier.Classifier // the reference over the seed's rule set
	frame []byte
}

func (s *seed) classify() classifier.Meta {
	s.set.ResetFragments()
	return s.set.Classify(s.frame)
}

// readSeeds reads the committed FuzzEqual corpus.
func readSeeds(t *testing.T) []seed {
	dir := filepath.Join("testdata", "fuzz", "FuzzEqual")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var rs [fuzzRuleSets]*classifier.Classifier
	for i := range rs {
		tables, err := classifier.Compile(fuzzRuleSet(i))
		if err != nil {
			t.Fatal(err)
		}
		rs[i] = classifier.New(tables, 0)
	}
	var seeds []seed
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if len(lines) != 3 || lines[0] != "go test fuzz v1" {
			t.Fatalf("%s: not a two-value fuzz corpus file", e.Name())
		}
		set, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(lines[1], "uint8("), ")"), 0, 8)
		if err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		frame, err := strconv.Unquote(strings.TrimSuffix(strings.TrimPrefix(lines[2], "[]byte("), ")"))
		if err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		seeds = append(seeds, seed{name: e.Name(), set: rs[set%fuzzRuleSets], frame: []byte(frame)})
	}
	return seeds
}
