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
	"sync"
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
// registered and listening, a client in the router's namespace reaches the
// application through the route, and `fabricbridge drain` withdraws the
// route while the box stays up and peered.
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

	path := writeBoxConfig(t, v, service)
	const metricsAddr = boxMetrics
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
	waitMetric(t, bns, metricsAddr, d, func(s []metrics.Sample) bool {
		up := func(kind string) bool {
			x := metrics.Find(s, "fabricbridge_bgp_session_up", metrics.L("neighbor", v.A.Addr4.Addr().String(), "kind", kind)...)
			return len(x) == 1 && x[0].Value == 1
		}
		return announced(0)(s) && up("bgp") && up("bfd")
	})
	time.Sleep(300 * time.Millisecond)
	if hops := r.NextHops(t, service); len(hops) != 0 {
		t.Fatalf("announced with no application registered: next hops %v", hops)
	}

	none := map[netip.Addr][]netip.Addr{service: nil}
	box := map[netip.Addr][]netip.Addr{service: {v.B.Addr4.Addr()}}
	app := startDaemon(t, bns, "app", "http", "--config", path, "--size", "5")
	r.WaitHops(t, 5*time.Second, "an application registered: announced", box)
	waitMetric(t, bns, metricsAddr, d, announced(1))
	client := newClient(rns)
	if _, err := client.get("http://"+service.String()+"/", map[int]string{5: "box"}); err != nil {
		t.Fatalf("GET through the router: %v", err)
	}

	// The lease ends with the application: nothing left to serve.
	app.signal(t, syscall.SIGKILL)
	app.wait(t)
	r.WaitHops(t, 2*time.Second, "the application died: withdrawn", none)
	startDaemon(t, bns, "app", "http", "--config", path)
	r.WaitHops(t, 5*time.Second, "an application registered again", box)

	// fabricbridge drain: withdrawn by an UPDATE, the session up, the box
	// still serving, until it is stopped.
	drain := startDaemon(t, bns, "drain", "--config", path)
	if err := drain.wait(t); err != nil {
		t.Fatalf("drain: %v\n%s", err, drain.out.String())
	}
	if hops := r.NextHops(t, service); len(hops) != 0 {
		t.Fatalf("drain returned with the route still there: %v", hops)
	}
	if !r.Established(t, "box4") || !xdpOn(bns, v.B.Name) {
		t.Fatal("drain closed the session or detached the data plane")
	}
	waitMetric(t, bns, metricsAddr, d, announced(0))
	time.Sleep(300 * time.Millisecond)
	if hops := r.NextHops(t, service); len(hops) != 0 {
		t.Fatalf("announced again after drain, the application still registered: %v", hops)
	}
	d.signal(t, syscall.SIGTERM)
	if err := d.wait(t); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, d.out.String())
	}
	if xdpOn(bns, v.B.Name) {
		t.Error("XDP still attached after SIGTERM")
	}
}

// TestECMPOverTwoBoxes puts a client behind the router and two announcing
// boxes in front of it, each with its own instance of the application (they
// answer with bodies of different lengths, which tells the client who
// served it). New connections spread over both boxes; SIGTERM withdraws a
// box while it still serves; after a box stopped with SIGTERM or hung has
// been withdrawn, every new connection succeeds.
func TestECMPOverTwoBoxes(t *testing.T) {
	testenv.RequirePrivileged(t)
	bird := birdtest.Require(t)
	service := netip.MustParseAddr("198.18.200.1")
	rns, cns, ans, bns := topology.New(t), topology.New(t), topology.New(t), topology.New(t)
	lc := topology.Connect(t, cns, rns, topology.VethOptions{})
	la := topology.Connect(t, rns, ans, topology.VethOptions{})
	lb := topology.Connect(t, rns, bns, topology.VethOptions{})
	ctx := context.Background()
	// The client's kernel leaves TCP checksums to a NIC the veth does not
	// have; the applications' stacks want them whole.
	if err := ethtool.DisableTxChecksum(cns, lc.A.Name); err != nil {
		t.Fatal(err)
	}
	if _, err := cns.Exec(ctx, "ip", "route", "add", service.String()+"/32", "via", lc.B.Addr4.Addr().String()); err != nil {
		t.Fatal(err)
	}
	r := birdtest.Start(t, bird, rns, birdtest.Config{
		RouterID: la.A.Addr4.Addr(), ASN: 65000,
		Peers: []birdtest.Peer{
			{Name: "a", Addr4: la.B.Addr4.Addr(), ASN: 65001},
			{Name: "b", Addr4: lb.B.Addr4.Addr(), ASN: 65001},
		},
		BFDInterval: 100 * time.Millisecond, BFDMultiplier: 5,
	})
	boxes := map[int]string{} // body length -> box
	var daemons []*daemonProc
	for i, box := range []struct {
		name string
		ns   *topology.NS
		link *topology.Veth
	}{{"a", ans, la}, {"b", bns, lb}} {
		for _, c := range [][]string{
			{"ip", "addr", "add", service.String() + "/32", "dev", "lo"},
			{"ip", "route", "add", lc.A.Addr4.Masked().String(), "via", box.link.A.Addr4.Addr().String()},
		} {
			if _, err := box.ns.Exec(ctx, c[0], c[1:]...); err != nil {
				t.Fatal(err)
			}
		}
		path := writeBoxConfig(t, box.link, service)
		d := startDaemon(t, box.ns, "run", "--config", path)
		daemons = append(daemons, d)
		waitMetric(t, box.ns, boxMetrics, d, func(s []metrics.Sample) bool { return len(s) > 0 }) // the control socket is there
		size := 5 + i
		boxes[size] = box.name
		startDaemon(t, box.ns, "app", "http", "--config", path, "--size", fmt.Sprint(size))
	}
	r.WaitHops(t, 30*time.Second, "both boxes serve: ECMP over both",
		map[netip.Addr][]netip.Addr{service: {la.B.Addr4.Addr(), lb.B.Addr4.Addr()}})

	client := newClient(cns)
	defer client.CloseIdleConnections()
	url := "http://" + service.String() + "/"
	const n = 200
	served := map[string]int{}
	for range n {
		box, err := client.get(url, boxes)
		if err != nil {
			t.Fatal(err)
		}
		served[box]++
	}
	t.Logf("%d connections: box a %d, box b %d (ideal %d each)", n, served["a"], served["b"], n/2)
	for _, box := range []string{"a", "b"} {
		if served[box] < n*3/10 {
			t.Errorf("box %s served %d of %d connections; ECMP does not spread them", box, served[box], n)
		}
	}

	// Under load, box b leaves gracefully: SIGTERM withdraws, serves the
	// connections in flight for withdraw_delay, then stops. New connections
	// after the withdrawal must all succeed. Connections in flight at the
	// moment of the withdrawal may not: the router now sends their packets
	// to box a, whose instance never heard of them. Keeping those needs
	// every instance registered with every box, so that box a steers them
	// to box b's instance (docs/scale-out.md); until then they are counted.
	l := startLoad(client, url, boxes)
	time.Sleep(500 * time.Millisecond)
	daemons[1].signal(t, syscall.SIGTERM)
	term := time.Now()
	r.WaitHops(t, 3*time.Second, "box b stopping: withdrawn", map[netip.Addr][]netip.Addr{service: {la.B.Addr4.Addr()}})
	withdrawn := time.Now()
	// Withdrawn by an UPDATE while box b still serves: the session is up
	// and the data plane attached for withdraw_delay yet.
	if !r.Established(t, "b4") || !xdpOn(bns, lb.B.Name) {
		t.Error("box b closed its session or detached before its route was withdrawn")
	}
	if err := daemons[1].wait(t); err != nil {
		t.Errorf("box b after SIGTERM: %v\n%s", err, daemons[1].out.String())
	}
	exited := time.Now()
	time.Sleep(time.Second)
	res := l.stop()
	t.Logf("under load, box b stopped: withdrawn %v after SIGTERM, exited %v after; %s",
		withdrawn.Sub(term).Round(time.Millisecond), exited.Sub(term).Round(time.Millisecond), res.summary(withdrawn))
	if f := res.failed(withdrawn); f != 0 {
		t.Errorf("%d connections opened after the withdrawal failed; last: %v", f, res.lastErr)
	}
	if res.servedBy("b", time.Time{}) == 0 || res.servedBy("a", exited) == 0 {
		t.Errorf("the load did not cover the change: %s", res.summary(exited))
	}

	// Box b comes back; then box a hangs (SIGSTOP: its kernel still
	// ACKs the BGP session, the data plane stops): BFD takes it out and
	// new connections are served by b again within a second.
	path := writeBoxConfig(t, lb, service)
	d := startDaemon(t, bns, "run", "--config", path)
	waitMetric(t, bns, boxMetrics, d, func(s []metrics.Sample) bool { return len(s) > 0 })
	startDaemon(t, bns, "app", "http", "--config", path, "--size", "6")
	r.WaitHops(t, 30*time.Second, "box b back: ECMP over both",
		map[netip.Addr][]netip.Addr{service: {la.B.Addr4.Addr(), lb.B.Addr4.Addr()}})
	l = startLoad(client, url, boxes)
	time.Sleep(500 * time.Millisecond)
	daemons[0].signal(t, syscall.SIGSTOP)
	hung := time.Now()
	r.WaitHops(t, 1500*time.Millisecond, "box a hung: BFD takes it out",
		map[netip.Addr][]netip.Addr{service: {lb.B.Addr4.Addr()}})
	withdrawn = time.Now()
	time.Sleep(time.Second)
	res = l.stop()
	daemons[0].signal(t, syscall.SIGKILL)
	t.Logf("under load, box a hung: withdrawn %v later; %s", withdrawn.Sub(hung).Round(time.Millisecond), res.summary(withdrawn))
	if f := res.failed(withdrawn); f != 0 {
		t.Errorf("%d connections opened after the withdrawal failed; last: %v", f, res.lastErr)
	}
	if res.servedBy("b", withdrawn) == 0 {
		t.Errorf("nothing served after the withdrawal: %s", res.summary(withdrawn))
	}
}

// load keeps four clients opening connections until stop.
type load struct {
	stopc chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	res   loadResult
}

type loadResult struct {
	requests []request
	lastErr  error
}

type request struct {
	start time.Time
	box   string // "" if it failed
}

func startLoad(c nsClient, url string, boxes map[int]string) *load {
	l := &load{stopc: make(chan struct{})}
	for range 4 {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for {
				select {
				case <-l.stopc:
					return
				default:
				}
				start := time.Now()
				box, err := c.get(url, boxes)
				l.mu.Lock()
				l.res.requests = append(l.res.requests, request{start, box})
				if err != nil {
					l.res.lastErr = err
				}
				l.mu.Unlock()
			}
		}()
	}
	return l
}

func (l *load) stop() loadResult {
	close(l.stopc)
	l.wg.Wait()
	return l.res
}

// failed counts the requests started after since that failed.
func (r loadResult) failed(since time.Time) int { return r.servedBy("", since) }

// servedBy counts the requests started after since that box served.
func (r loadResult) servedBy(box string, since time.Time) int {
	n := 0
	for _, q := range r.requests {
		if q.box == box && q.start.After(since) {
			n++
		}
	}
	return n
}

func (r loadResult) summary(mark time.Time) string {
	return fmt.Sprintf("%d requests: a %d (%d after the event), b %d (%d after), failed %d (%d after; last error %v)",
		len(r.requests), r.servedBy("a", time.Time{}), r.servedBy("a", mark), r.servedBy("b", time.Time{}), r.servedBy("b", mark),
		r.failed(time.Time{}), r.failed(mark), r.lastErr)
}

// writeBoxConfig writes the configuration of a box on link (its end B),
// peering with the router at link's end A and announcing service.
func writeBoxConfig(t *testing.T, link *topology.Veth, service netip.Addr) string {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "fb.yaml")
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
`, link.B.Name, service, link.B.Addr4.Addr(), filepath.Join(dir, "control.sock"), boxMetrics,
		link.B.Addr4.Addr(), link.A.Addr4.Addr(), service)
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// boxMetrics is where a box serves /metrics, inside its namespace.
const boxMetrics = "127.0.0.1:9469"

// nsClient is an HTTP client whose connections are opened in a namespace,
// one per request, so that every request is a new flow for ECMP to place.
type nsClient struct{ *http.Client }

func newClient(ns *topology.NS) nsClient {
	tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
		err = ns.Do(func() (err error) {
			c, err = (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, network, a)
			return err
		})
		return c, err
	}}
	return nsClient{&http.Client{Transport: tr, Timeout: 5 * time.Second}}
}

// get fetches url and names the box that answered by the body's length.
func (c nsClient) get(url string, boxes map[int]string) (string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK || boxes[len(body)] == "" {
		return "", fmt.Errorf("GET %s: %s, %d bytes", url, resp.Status, len(body))
	}
	return boxes[len(body)], nil
}
