package ebpf

import (
	"reflect"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/maglev"
)

// TestMetaLayout checks that classifier.Meta and the C struct fb_meta, as
// bpf2go renders it, have the same fields at the same offsets, and that
// MarshalTo writes them where the program does.
func TestMetaLayout(t *testing.T) {
	goType := reflect.TypeFor[classifier.Meta]()
	cType := reflect.TypeFor[bpfFbMeta]()
	if goType.Size() != cType.Size() || goType.Size() != classifier.MetaSize {
		t.Fatalf("sizes: classifier.Meta %d, fb_meta %d, MetaSize %d", goType.Size(), cType.Size(), classifier.MetaSize)
	}
	var cFields []reflect.StructField
	for i := range cType.NumField() {
		if f := cType.Field(i); f.Name != "_" {
			cFields = append(cFields, f)
		}
	}
	if goType.NumField() != len(cFields) {
		t.Fatalf("classifier.Meta has %d fields, fb_meta %d", goType.NumField(), len(cFields))
	}
	for i, c := range cFields {
		g := goType.Field(i)
		if g.Offset != c.Offset || g.Type.Size() != c.Type.Size() || g.Type.Kind() != c.Type.Kind() {
			t.Errorf("field %d: classifier.Meta.%s (%v at %d) vs fb_meta.%s (%v at %d)", i, g.Name, g.Type, g.Offset, c.Name, c.Type, c.Offset)
		}
	}

	m := classifier.Meta{RxTimestampNs: 1, StreamID: 2, RuleID: 3, L3Offset: 4, L4Offset: 5, VLAN: 6, Verdict: 7, Flags: 8}
	var b [classifier.MetaSize]byte
	m.MarshalTo(b[:])
	c := bpfFbMeta{RxTimestampNs: 1, StreamId: 2, RuleId: 3, L3Offset: 4, L4Offset: 5, Vlan: 6, Verdict: 7, Flags: 8}
	if got := classifier.UnmarshalMeta(b[:]); got != m {
		t.Errorf("UnmarshalMeta(MarshalTo(m)) = %+v, want %+v", got, m)
	}
	cb := (*[classifier.MetaSize]byte)(reflect.ValueOf(&c).UnsafePointer())
	if *cb != b {
		t.Errorf("MarshalTo wrote % x, the C layout holds % x", b, *cb)
	}
}

// TestIngestMetaLayout checks classifier.IngestMeta against struct
// fb_ingest_meta: same size, same named fields at the same offsets and
// sizes, and MarshalTo's bytes equal to the C struct's memory.
func TestIngestMetaLayout(t *testing.T) {
	goType := reflect.TypeFor[classifier.IngestMeta]()
	cType := reflect.TypeFor[bpfFbIngestMeta]()
	if goType.Size() != cType.Size() || goType.Size() != classifier.IngestMetaSize {
		t.Fatalf("sizes: classifier.IngestMeta %d, fb_ingest_meta %d, IngestMetaSize %d", goType.Size(), cType.Size(), classifier.IngestMetaSize)
	}
	named := func(typ reflect.Type) []reflect.StructField {
		var out []reflect.StructField
		for i := range typ.NumField() {
			if f := typ.Field(i); f.Name != "_" && f.Name != "Pad" {
				out = append(out, f)
			}
		}
		return out
	}
	gf, cf := named(goType), named(cType)
	if len(gf) != len(cf) {
		t.Fatalf("classifier.IngestMeta has %d fields, fb_ingest_meta %d", len(gf), len(cf))
	}
	for i := range gf {
		g, c := gf[i], cf[i]
		if g.Offset != c.Offset || g.Type.Size() != c.Type.Size() {
			t.Errorf("field %d: classifier.IngestMeta.%s (%v at %d) vs fb_ingest_meta.%s (%v at %d)", i, g.Name, g.Type, g.Offset, c.Name, c.Type, c.Offset)
		}
	}

	m := classifier.IngestMeta{RxTimestampNs: 1, BufferID: 2, RuleID: 3, SrcPort: 4, DstPort: 5, PayloadLen: 6, PayloadOffset: 7, Verdict: 8, Flags: 9}
	for i := range m.Src {
		m.Src[i] = byte(16 + i)
	}
	var b [classifier.IngestMetaSize]byte
	m.MarshalTo(b[:])
	c := bpfFbIngestMeta{RxTimestampNs: 1, Src: words64(m.Src), BufferId: 2, RuleId: 3, SrcPort: 4, DstPort: 5, PayloadLen: 6, PayloadOffset: 7, Verdict: 8, Flags: 9}
	cb := (*[classifier.IngestMetaSize]byte)(reflect.ValueOf(&c).UnsafePointer())
	if *cb != b {
		t.Errorf("MarshalTo wrote % x, the C layout holds % x", b, *cb)
	}
	if classifier.MaxRuleID > 0xffff {
		t.Errorf("rule ids up to %d do not fit fb_ingest_meta's 16-bit rule_id", classifier.MaxRuleID)
	}
}

// TestSharedConstants checks the C enums and limits against package
// classifier.
func TestSharedConstants(t *testing.T) {
	verdicts := map[bpfFbVerdict]classifier.Verdict{
		bpfFbVerdictFB_VERDICT_PASS:      classifier.VerdictPass,
		bpfFbVerdictFB_VERDICT_DROP:      classifier.VerdictDrop,
		bpfFbVerdictFB_VERDICT_STEER:     classifier.VerdictSteer,
		bpfFbVerdictFB_VERDICT_INGEST:    classifier.VerdictIngest,
		bpfFbVerdictFB_VERDICT_MALFORMED: classifier.VerdictMalformed,
		bpfFbVerdictFB_VERDICT_FRAG_MISS: classifier.VerdictFragMiss,
		bpfFbVerdictFB_NUM_VERDICTS:      classifier.NumVerdicts,
	}
	for c, g := range verdicts {
		if uint32(c) != uint32(g) {
			t.Errorf("verdict %v: C %d, Go %d", g, c, g)
		}
	}
	actions := map[bpfFbAction]classifier.Action{
		bpfFbActionFB_ACTION_STEER:  classifier.ActionSteer,
		bpfFbActionFB_ACTION_INGEST: classifier.ActionIngest,
		bpfFbActionFB_ACTION_PASS:   classifier.ActionPass,
		bpfFbActionFB_ACTION_DROP:   classifier.ActionDrop,
	}
	for c, g := range actions {
		if uint32(c) != uint32(g) {
			t.Errorf("action %v: C %d, Go %d", g, c, g)
		}
	}
	flags := map[bpfFbFlag]int{
		bpfFbFlagFB_FLAG_IPV6:           classifier.FlagIPv6,
		bpfFbFlagFB_FLAG_FRAGMENT:       classifier.FlagFragment,
		bpfFbFlagFB_FLAG_LATER_FRAGMENT: classifier.FlagLaterFragment,
		bpfFbFlagFB_FLAG_SECOND_CHANCE:  classifier.FlagSecondChance,
	}
	for c, g := range flags {
		if int(c) != g {
			t.Errorf("flag: C %d, Go %d", c, g)
		}
	}
	for _, l := range []struct {
		name string
		c    bpfFbLimit
		g    int
	}{
		{"MaxRules", bpfFbLimitFB_MAX_RULES, classifier.MaxRules},
		{"MaxRuleID", bpfFbLimitFB_MAX_RULE_ID, classifier.MaxRuleID},
		{"MaxExtHeaders", bpfFbLimitFB_MAX_EXT_HEADERS, classifier.MaxExtHeaders},
		{"DefaultFragmentCapacity", bpfFbLimitFB_FRAG_ENTRIES, classifier.DefaultFragmentCapacity},
		{"maglev.DefaultSize", bpfFbLimitFB_MAX_SPREAD_SLOTS, maglev.DefaultSize},
	} {
		if int(l.c) != l.g {
			t.Errorf("%s: C %d, Go %d", l.name, l.c, l.g)
		}
	}
	if n := len(bpfFbSpread{}.Slots); n != MaxSpreadSlots {
		t.Errorf("C holds %d slots a spread, MaxSpreadSlots is %d", n, MaxSpreadSlots)
	}
	if n := len(bpfFbRuleset{}.Rules); n != classifier.MaxRules {
		t.Errorf("C holds %d rules, classifier.MaxRules is %d", n, classifier.MaxRules)
	}
	spec, err := loadBpf()
	if err != nil {
		t.Fatal(err)
	}
	if n := spec.Maps[bpfMapRuleCounters].MaxEntries; n != classifier.MaxRuleID+1 {
		t.Errorf("rule_counters has %d entries, want MaxRuleID+1 = %d", n, classifier.MaxRuleID+1)
	}
	if n := spec.Maps[bpfMapFragments].MaxEntries; n != classifier.DefaultFragmentCapacity {
		t.Errorf("fragments has %d entries, classifier.DefaultFragmentCapacity is %d", n, classifier.DefaultFragmentCapacity)
	}
}
