package bridge

import (
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	ciliumebpf "github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/ippkt"
	"github.com/fabricbridge/fabricbridge/internal/netns"
	"github.com/fabricbridge/fabricbridge/internal/testenv"
)

// Benchmarks of the bridge on a veth pair, all driven by the AF_XDP TX
// generator (internal/xdpgen) from the outside namespace. Each reports
// frames per second and the ratios the issue asks for, measured in the same
// run. They ignore b.N: run them with -benchtime 1x.

// benchFrames is how many frames each measurement sends.
const benchFrames = 400_000

// dropCounter is the ceiling: an XDP program that counts and drops.
type dropCounter struct {
	prog  *ciliumebpf.Program
	count *ciliumebpf.Map
	l     link.Link
}

func newDropCounter(tb testing.TB, ns *netns.NS, ifindex int) *dropCounter {
	tb.Helper()
	m, err := ciliumebpf.NewMap(&ciliumebpf.MapSpec{Type: ciliumebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		tb.Fatal(err)
	}
	p, err := ciliumebpf.NewProgram(&ciliumebpf.ProgramSpec{Type: ciliumebpf.XDP, License: "MIT", Instructions: asm.Instructions{
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.LoadMem(asm.R1, asm.R0, 0, asm.DWord),
		asm.Add.Imm(asm.R1, 1),
		asm.StoreMem(asm.R0, 0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("out"), // XDP_DROP
		asm.Return(),
	}})
	if err != nil {
		tb.Fatal(err)
	}
	d := &dropCounter{prog: p, count: m}
	if err := ns.Do(func() (err error) {
		d.l, err = link.AttachXDP(link.XDPOptions{Program: p, Interface: ifindex, Flags: link.XDPDriverMode})
		return err
	}); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { d.l.Close(); p.Close(); m.Close() })
	return d
}

func (d *dropCounter) total() uint64 {
	var per []uint64
	if err := d.count.Lookup(uint32(0), &per); err != nil {
		return 0
	}
	var n uint64
	for _, v := range per {
		n += v
	}
	return n
}

// benchFrame is an Ethernet frame of size bytes (without FCS) carrying UDP
// to dst.
func benchFrame(v *netns.Veth, dst netip.AddrPort, size int) []byte {
	return ippkt.Ether(v.A.MAC, v.B.MAC, ippkt.UDP(netip.AddrPortFrom(v.B.Addr4.Addr(), 40000), dst, make([]byte, size-14-20-8)))
}

// reader drains an application's stream without allocating.
func reader(app *fabric.Stream, n *atomic.Uint64) {
	bufs := make([][]byte, 64)
	mem := make([]byte, 64*2048)
	for {
		for i := range bufs {
			bufs[i] = mem[i*2048 : (i+1)*2048]
		}
		k, err := app.Recv(bufs)
		n.Add(uint64(k))
		if err != nil {
			return
		}
	}
}

func rate(n uint64, d time.Duration) float64 { return float64(n) / d.Seconds() }

// BenchmarkBridgeRX: frames per second into a stream on the XDP path and
// on the AF_PACKET path, against a counting XDP_DROP program on the same
// topology (the ceiling), for 60-byte (64 on the wire) and 1514-byte frames.
func BenchmarkBridgeRX(b *testing.B) {
	testenv.RequirePrivileged(b)
	for _, size := range []int{60, 1514} {
		b.Run(fmt.Sprintf("frame=%d", size), func(b *testing.B) {
			// Ceiling.
			br, out, v := netns.Pair(b, netns.VethOptions{})
			d := newDropCounter(b, br, v.A.Index)
			frame := benchFrame(v, netip.AddrPortFrom(v.A.Addr4.Addr(), udpPort1), size)
			start := time.Now()
			sent := generate(b, out, v.B.Index, [][]byte{frame}, benchFrames)
			el := time.Since(start)
			time.Sleep(50 * time.Millisecond)
			ceiling := rate(d.total(), el)
			b.Logf("ceiling: sent %d in %v, dropped by XDP %d: %.0f frames/s (generator %.0f/s)", sent, el, d.total(), ceiling, rate(uint64(sent), el))

			got := map[string]float64{}
			for _, p := range paths {
				r := newRig(b, p.cfg)
				r.standardTables()
				app := r.stream(1, r.ownership1(), fabric.Config{RxSlots: 4096})
				var n atomic.Uint64
				go reader(app, &n)
				frame := benchFrame(r.v, netip.AddrPortFrom(r.local4, udpPort1), size)
				start := time.Now()
				sent := generate(b, r.out, r.v.B.Index, [][]byte{frame}, benchFrames)
				el := time.Since(start)
				s := r.settle()
				delivered := s.Streams[0].RxPackets
				got[p.name] = rate(delivered, el)
				b.Logf("%s (%s): sent %d in %v, into the stream %d (ring full %d, app read %d): %.0f frames/s",
					p.name, r.b.Mode(), sent, el, delivered, s.Streams[0].RxRingFull, n.Load(), got[p.name])
			}
			b.ReportMetric(ceiling, "ceiling-fps")
			b.ReportMetric(got["xdp"], "xdp-fps")
			b.ReportMetric(got["afpacket"], "afpacket-fps")
			b.ReportMetric(got["xdp"]/ceiling, "xdp/ceiling")
			b.ReportMetric(got["xdp"]/got["afpacket"], "xdp/afpacket")
		})
	}
}

// BenchmarkBridgeTX: frames per second from a stream to the wire, counted
// by an XDP_DROP program on the outside end, on the XDP path against the
// AF_PACKET path (TPACKET_V3 TX ring with qdisc bypass).
func BenchmarkBridgeTX(b *testing.B) {
	testenv.RequirePrivileged(b)
	for _, size := range []int{60, 1514} {
		b.Run(fmt.Sprintf("frame=%d", size), func(b *testing.B) {
			got := map[string]float64{}
			for _, p := range paths {
				r := newRig(b, p.cfg)
				r.standardTables()
				app := r.stream(1, r.ownership1(), fabric.Config{TxSlots: 4096})
				if _, err := r.out.Ping(r.local4, 1, 3*time.Second); err != nil {
					b.Fatal(err)
				}
				r.waitNeighbour(r.remote4)
				d := newDropCounter(b, r.out, r.v.B.Index)
				pkt := ippkt.UDP(netip.AddrPortFrom(r.local4, udpPort1), netip.AddrPortFrom(r.remote4, remotePort), make([]byte, size-14-20-8))
				batch := make([][]byte, 64)
				for i := range batch {
					batch[i] = pkt
				}
				start := time.Now()
				for sent := 0; sent < benchFrames; sent += len(batch) {
					if _, err := app.Send(batch); err != nil {
						b.Fatal(err)
					}
				}
				// Wait until the last packets are out.
				for last := uint64(0); ; {
					time.Sleep(5 * time.Millisecond)
					n := r.b.Stats().Streams[0].TxPackets
					if n == last {
						break
					}
					last = n
				}
				el := time.Since(start)
				wire := d.total()
				got[p.name] = rate(wire, el)
				s := r.b.Stats().Streams[0]
				b.Logf("%s (%s): %d packets from the stream in %v, %d sent, %d on the wire: %.0f frames/s",
					p.name, r.b.Mode(), benchFrames, el, s.TxPackets, wire, got[p.name])
			}
			b.ReportMetric(got["xdp"], "xdp-fps")
			b.ReportMetric(got["afpacket"], "afpacket-fps")
			b.ReportMetric(got["xdp"]/got["afpacket"], "xdp/afpacket")
		})
	}
}
