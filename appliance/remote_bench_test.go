package appliance

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// BenchmarkRemoteGoodput: HTTP downloads by the outside kernel from an
// application on a user-space stack, served once by a local application
// (shared-memory stream) and once by a remote one (its own namespace, TCP
// control, GENEVE served by the bridge directly), and, as the baseline, by
// the bridge host's own kernel on a port no application claims, in the
// same run on the same topology; reports the three rates, remote/local and
// remote/kernel. (fabric's BenchmarkRemoteBridgeGoodput compares the
// direct shape with the relayed one it replaced.)
//
//	FB_REQUIRE_PRIVILEGED=1 go test -run '^$' -bench BenchmarkRemoteGoodput -benchtime 1x ./appliance
func BenchmarkRemoteGoodput(b *testing.B) {
	tp := newTopo(b)
	appNS := topology.New(b)
	link := topology.Connect(b, tp.bridge, appNS, topology.VethOptions{MTU: 1600})
	ctl := netip.AddrPortFrom(link.A.Addr4.Addr(), 7070)
	sf := filepath.Join(tp.dir, "far.secret")
	if err := os.WriteFile(sf, []byte("0123456789abcdef-far-away"), 0o600); err != nil {
		b.Fatal(err)
	}
	cfg := tp.config(b, fmt.Sprintf("applications:\n  - {name: far, secret_file: %s}\n", sf),
		fmt.Sprintf("  tcp: {address: %q, auth: secret}\n", ctl))
	var d *Daemon
	if err := tp.bridge.Do(func() (err error) { d, err = Start(cfg, Options{Log: io.Discard}); return err }); err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	local, err := userstack.Open(ctx, userstack.Options{App: "near", Control: cfg.Control.Socket})
	if err != nil {
		b.Fatal(err)
	}
	defer local.Close()
	var remote *userstack.Stack
	if err := appNS.Do(func() (err error) {
		remote, err = userstack.Open(ctx, userstack.Options{App: "far",
			Remote: &userstack.RemoteOptions{Control: ctl.String(), Secret: []byte("0123456789abcdef-far-away")}})
		return err
	}); err != nil {
		b.Fatal(err)
	}
	defer remote.Close()
	chunk := make([]byte, 64<<10)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		w.Header().Set("Content-Length", strconv.Itoa(n))
		for n > 0 {
			k, err := w.Write(chunk[:min(n, len(chunk))])
			if err != nil {
				return
			}
			n -= k
		}
	})
	for port, st := range map[string]*userstack.Stack{":8001": local, ":8002": remote} {
		ln, err := st.Listen("tcp", port)
		if err != nil {
			b.Fatal(err)
		}
		defer ln.Close()
		go http.Serve(ln, handler)
	}
	client := &http.Client{Transport: &http.Transport{DisableCompression: true,
		DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
			err = tp.outside.Do(func() (err error) { c, err = (&net.Dialer{}).DialContext(ctx, network, a); return err })
			return c, err
		}}}
	const size = 64 << 20
	fetch := func(port uint16) float64 {
		start := time.Now()
		resp, err := client.Get(fmt.Sprintf("http://%s/?n=%d", netip.AddrPortFrom(tp.v.A.Addr4.Addr(), port), size))
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || n != size {
			b.Fatalf("port %d: %d bytes, %v", port, n, err)
		}
		return float64(n) * 8 / time.Since(start).Seconds() / 1e9
	}
	var kl net.Listener
	if err := tp.bridge.Do(func() (err error) {
		kl, err = net.Listen("tcp", netip.AddrPortFrom(tp.v.A.Addr4.Addr(), 8003).String())
		return err
	}); err != nil {
		b.Fatal(err)
	}
	defer kl.Close()
	go http.Serve(kl, handler)
	fetch(8001) // warm up every path (neighbours, windows)
	fetch(8002)
	fetch(8003)
	b.ResetTimer()
	var l, r, k float64
	for range b.N {
		l += fetch(8001)
		r += fetch(8002)
		k += fetch(8003)
	}
	b.StopTimer()
	b.ReportMetric(l/float64(b.N), "local-Gbit/s")
	b.ReportMetric(r/float64(b.N), "remote-Gbit/s")
	b.ReportMetric(k/float64(b.N), "kernel-Gbit/s")
	b.ReportMetric(r/l, "remote/local")
	b.ReportMetric(r/k, "remote/kernel")
}
