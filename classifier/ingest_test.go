package classifier_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
)

var (
	udp      = layers.IPProtocolUDP
	source6  = netip.MustParseAddr("2001:db8::9")
	local6   = netip.MustParseAddr("2001:db8::1")
	ingestRS = &classifier.RuleSet{Rules: []classifier.Rule{
		{ID: ingestRule, Protocol: classifier.ProtoUDP, DstPorts: classifier.PortRange{Lo: 9000, Hi: 9003}, Action: classifier.ActionIngest, Stream: 10},
	}}
)

const ingestRule = 300

// TestIngestStrips checks the record and strip length for IPv4 and IPv6
// (with VLAN tags and extension headers), long and short payloads.
func TestIngestStrips(t *testing.T) {
	for _, c := range []struct {
		name    string
		spec    framegen.Spec
		hdr     int // bytes from the frame's start to the payload
		payload int
	}{
		{"ipv4", framegen.Spec{L3: 4, L4: udp, Src: remote, Dst: local, SrcPort: 7001, DstPort: 9001, Payload: 100}, 42, 100},
		{"ipv4 options, qinq", framegen.Spec{L3: 4, V4Opts: true, Tags: []layers.EthernetType{layers.EthernetTypeQinQ, layers.EthernetTypeDot1Q}, L4: udp, Src: remote, Dst: local, SrcPort: 7001, DstPort: 9000, Payload: 33}, 42 + 8 + 8, 33},
		{"ipv6 extension headers", framegen.Spec{L3: 6, Ext: []uint8{0, 60}, L4: udp, Src: source6, Dst: local6, SrcPort: 7002, DstPort: 9003, Payload: 64}, 14 + 40 + 8 + 16 + 8, 64},
		{"short payload keeps header bytes", framegen.Spec{L3: 4, L4: udp, Src: remote, Dst: local, SrcPort: 7001, DstPort: 9002, Payload: 5}, 42, 5},
		{"empty payload", framegen.Spec{L3: 6, L4: udp, Src: source6, Dst: local6, SrcPort: 7001, DstPort: 9002}, 62, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			frame := c.spec.Build()
			m := classify(t, ingestRS, frame)
			if m.Verdict != classifier.VerdictIngest || m.StreamID != 10 || m.RuleID != ingestRule {
				t.Fatalf("classified %+v, want ingest into 10 under rule %d", m, ingestRule)
			}
			im, strip, ok := classifier.Ingest(frame, &m)
			if !ok {
				t.Fatal("Ingest refused an ingest frame")
			}
			wantStrip := min(c.hdr, len(frame)-classifier.MinStrippedFrame)
			if strip != wantStrip || int(im.PayloadOffset) != c.hdr-strip {
				t.Fatalf("strip %d offset %d, want strip %d offset %d", strip, im.PayloadOffset, wantStrip, c.hdr-wantStrip)
			}
			rest := frame[strip:]
			if len(rest) < classifier.MinStrippedFrame {
				t.Fatalf("%d bytes left after stripping", len(rest))
			}
			payload := rest[im.PayloadOffset : int(im.PayloadOffset)+int(im.PayloadLen)]
			if int(im.PayloadLen) != c.payload || !bytes.Equal(payload, frame[c.hdr:c.hdr+c.payload]) {
				t.Fatalf("payload % x (len %d), want %d bytes from offset %d", payload, im.PayloadLen, c.payload, c.hdr)
			}
			wantSrc := c.spec.Src
			if im.SrcAddr() != wantSrc || im.SrcPort != c.spec.SrcPort || im.DstPort != c.spec.DstPort {
				t.Errorf("source %v:%d to port %d, want %v:%d to %d", im.SrcAddr(), im.SrcPort, im.DstPort, wantSrc, c.spec.SrcPort, c.spec.DstPort)
			}
			if wantSrc.Is4() && netip.AddrFrom16(im.Src) != netip.AddrFrom16(wantSrc.As16()) {
				t.Errorf("IPv4 source stored as % x, want IPv4-mapped", im.Src)
			}
			if (im.Flags&classifier.FlagIPv6 != 0) != wantSrc.Is6() || im.Verdict != classifier.VerdictIngest || im.BufferID != 10 || im.RuleID != ingestRule {
				t.Errorf("record %+v", im)
			}
		})
	}
}

// TestIngestRefuses: fragments and datagrams whose UDP length disagrees
// with the IP payload are malformed, keep the rule id and lose the buffer.
func TestIngestRefuses(t *testing.T) {
	whole := framegen.Spec{L3: 4, L4: udp, Src: remote, Dst: local, SrcPort: 7001, DstPort: 9001, Payload: 40}
	first := whole
	first.Frag, first.FragID = 1, 5
	later := first
	later.Frag = 2
	first6 := framegen.Spec{L3: 6, L4: udp, Src: source6, Dst: local6, SrcPort: 7001, DstPort: 9001, Payload: 40, Frag: 1, FragID: 6}
	later6 := first6
	later6.Frag = 2
	setULen := func(b []byte, l4 int, n uint16) []byte {
		c := bytes.Clone(b)
		binary.BigEndian.PutUint16(c[l4+4:], n)
		return c
	}
	good := whole.Build()
	tables, err := classifier.Compile(ingestRS)
	if err != nil {
		t.Fatal(err)
	}
	c := classifier.New(tables, 0)
	for _, f := range []struct {
		name  string
		frame []byte
		want  classifier.Verdict
		rule  uint32 // malformed before any lookup: 0
	}{
		{"whole", good, classifier.VerdictIngest, ingestRule},
		{"udp length short of the ip payload", setULen(good, 34, 8+39), classifier.VerdictMalformed, ingestRule},
		{"udp length beyond the ip payload", setULen(good, 34, 8+41), classifier.VerdictMalformed, 0},
		{"ipv4 first fragment", first.Build(), classifier.VerdictMalformed, ingestRule},
		{"ipv4 later fragment of a refused first", later.Build(), classifier.VerdictMalformed, ingestRule},
		{"ipv6 first fragment", first6.Build(), classifier.VerdictMalformed, ingestRule},
		{"ipv6 later fragment of a refused first", later6.Build(), classifier.VerdictMalformed, ingestRule},
		{"truncated", good[:40], classifier.VerdictMalformed, 0},
	} {
		m := c.Classify(f.frame)
		if m.Verdict != f.want || m.StreamID != map[bool]uint32{true: 10}[f.want == classifier.VerdictIngest] {
			t.Errorf("%s: %+v, want %v", f.name, m, f.want)
			continue
		}
		if m.RuleID != f.rule {
			t.Errorf("%s: rule %d, want %d", f.name, m.RuleID, f.rule)
		}
		if _, _, ok := classifier.Ingest(f.frame, &m); ok != (f.want == classifier.VerdictIngest) {
			t.Errorf("%s: Ingest ok=%v", f.name, ok)
		}
	}
}

// TestIngestMetaBytes pins the byte layout the XDP program writes and the
// round trip through UnmarshalIngestMeta; the verdict is the last byte but one,
// where Meta keeps it too.
func TestIngestMetaBytes(t *testing.T) {
	m := classifier.IngestMeta{RxTimestampNs: 0x0102030405060708, BufferID: 9, RuleID: 11, SrcPort: 12, DstPort: 13,
		PayloadLen: 14, PayloadOffset: 15, Verdict: classifier.VerdictIngest, Flags: classifier.FlagIPv6}
	for i := range m.Src {
		m.Src[i] = byte(0xa0 + i)
	}
	var b [classifier.IngestMetaSize]byte
	m.MarshalTo(b[:])
	if got := classifier.UnmarshalIngestMeta(b[:]); got != m {
		t.Fatalf("round trip: %+v, want %+v", got, m)
	}
	ne := binary.NativeEndian
	if ne.Uint64(b[0:]) != m.RxTimestampNs || b[8] != 0xa0 || b[23] != 0xaf || ne.Uint32(b[24:]) != 9 ||
		ne.Uint16(b[28:]) != 11 || ne.Uint16(b[34:]) != 14 || b[36] != 15 || b[37] != 0 {
		t.Errorf("layout: % x", b)
	}
	var sm [classifier.MetaSize]byte
	(&classifier.Meta{Verdict: classifier.VerdictSteer}).MarshalTo(sm[:])
	if b[classifier.IngestMetaSize-2] != byte(classifier.VerdictIngest) || sm[classifier.MetaSize-2] != byte(classifier.VerdictSteer) {
		t.Errorf("the verdict is not the last byte but one of both layouts")
	}
}

func TestIngestNoAllocations(t *testing.T) {
	frame := framegen.Spec{L3: 6, L4: udp, Src: source6, Dst: local6, SrcPort: 7001, DstPort: 9001, Payload: 300}.Build()
	tables, err := classifier.Compile(ingestRS)
	if err != nil {
		t.Fatal(err)
	}
	c := classifier.New(tables, 0)
	var sink classifier.IngestMeta
	allocs := testing.AllocsPerRun(100, func() {
		m := c.Classify(frame)
		sink, _, _ = classifier.Ingest(frame, &m)
	})
	if allocs != 0 || sink.PayloadLen != 300 {
		t.Errorf("%v allocations (payload %d)", allocs, sink.PayloadLen)
	}
}
