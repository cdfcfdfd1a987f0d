package ebpf

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// The classifier's yardstick is xdp-filter (xdp-tools), a real XDP
// classifier, run on the same frame as fabricbridge's flow hit. Debian's
// libxdp1 installs its programs prebuilt; the all-features, deny-by-default
// one parses as far as fabricbridge does (Ethernet, IP, TCP/UDP) and passes
// a frame that one of its entries matches.
const xdpFilterGlob = "/usr/lib/*/bpf/xdpfilt_dny_all.o"

// xdp-filter's map values (xdp-tools, xdp-filter/common_kern_user.h): flags
// saying which fields an entry matches as, and above them a hit counter
// that the program bumps in place.
const (
	xdpFilterSrc        = 1 << 0
	xdpFilterDst        = 1 << 1
	xdpFilterTCP        = 1 << 2
	xdpFilterCountShift = 6
)

// yardstickCase is the benchmark case the goal is stated for.
const yardstickCase = "flow-hit-100k"

// xdpFilterMatch is the entry of xdp-filter that the frame matches.
type xdpFilterMatch int

const (
	// matchDstPort: the frame misses every Ethernet and address entry and
	// hits its destination port, xdp-filter's longest path and the one
	// closest to fabricbridge's, which parses to L4 before it looks up.
	matchDstPort xdpFilterMatch = iota
	// matchDstAddr: the frame hits its destination address, after
	// missing the Ethernet entries; its ports are never read.
	matchDstAddr
)

// xdpFilter is xdp-filter's program loaded with cilium/ebpf, its maps
// filled so that one entry matches the frame.
type xdpFilter struct {
	prog *ebpf.Program
	// hit is the map and key of the entry the frame matches.
	hit    *ebpf.Map
	hitKey any
}

// xdpFilterObject finds xdp-filter's object, or skips tb: it fails instead
// under FB_REQUIRE_PRIVILEGED=1, where CI installs libxdp1.
func xdpFilterObject(tb testing.TB) string {
	tb.Helper()
	paths, _ := filepath.Glob(xdpFilterGlob)
	if len(paths) == 0 {
		msg := "xdp-filter's program " + xdpFilterGlob + " is not installed (apt-get install libxdp1): no yardstick to measure against"
		if os.Getenv(testenv.RequireEnv) == "1" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	return paths[0]
}

// loadXDPFilter loads xdp-filter and fills its maps so that frame, an
// Ethernet/IPv4/TCP frame, matches the entry match says. Every map also
// holds entries that do not match, as many as its capacity allows.
func loadXDPFilter(tb testing.TB, frame []byte, match xdpFilterMatch) *xdpFilter {
	tb.Helper()
	testenv.RequirePrivileged(tb)
	spec, err := ebpf.LoadCollectionSpec(xdpFilterObject(tb))
	if err != nil {
		tb.Fatal(err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone // libxdp pins by name; the benchmark's maps are its own
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		tb.Fatalf("load xdp-filter: %v", err)
	}
	tb.Cleanup(func() { coll.Close() })
	var prog *ebpf.Program
	for _, p := range coll.Programs {
		if p.Type() == ebpf.XDP {
			prog = p
		}
	}
	if prog == nil || len(coll.Programs) != 1 {
		tb.Fatalf("xdp-filter's object holds programs %v, want one XDP program", spec.Programs)
	}
	maps := map[string]*ebpf.Map{}
	for _, name := range []string{"filter_ethernet", "filter_ipv4", "filter_ipv6", "filter_ports"} {
		if maps[name] = coll.Maps[name]; maps[name] == nil {
			tb.Fatalf("xdp-filter's object has no map %s", name)
		}
	}

	pkt := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.NoCopy)
	eth, _ := pkt.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
	ip, _ := pkt.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
	tcp, _ := pkt.Layer(layers.LayerTypeTCP).(*layers.TCP)
	if eth == nil || ip == nil || tcp == nil {
		tb.Fatal("the yardstick frame is not Ethernet/IPv4/TCP")
	}
	frameMACs := map[[6]byte]bool{[6]byte(eth.SrcMAC): true, [6]byte(eth.DstMAC): true}
	frameAddrs := map[[4]byte]bool{[4]byte(ip.SrcIP.To4()): true, [4]byte(ip.DstIP.To4()): true}

	// A per-CPU map takes one value per possible CPU; the flags go into
	// every one, as xdp-filter's own loader writes them.
	value := func(flags uint64) []uint64 {
		v := make([]uint64, ebpf.MustPossibleCPU())
		for i := range v {
			v[i] = flags
		}
		return v
	}
	put := func(name string, key any, flags uint64) {
		tb.Helper()
		if err := maps[name].Put(key, value(flags)); err != nil {
			tb.Fatalf("xdp-filter %s: put %v: %v", name, key, err)
		}
	}
	both := uint64(xdpFilterSrc | xdpFilterDst)
	for i := range int(maps["filter_ethernet"].MaxEntries()) - 1 {
		mac := [6]byte{0x02, 0, 0, 0, byte(i >> 8), byte(i)}
		if !frameMACs[mac] {
			put("filter_ethernet", mac, both)
		}
	}
	for i := range int(maps["filter_ipv4"].MaxEntries()) - 1 {
		addr := [4]byte{198, 18, byte(128 + i>>8), byte(i)}
		if !frameAddrs[addr] {
			put("filter_ipv4", addr, both)
		}
	}
	for i := range int(maps["filter_ipv6"].MaxEntries()) - 1 {
		addr := [16]byte{0x20, 0x01, 0x0d, 0xb8, 0xff, 0xff, 14: byte(i >> 8), 15: byte(i)}
		put("filter_ipv6", addr, both)
	}

	f := &xdpFilter{prog: prog}
	switch match {
	case matchDstPort:
		// The key is the port as the TCP header holds it, network
		// order, widened to 32 bits.
		port := binary.NativeEndian.Uint16(binary.BigEndian.AppendUint16(nil, uint16(tcp.DstPort)))
		f.hit, f.hitKey = maps["filter_ports"], uint32(port)
		put("filter_ports", f.hitKey, xdpFilterDst|xdpFilterTCP)
	case matchDstAddr:
		f.hit, f.hitKey = maps["filter_ipv4"], [4]byte(ip.DstIP.To4())
		put("filter_ipv4", f.hitKey, xdpFilterDst)
	}
	return f
}

// unmatch clears the matching entry's flags; an entry of the port map, an
// array, cannot be deleted.
func (f *xdpFilter) unmatch(tb testing.TB) {
	tb.Helper()
	if err := f.hit.Put(f.hitKey, make([]uint64, ebpf.MustPossibleCPU())); err != nil {
		tb.Fatal(err)
	}
}

// hits sums the hit counter of the matching entry over CPUs.
func (f *xdpFilter) hits(tb testing.TB) uint64 {
	tb.Helper()
	var per []uint64
	if err := f.hit.Lookup(f.hitKey, &per); err != nil {
		tb.Fatal(err)
	}
	var n uint64
	for _, v := range per {
		n += v >> xdpFilterCountShift
	}
	return n
}

// yardstickProgram loads fabricbridge with the tables of the yardstick
// case and returns it with the case.
func yardstickProgram(tb testing.TB) (*Program, framegen.BenchCase) {
	tb.Helper()
	testenv.RequirePrivileged(tb)
	var c framegen.BenchCase
	for _, bc := range framegen.BenchCases() {
		if bc.Name == yardstickCase {
			c = bc
		}
	}
	if c.Frame == nil {
		tb.Fatalf("framegen has no benchmark case %s", yardstickCase)
	}
	p, err := Load()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.Close() })
	t, err := classifier.Compile(c.Rules)
	if err != nil {
		tb.Fatal(err)
	}
	if err := p.Update(t); err != nil {
		tb.Fatal(err)
	}
	return p, c
}

// TestYardstickMatches proves that the yardstick measures what it claims:
// fabricbridge steers the frame, and xdp-filter passes it through the one
// entry meant to match it and drops it without that entry (its deny mode
// drops what nothing matches).
func TestYardstickMatches(t *testing.T) {
	p, c := yardstickProgram(t)
	before, err := p.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Program().Run(&ebpf.RunOptions{Data: c.Frame}); err != nil {
		t.Fatal(err)
	}
	after, err := p.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if d := after.Verdicts[classifier.VerdictSteer].Packets - before.Verdicts[classifier.VerdictSteer].Packets; d != 1 {
		t.Errorf("fabricbridge steered %d frames of 1", d)
	}

	for _, match := range []xdpFilterMatch{matchDstPort, matchDstAddr} {
		f := loadXDPFilter(t, c.Frame, match)
		ret, err := f.prog.Run(&ebpf.RunOptions{Data: c.Frame})
		if err != nil {
			t.Fatal(err)
		}
		if ret != xdpPass || f.hits(t) != 1 {
			t.Errorf("xdp-filter, match %d: returned %d with %d hits on the matching entry, want %d (pass) with 1", match, ret, f.hits(t), xdpPass)
		}
		f.unmatch(t)
		if ret, err := f.prog.Run(&ebpf.RunOptions{Data: c.Frame}); err != nil || ret != xdpDrop {
			t.Errorf("xdp-filter, match %d, without the matching entry: returned %d, %v; want %d (drop)", match, ret, err, xdpDrop)
		}
	}
}

// BenchmarkYardstick measures, in the same iterations on the same frame,
// fabricbridge's flow hit among framegen.BenchFlows flows, as loaded and
// with steered frames stamped (Program.StampSteered, while a capture
// runs), and xdp-filter matching the frame on its destination port (its
// whole parse, as fabricbridge's) and on its destination address (a
// shorter path). The goal is x-xdp-filter ≤ 1: fabricbridge's flow hit
// costs no more than xdp-filter's port match.
func BenchmarkYardstick(b *testing.B) {
	p, c := yardstickProgram(b)
	port := loadXDPFilter(b, c.Frame, matchDstPort)
	addr := loadXDPFilter(b, c.Frame, matchDstAddr)
	runs := []struct {
		metric string
		prog   *ebpf.Program
		stamp  bool // fabricbridge stamps steered frames (a capture is on)
	}{
		{"fabricbridge-ns/frame", p.Program(), false},
		{"fabricbridge-stamped-ns/frame", p.Program(), true},
		{"xdp-filter-port-ns/frame", port.prog, false},
		{"xdp-filter-addr-ns/frame", addr.prog, false},
	}
	total := make([]time.Duration, len(runs))
	n := 0
	for b.Loop() {
		for i, r := range runs {
			if err := p.StampSteered(r.stamp); err != nil {
				b.Fatal(err)
			}
			_, d, err := r.prog.Benchmark(c.Frame, benchRepeat, nil)
			if err != nil {
				b.Fatalf("%s: %v", r.metric, err)
			}
			total[i] += d
		}
		n++
	}
	for i, r := range runs {
		b.ReportMetric(float64(total[i].Nanoseconds())/float64(n), r.metric)
	}
	b.ReportMetric(float64(total[0])/float64(total[2]), "x-xdp-filter")
	b.ReportMetric(float64(total[1])/float64(total[2]), "stamped-x-xdp-filter")
	b.ReportMetric(float64(total[0])/float64(total[3]), "x-xdp-filter-addr")
}
