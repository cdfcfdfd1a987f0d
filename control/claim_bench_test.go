package control

import (
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// noopPlane is a Dataplane that accepts everything and keeps nothing: what
// is left of a claim's cost is the registry's own.
type noopPlane struct{}

func (noopPlane) AddStream(uint32, *fabric.BridgeStream, classifier.Ownership) error { return nil }
func (noopPlane) AddRemoteStream(uint32, *fabric.RemoteStream, classifier.Ownership) error {
	return nil
}
func (noopPlane) SetOwnership(uint32, classifier.Ownership) error  { return nil }
func (noopPlane) RemoveStream(uint32) error                        { return nil }
func (noopPlane) SetTables(*classifier.Tables) error               { return nil }
func (noopPlane) AddFlows([]classifier.Flow) error                 { return nil }
func (noopPlane) RemoveFlows([]classifier.Flow) error              { return nil }
func (noopPlane) OwnPort(uint32, classifier.PortClaim, bool) error { return nil }

// realPlane adapts a real bridge to Dataplane, as the daemon does.
type realPlane struct{ b *bridge.Bridge }

func (p realPlane) AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error {
	return p.b.AddStream(id, s, own)
}
func (p realPlane) AddRemoteStream(uint32, *fabric.RemoteStream, classifier.Ownership) error {
	return fmt.Errorf("%w: no remote streams here", ErrInternal)
}
func (p realPlane) SetOwnership(id uint32, own classifier.Ownership) error {
	return p.b.SetOwnership(id, own)
}
func (p realPlane) RemoveStream(id uint32) error              { return p.b.RemoveStream(id) }
func (p realPlane) SetTables(t *classifier.Tables) error      { return p.b.SetTables(t) }
func (p realPlane) AddFlows(flows []classifier.Flow) error    { return p.b.AddFlows(flows) }
func (p realPlane) RemoveFlows(flows []classifier.Flow) error { return p.b.RemoveFlows(flows) }
func (p realPlane) OwnPort(id uint32, pc classifier.PortClaim, own bool) error {
	return p.b.OwnPort(id, pc, own)
}

var _ FlowDataplane = realPlane{}

// openRealPlane opens a bridge on one end of a fresh veth pair, on path
// (bridge.PathAuto: XDP; bridge.PathAFPacket: the nftables path).
func openRealPlane(tb testing.TB, path bridge.Path) realPlane {
	tb.Helper()
	capacity := fbebpf.DefaultFlowCapacity
	for _, n := range benchSizes(tb) {
		for capacity < n+n/4 {
			capacity *= 2
		}
	}
	return openRealPlaneSized(tb, path, capacity)
}

// openRealPlaneSized is openRealPlane with an XDP flow table of capacity
// flows.
func openRealPlaneSized(tb testing.TB, path bridge.Path, capacity int) realPlane {
	tb.Helper()
	testenv.RequirePrivileged(tb)
	br, _, v := topology.Pair(tb, topology.VethOptions{})
	cfg := bridge.Config{Interface: v.A.Name, Path: path, FrameCount: 256, FlowCapacity: capacity,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))}
	if path != bridge.PathAuto {
		cfg.Mode = bridge.ModeStrict
	}
	var b *bridge.Bridge
	if err := br.Do(func() (err error) { b, err = bridge.Open(cfg); return err }); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return realPlane{b}
}

// benchLocal is the address the benchmark's applications connect from.
var benchLocal = netip.MustParseAddr("198.18.0.1")

// benchRemote is the i-th distinct remote end: addresses of 198.19.0.0/16,
// then ports, so that flows stay distinct far beyond the port range.
func benchRemote(i int) netip.AddrPort {
	a := netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)})
	return netip.AddrPortFrom(a, uint16(1000+i>>16))
}

// benchRegistry is a registry over dp with apps applications registered
// (each with a stream when dp is a real bridge).
func benchRegistry(tb testing.TB, dp Dataplane, apps int) (*registry, []*app) {
	tb.Helper()
	r, err := newRegistry(dp, classifier.PortRange{Lo: 10000, Hi: 65000}, 1000, Static{}, SpreadConfig{}, slog.Default())
	if err != nil {
		tb.Fatal(err)
	}
	pol := Policy{Addrs: []netip.Addr{benchLocal}, MaxFlows: 1 << 22}
	var out []*app
	for i := range apps {
		a, err := r.register(fmt.Sprintf("app%d", i), "", "", pol, 0, func(id uint32, own classifier.Ownership) error {
			if _, real := dp.(realPlane); !real {
				return dp.AddStream(id, nil, own)
			}
			bs, as, err := fabric.NewPair(fabric.Config{RxSlots: 2, TxSlots: 2, SlotSize: 2048})
			if err != nil {
				return err
			}
			tb.Cleanup(func() { bs.Close(); as.Close() })
			return dp.AddStream(id, bs, own)
		})
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, a)
	}
	return r, out
}

// benchSizes are the numbers of flows held while a claim is measured;
// FB_CLAIM_SIZES (comma-separated) replaces them. The XDP flow table is
// sized to hold the largest.
func benchSizes(tb testing.TB) []int {
	sizes := []int{100, 10_000, 100_000}
	if s := os.Getenv("FB_CLAIM_SIZES"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(f)
			if err != nil {
				tb.Fatalf("FB_CLAIM_SIZES: %v", err)
			}
			sizes = append(sizes, n)
		}
	}
	return sizes
}

// BenchmarkClaim measures one flow claim and its release (an op is a
// connect and a release of one application) with n flows held by ten
// applications, on a data plane that does nothing (the registry's own cost)
// and on the real ones: XDP maps and the AF_PACKET path's nftables sets.
func BenchmarkClaim(b *testing.B) {
	planes := []struct {
		name string
		open func(testing.TB) Dataplane
	}{
		{"noop", func(testing.TB) Dataplane { return noopPlane{} }},
		{"xdp", func(tb testing.TB) Dataplane { return openRealPlane(tb, bridge.PathAuto) }},
		{"afpacket", func(tb testing.TB) Dataplane { return openRealPlane(tb, bridge.PathAFPacket) }},
	}
	for _, pl := range planes {
		for _, n := range benchSizes(b) {
			b.Run(fmt.Sprintf("plane=%s/flows=%d", pl.name, n), func(b *testing.B) {
				r, apps := benchRegistry(b, pl.open(b), 10)
				fillFlows(b, r, apps, n)
				b.ReportAllocs()
				b.ResetTimer()
				claimLoop(b, r, apps[0], benchRemote(n+1))
			})
		}
	}
}

// claimLoop is the benchmark's op: a's claim of a flow to remote and its
// release.
func claimLoop(b *testing.B, r *registry, a *app, remote netip.AddrPort) {
	for b.Loop() {
		c, err := r.connect(a, classifier.ProtoTCP, benchLocal, remote)
		if err != nil {
			b.Fatal(err)
		}
		if err := r.release(a, c.id); err != nil {
			b.Fatal(err)
		}
	}
}

// fillFlows has apps hold n flows between them, to distinct remotes. The
// claims are made from many goroutines at once, so that the nftables path's
// transactions group and a fill of 100,000 takes seconds, not minutes.
func fillFlows(tb testing.TB, r *registry, apps []*app, n int) {
	tb.Helper()
	const workers = 256
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				if _, err := r.connect(apps[i%len(apps)], classifier.ProtoTCP, benchLocal, benchRemote(i)); err != nil {
					errs <- fmt.Errorf("flow %d: %v", i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		tb.Fatal(err)
	}
}
