package ebpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// XDP return codes.
const (
	xdpAborted = 0
	xdpDrop    = 1
	xdpPass    = 2
)

// minTestRunFrame is the shortest frame BPF_PROG_TEST_RUN accepts for XDP;
// drivers never hand XDP a shorter one either.
const minTestRunFrame = 14

// pair runs the XDP program and the Go reference side by side.
type pair struct {
	prog *Program
	ref  *classifier.Classifier
	out  []byte
}

func newPair(tb testing.TB) *pair {
	testenv.RequirePrivileged(tb)
	p, err := load(Options{}, true)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.Close() })
	// Stamped, so that agree can demand the timestamp of every steered frame.
	if err := p.StampSteered(true); err != nil {
		tb.Fatal(err)
	}
	t, err := classifier.Compile(&classifier.RuleSet{})
	if err != nil {
		tb.Fatal(err)
	}
	return &pair{prog: p, ref: classifier.New(t, 0), out: make([]byte, 4096)}
}

// install gives both classifiers rs and empty fragment tables.
func (p *pair) install(rs *classifier.RuleSet) error {
	t, err := classifier.Compile(rs)
	if err != nil {
		return fmt.Errorf("compile: %w\n%+v", err, rs)
	}
	if err := p.prog.Update(t); err != nil {
		return err
	}
	if err := p.prog.ResetFragments(); err != nil {
		return err
	}
	p.ref.SetTables(t)
	p.ref.ResetFragments()
	return nil
}

// run classifies frame in the kernel and returns the XDP action, the
// recorded classification, the bytes in front of the frame (metadata) and
// the frame as the program left it.
func (p *pair) run(frame []byte) (action uint32, got classifier.Meta, meta, out []byte, err error) {
	var ctxOut xdpMD
	opts := ebpf.RunOptions{
		Data:       frame,
		DataOut:    p.out,
		Context:    xdpMD{DataEnd: uint32(len(frame))},
		ContextOut: &ctxOut,
		Repeat:     1,
	}
	action, err = p.prog.Program().Run(&opts)
	if err != nil {
		return 0, got, nil, nil, err
	}
	var rec bpfFbMeta
	if err := p.prog.objs.LastMeta.Lookup(uint32(0), &rec); err != nil {
		return 0, got, nil, nil, err
	}
	got = classifier.Meta{
		RxTimestampNs: rec.RxTimestampNs, StreamID: rec.StreamId, RuleID: rec.RuleId,
		L3Offset: rec.L3Offset, L4Offset: rec.L4Offset, VLAN: rec.Vlan,
		Verdict: classifier.Verdict(rec.Verdict), Flags: rec.Flags,
	}
	metaLen := ctxOut.Data - ctxOut.DataMeta
	if int(metaLen) > len(opts.DataOut) {
		return 0, got, nil, nil, fmt.Errorf("metadata length %d beyond output", metaLen)
	}
	return action, got, opts.DataOut[:metaLen], opts.DataOut[metaLen:], nil
}

// xdpMD is struct xdp_md, the context of an XDP test run.
type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// compare classifies frame both ways and describes any difference.
func (p *pair) compare(frame []byte) (classifier.Verdict, error) {
	want := p.ref.Classify(frame)
	return want.Verdict, p.agree(frame, want)
}

func (p *pair) agree(frame []byte, want classifier.Meta) error {
	if len(frame) < minTestRunFrame {
		if want.Verdict != classifier.VerdictMalformed {
			return fmt.Errorf("reference: %d-byte frame is %v, want malformed", len(frame), want.Verdict)
		}
		return nil
	}
	action, got, meta, out, err := p.run(frame)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("classification differs:\n  xdp %+v\n  go  %+v", got, want)
	}
	wantAction := uint32(xdpPass) // steer and ingest fall back to pass: no AF_XDP socket in a test run
	if want.Verdict == classifier.VerdictDrop {
		wantAction = xdpDrop
	}
	if action != wantAction {
		return fmt.Errorf("action %d, want %d for %v", action, wantAction, want.Verdict)
	}
	switch want.Verdict {
	case classifier.VerdictSteer:
	case classifier.VerdictIngest:
		return agreeIngest(frame, &want, meta, out)
	default:
		if len(meta) != 0 {
			return fmt.Errorf("%d metadata bytes on a %v frame", len(meta), want.Verdict)
		}
		if !bytes.Equal(out, frame) {
			return fmt.Errorf("a %v frame changed", want.Verdict)
		}
		return nil
	}
	if len(meta) != classifier.MetaSize {
		return fmt.Errorf("metadata is %d bytes, want %d", len(meta), classifier.MetaSize)
	}
	var wantBytes [classifier.MetaSize]byte
	want.MarshalTo(wantBytes[:])
	// The timestamp is the kernel's clock; everything after it must match.
	if !bytes.Equal(meta[8:], wantBytes[8:]) {
		return fmt.Errorf("metadata bytes differ:\n  xdp % x\n  go  % x", meta, wantBytes)
	}
	if binary.NativeEndian.Uint64(meta) == 0 {
		return fmt.Errorf("metadata has no RX timestamp")
	}
	if !bytes.Equal(out, frame) {
		return fmt.Errorf("frame changed behind the metadata")
	}
	return nil
}

// agreeIngest checks an ingest frame as the program left it (stripped, with
// the test hook strip_unbound) against classifier.Ingest: the same metadata
// bytes and the same stripped frame.
func agreeIngest(frame []byte, m *classifier.Meta, meta, out []byte) error {
	im, strip, ok := classifier.Ingest(frame, m)
	if !ok {
		return fmt.Errorf("reference: classifier.Ingest refused its own ingest classification %+v", *m)
	}
	if len(meta) != classifier.IngestMetaSize {
		return fmt.Errorf("ingest metadata is %d bytes, want %d", len(meta), classifier.IngestMetaSize)
	}
	var wantBytes [classifier.IngestMetaSize]byte
	im.MarshalTo(wantBytes[:])
	if !bytes.Equal(meta[8:], wantBytes[8:]) {
		return fmt.Errorf("ingest metadata bytes differ:\n  xdp % x\n  go  % x", meta, wantBytes)
	}
	if binary.NativeEndian.Uint64(meta) == 0 {
		return fmt.Errorf("ingest metadata has no RX timestamp")
	}
	if !bytes.Equal(out, frame[strip:]) {
		return fmt.Errorf("stripped frame differs:\n  xdp % x\n  go  % x", out, frame[strip:])
	}
	return nil
}

// TestEqualToReference is the differential proof: every mix of headers, each
// frame truncated at every byte and with single bytes corrupted, against
// random rule sets.
func TestEqualToReference(t *testing.T) {
	p := newPair(t)
	const ruleSets, corruptions = 12, 40
	var stats [classifier.NumVerdicts]int
	var refused, fullStrip, shortStrip int // ingest rule matched: refused, stripped whole, stripped short
	var spreadHits [2][2]int               // by IPv6, second chance
	checked := 0
	for seed := range uint64(ruleSets) {
		rng := rand.New(rand.NewPCG(seed, 0xfab))
		rs := framegen.RandomRuleSet(rng)
		if err := p.install(rs); err != nil {
			t.Fatal(err)
		}
		spreadRule := map[uint32]bool{}
		for _, l := range rs.Listeners {
			spreadRule[l.ID] = l.Spread != nil
		}
		for _, spec := range framegen.AllSpecs(rng) {
			frame := spec.Build()
			variants := [][]byte{frame}
			for n := range len(frame) {
				variants = append(variants, frame[:n])
			}
			for range corruptions {
				bad := bytes.Clone(frame)
				i := rng.IntN(min(len(bad), 128))
				bad[i] = byte(rng.Uint32())
				variants = append(variants, bad)
			}
			for _, f := range variants {
				v, err := p.compare(f)
				if err != nil {
					t.Fatalf("seed %d, %v, frame (%d bytes) % x:\n%v\nrules: %+v", seed, spec, len(f), f, err, rs)
				}
				stats[v]++
				checked++
				switch m := p.ref.Classify(f); {
				case v == classifier.VerdictSteer && spreadRule[m.RuleID]:
					spreadHits[b2i(m.Flags&classifier.FlagIPv6 != 0)][b2i(m.Flags&classifier.FlagSecondChance != 0)]++
				case v == classifier.VerdictMalformed && m.RuleID != 0:
					refused++
				case v == classifier.VerdictIngest:
					if im, _, _ := classifier.Ingest(f, &m); im.PayloadOffset == 0 {
						fullStrip++
					} else {
						shortStrip++
					}
				}
			}
		}
	}
	t.Logf("%d frames agreed; by verdict: %v; ingest refused %d, stripped whole %d, short %d; spread hits [v4, v6][plain, second chance] %v",
		checked, stats, refused, fullStrip, shortStrip, spreadHits)
	// The generator must reach every verdict, or the proof proves less
	// than it claims.
	for v, n := range stats {
		if n == 0 {
			t.Errorf("no frame reached verdict %v", classifier.Verdict(v))
		}
	}
	if refused == 0 || fullStrip == 0 || shortStrip == 0 {
		t.Errorf("ingest paths not all reached: refused %d, stripped whole %d, short %d", refused, fullStrip, shortStrip)
	}
	for _, n := range spreadHits {
		if n[0] == 0 || n[1] == 0 {
			t.Errorf("spread paths not all reached: [v4, v6][plain, second chance] %v", spreadHits)
			break
		}
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
