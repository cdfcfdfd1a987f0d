package ebpf

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// TestIngestUnboundPassesWhole runs the program as shipped (no test hooks):
// an ingest datagram with no ingest socket on its queue must reach the
// kernel exactly as it arrived — not stripped, no metadata — and count as a
// failed redirect, while refused ingest frames count as malformed.
func TestIngestUnboundPassesWhole(t *testing.T) {
	testenv.RequirePrivileged(t)
	p, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	tables, err := classifier.Compile(&classifier.RuleSet{Rules: []classifier.Rule{
		{ID: 7, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(9000), Action: classifier.ActionIngest, Stream: 3},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Update(tables); err != nil {
		t.Fatal(err)
	}
	src, dst := netip.MustParseAddr("198.18.0.2"), netip.MustParseAddr("198.18.0.1")
	whole := framegen.Spec{L3: 4, L4: layers.IPProtocolUDP, Src: src, Dst: dst, SrcPort: 5000, DstPort: 9000, Payload: 200}.Build()
	frag := framegen.Spec{L3: 4, L4: layers.IPProtocolUDP, Src: src, Dst: dst, SrcPort: 5000, DstPort: 9000, Payload: 200, Frag: 1, FragID: 9}.Build()

	before, err := p.Counters()
	if err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 4096)
	for _, f := range [][]byte{whole, frag} {
		var ctxOut xdpMD
		opts := ebpf.RunOptions{Data: f, DataOut: out, Context: xdpMD{DataEnd: uint32(len(f))}, ContextOut: &ctxOut, Repeat: 1}
		action, err := p.Program().Run(&opts)
		if err != nil {
			t.Fatal(err)
		}
		if action != xdpPass || ctxOut.Data != ctxOut.DataMeta || !bytes.Equal(opts.DataOut, f) {
			t.Errorf("action %d, %d metadata bytes, frame changed: %v", action, ctxOut.Data-ctxOut.DataMeta, !bytes.Equal(opts.DataOut, f))
		}
	}
	after, err := p.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if n := after.Verdicts[classifier.VerdictIngest].Packets - before.Verdicts[classifier.VerdictIngest].Packets; n != 1 {
		t.Errorf("%d ingest verdicts, want 1", n)
	}
	if n := after.Verdicts[classifier.VerdictMalformed].Packets - before.Verdicts[classifier.VerdictMalformed].Packets; n != 1 {
		t.Errorf("%d malformed verdicts (the fragment), want 1", n)
	}
	if n := after.RedirectFailed - before.RedirectFailed; n != 1 {
		t.Errorf("%d failed redirects, want 1", n)
	}
	if after.StripFailed != 0 || after.MetaFailed != 0 {
		t.Errorf("strip failed %d, meta failed %d", after.StripFailed, after.MetaFailed)
	}
	if c, err := p.RuleCounter(7); err != nil || c.Packets != 2 {
		t.Errorf("rule 7 counted %+v (%v), want both frames", c, err)
	}
}
