package appliance

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"io"
	"net/http"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/control"
)

// tableDigest is what docs/scale-out.md says the digest is, computed here
// without the control package: the first 8 bytes of SHA-256 over the seed
// (little-endian) and each sorted instance name followed by a NUL.
func tableDigest(seed uint64, sorted ...string) string {
	h := sha256.New()
	h.Write(binary.LittleEndian.AppendUint64(nil, seed))
	for _, name := range sorted {
		h.Write(append([]byte(name), 0))
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// registerInstance registers instance of application app over the
// daemon's control socket and listens on tcp port on every address.
func registerInstance(t *testing.T, d *Daemon, app, instance string, port uint16) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := control.DialLocal(ctx, d.Config().Control.Socket, app)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetInstance(instance)
	_, stream, err := c.RegisterLocal(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stream.Close() })
	if _, err := c.Listen(ctx, "tcp", netip.Addr{}, port); err != nil {
		t.Fatal(err)
	}
}

// groupSeen is a shared listener as the metrics show it.
type groupSeen struct {
	instances, draining float64
	digest              string
}

func spreadMetrics(t *testing.T, s []metrics.Sample, app, listener string) groupSeen {
	t.Helper()
	l := []string{"app", app, "listener", listener}
	info := metrics.Find(s, "fabricbridge_spread_info", metrics.L(l...)...)
	if len(info) != 1 {
		t.Fatalf("fabricbridge_spread_info%v: %d series, want one per group", l, len(info))
	}
	return groupSeen{value(t, s, "fabricbridge_spread_instances", l...), value(t, s, "fabricbridge_spread_draining", l...),
		info[0].Label("digest")}
}

// TestInstanceGroupOperator: two instances of web share tcp/*:8080; the
// metrics and GET /v1/groups show the group with both and the digest
// computed here from the configured seed, /v1/apps the instance names.
// Draining web-b over the admin socket moves it to draining and changes
// the digest to web-a's alone; after spread.drain_deadline it is gone and
// the expiry counted. An unknown instance or half a request is refused.
func TestInstanceGroupOperator(t *testing.T) {
	const seed = 0x5eed
	tp := newTopo(t)
	cfg := tp.config(t, "spread: {seed: 0x5eed, drain_deadline: 1s}\n")
	d := tp.start(t, cfg, io.Discard)
	defer d.Close()
	admin := apiClients(t, tp, d)["admin"]
	registerInstance(t, d, "web", "web-b", 8080)
	registerInstance(t, d, "web", "web-a", 8080)
	const listener = "tcp/*:8080"

	both := tableDigest(seed, "web-a", "web-b")
	if got, want := spreadMetrics(t, tp.scrape(t, d), "web", listener), (groupSeen{2, 0, both}); got != want {
		t.Errorf("metrics with both instances: %+v, want %+v", got, want)
	}
	var groups GroupsResponse
	getJSON(t, admin, "/v1/groups", &groups)
	want := GroupsResponse{Groups: []Group{{App: "web", Listener: listener,
		Instances: []string{"web-a", "web-b"}, Draining: []string{}, Digest: both}}}
	if !reflect.DeepEqual(groups, want) {
		t.Errorf("/v1/groups:\n got %+v\nwant %+v", groups, want)
	}
	var apps AppsResponse
	getJSON(t, admin, "/v1/apps", &apps)
	var names []string
	for _, a := range apps.Apps {
		names = append(names, a.Name+"/"+a.Instance)
	}
	if strings.Join(names, " ") != "web/web-b web/web-a" {
		t.Errorf("/v1/apps names by stream: %v", names)
	}

	for _, c := range []struct {
		query string
		code  int
		says  string
	}{
		{"?app=web&instance=web-c", http.StatusNotFound, `application "web" has no instance "web-c"; registered: web-b, web-a`},
		{"?app=api&instance=web-a", http.StatusNotFound, `application "api" has no instance registered`},
		{"?app=web", http.StatusBadRequest, "needs both app and instance"},
	} {
		if code, body := get(t, admin, "POST", "/drain"+c.query); code != c.code || !strings.Contains(body, c.says) {
			t.Errorf("POST /drain%s: %d %q, want %d saying %q", c.query, code, body, c.code, c.says)
		}
	}
	if code, body := get(t, admin, "POST", "/drain?app=web&instance=web-b"); code != http.StatusOK || !strings.Contains(body, "draining: instance web-b of web") {
		t.Fatalf("POST /drain web-b: %d %q", code, body)
	}
	s := tp.scrape(t, d)
	if got, want := spreadMetrics(t, s, "web", listener), (groupSeen{1, 1, tableDigest(seed, "web-a")}); got != want {
		t.Errorf("metrics with web-b draining: %+v, want %+v", got, want)
	}
	if v := value(t, s, "fabricbridge_spread_drains_started_total"); v != 1 {
		t.Errorf("drains started: %v, want 1", v)
	}
	getJSON(t, admin, "/v1/groups", &groups)
	if g := groups.Groups; len(g) != 1 || !reflect.DeepEqual(g[0].Draining, []string{"web-b"}) || !reflect.DeepEqual(g[0].Instances, []string{"web-a"}) {
		t.Errorf("/v1/groups with web-b draining: %+v", groups)
	}

	// The drain deadline (1 s) ends web-b's drain: web-a is alone.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		s := tp.scrape(t, d)
		if value(t, s, "fabricbridge_spread_drains_expired_total") == 1 {
			if got, want := spreadMetrics(t, s, "web", listener), (groupSeen{1, 0, tableDigest(seed, "web-a")}); got != want {
				t.Errorf("metrics after the drain expired: %+v, want %+v", got, want)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("web-b's drain did not expire within 5 s of a 1 s deadline")
		}
	}
}
