package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/birdtest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// TestRunAnnouncesWhileServing runs the daemon with a bgp section against
// BIRD: the service address is announced only while an application is
// registered, a client in the router's namespace reaches the application
// through the route, and SIGTERM withdraws the route while the data plane
// is still attached and the session still up, before the daemon exits.
func TestRunAnnouncesWhileServing(t *testing.T) {
	testenv.RequirePrivileged(t)
	bird := birdtest.Require(t)
	rns, bns, v := topology.Pair(t, topology.VethOptions{})
	// The router's kernel leaves TCP checksums to a NIC the veth does not
	// have; the application's stack wants them whole (as in the demo).
	if err := ethtool.DisableTxChecksum(rns, v.A.Name); err != nil {
		t.Fatal(err)
	}
	service := netip.MustParseAddr("198.18.200.1")
	if _, err := bns.Exec(context.Background(), "ip", "addr", "add", service.String()+"/32", "dev", "lo"); err != nil {
		t.Fatal(err)
	}
	r := birdtest.Start(t, bird, rns, birdtest.Config{
		RouterID: v.A.Addr4.Addr(), ASN: 65000,
		Peers:       []birdtest.Peer{{Name: "box", Addr4: v.B.Addr4.Addr(), ASN: 65001}},
		BFDInterval: 100 * time.Millisecond, BFDMultiplier: 5,
	})

	dir := t.TempDir()
	path := filepath.Join(dir, "fb.yaml")
	const metricsAddr = "127.0.0.1:9469" // inside the box's namespace
	cfg := fmt.Sprintf(`interfaces: [{name: %s}]
addresses: [%s, %s]
control: {socket: %s}
metrics: {address: %q}
bgp:
  asn: 65001
  router_id: %s
  neighbors: [{address: %s, asn: 65000}]
  announce: [%s]
  bfd: {enabled: true, interval: 100ms, multiplier: 5}
  withdraw_delay: 1s
`, v.B.Name, service, v.B.Addr4.Addr(), filepath.Join(dir, "control.sock"), metricsAddr, v.B.Addr4.Addr(), v.A.Addr4.Addr(), service)
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, bns, "run", "--config", path)
	announced := func(want float64) func([]metrics.Sample) bool {
		return func(s []metrics.Sample) bool {
			a := metrics.Find(s, "fabricbridge_bgp_announced")
			return len(a) == 1 && a[0].Value == want
		}
	}

	// Up, peered, and nothing announced: no application takes the traffic.
	deadline := time.Now().Add(30 * time.Second)
	for !r.Established(t, "box4") {
		if time.Now().After(deadline) {
			t.Fatalf("the BGP session never came up:\n%s", d.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	waitMetric(t, bns, metricsAddr, d, announced(0))
	time.Sleep(300 * time.Millisecond)
	if hops := r.NextHops(t, service); len(hops) != 0 {
		t.Fatalf("announced with no application registered: next hops %v", hops)
	}

	none := map[netip.Addr][]netip.Addr{service: nil}
	box := map[netip.Addr][]netip.Addr{service: {v.B.Addr4.Addr()}}
	app := startDaemon(t, bns, "app", "http", "--config", path, "--size", "5")
	r.WaitHops(t, 5*time.Second, "an application registered: announced", box)
	waitMetric(t, bns, metricsAddr, d, announced(1))
	if body := get(t, rns, "http://"+service.String()+"/"); len(body) != 5 {
		t.Fatalf("GET through the router: %d bytes, want 5", len(body))
	}

	// The lease ends with the application: nothing left to serve.
	app.signal(t, syscall.SIGKILL)
	app.wait(t)
	r.WaitHops(t, 2*time.Second, "the application died: withdrawn", none)
	startDaemon(t, bns, "app", "http", "--config", path)
	r.WaitHops(t, 5*time.Second, "an application registered again", box)

	// SIGTERM: withdrawn by an UPDATE while the box still serves, then the
	// daemon detaches and exits.
	d.signal(t, syscall.SIGTERM)
	term := time.Now()
	for len(r.NextHops(t, service)) != 0 {
		select {
		case err := <-d.done:
			d.done <- err
			t.Fatalf("the daemon exited before the route was withdrawn:\n%s", d.out.String())
		default:
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !xdpOn(bns, v.B.Name) {
		t.Error("the data plane was detached before the route was withdrawn")
	}
	if !r.Established(t, "box4") {
		t.Error("the route went with the session: the daemon closed it without withdrawing")
	}
	t.Logf("SIGTERM: withdrawn after %v, still attached and peered", time.Since(term).Round(time.Millisecond))
	if err := d.wait(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, d.out.String())
	}
	if xdpOn(bns, v.B.Name) {
		t.Error("XDP still attached after SIGTERM")
	}
}

// get fetches url from inside ns.
func get(t *testing.T, ns *topology.NS, url string) []byte {
	t.Helper()
	tr := &http.Transport{DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
		err = ns.Do(func() (err error) {
			c, err = (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, network, a)
			return err
		})
		return c, err
	}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s, %v", url, resp.Status, err)
	}
	return body
}
