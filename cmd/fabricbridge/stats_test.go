package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
)

func exposition(t *testing.T, text string) []metrics.Sample {
	t.Helper()
	s, err := metrics.Parse(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const statsBefore = `fabricbridge_start_time_seconds 1000
fabricbridge_applications_connected 1
fabricbridge_reloads_total{result="ok"} 2
fabricbridge_reloads_total{result="error"} 1
fabricbridge_attach_mode{interface="eth1",mode="generic"} 1
fabricbridge_rule_packets_total{interface="eth1",id="12",name="late"} 0
fabricbridge_rule_bytes_total{interface="eth1",id="12",name="late"} 0
fabricbridge_rule_packets_total{interface="eth1",id="3",name="blocked"} 100
fabricbridge_rule_bytes_total{interface="eth1",id="3",name="blocked"} 6400
fabricbridge_stream_rx_packets_total{interface="eth1",stream="1",app="web"} 10
fabricbridge_stream_rx_bytes_total{interface="eth1",stream="1",app="web"} 1000
fabricbridge_stream_tx_packets_total{interface="eth1",stream="1",app="web"} 5
fabricbridge_stream_tx_bytes_total{interface="eth1",stream="1",app="web"} 500
fabricbridge_stream_health{interface="eth1",stream="1",app="web",state="normal"} 1
fabricbridge_stream_health{interface="eth1",stream="1",app="web",state="sick"} 0
`

func TestRenderRates(t *testing.T) {
	t0 := time.Unix(2000, 0)
	prev := newSnapshot(t0, exposition(t, statsBefore))
	after := strings.NewReplacer(
		`id="3",name="blocked"} 100`, `id="3",name="blocked"} 300`,
		`id="3",name="blocked"} 6400`, `id="3",name="blocked"} 19200`,
		`app="web"} 10`+"\n", `app="web"} 2010`+"\n",
		`app="web"} 1000`+"\n", `app="web"} 1001000`+"\n",
	).Replace(statsBefore) + `fabricbridge_stream_rx_drops_total{interface="eth1",stream="1",app="web",reason="ring_full"} 7
fabricbridge_ingest_records_total{ring="trigger",buffer_id="1"} 4000
fabricbridge_ingest_bytes_total{ring="trigger",buffer_id="1"} 256000
fabricbridge_ingest_buffers_published_total{ring="trigger",buffer_id="1"} 12
fabricbridge_ingest_drops_total{ring="trigger",buffer_id="1",reason="no_buffer"} 3
fabricbridge_ingest_consumer_attached{ring="trigger",buffer_id="1"} 1
`
	cur := newSnapshot(t0.Add(2*time.Second), exposition(t, after))
	var b bytes.Buffer
	render(&b, "127.0.0.1:9469", prev, cur)
	out := b.String()
	for _, want := range []string{
		"fabricbridge  127.0.0.1:9469  up 16m42s  applications 1  reloads 2 ok, 1 failed",
		"interface eth1  mode generic  (slow path",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("lacks %q:\n%s", want, out)
		}
	}
	// Rows, whitespace-insensitive: rule 3 counted 200 packets and 12800
	// bytes in 2 s; rules sorted by id (3 before 12).
	for _, re := range []string{
		`(?m)^ +RULE +PACKETS +PKT/S +BYTES +RATE\s*$`,
		`(?m)^ +3 blocked +300 +100 +19\.2k +51\.2kb/s\s*$`,
		`(?s)3 blocked.*12 late`,
		`(?m)^ +1 web +normal +1000 +4\.00Mb/s +0 +0b/s +7 +0\s*$`,
		`(?m)^ +trigger +4000 +2000 +256\.0k +1\.02Mb/s +12 +3 +attached\s*$`,
	} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("no line matching %s:\n%s", re, out)
		}
	}
	if strings.Contains(out, "QUEUE") {
		t.Errorf("empty section shown:\n%s", out)
	}
}

func TestStatsOnce(t *testing.T) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "fabricbridge_rule_packets_total{interface=\"eth1\",id=\"3\",name=\"blocked\"} %d\n", 100*n.Add(1))
	}))
	defer srv.Close()
	var out bytes.Buffer
	err := statsCommand(context.Background(), []string{"--metrics", strings.TrimPrefix(srv.URL, "http://"), "--once", "--interval", "100ms"}, &out)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^ +3 blocked +200 +\d+`).MatchString(out.String()) || strings.Contains(out.String(), "\x1b[") {
		t.Errorf("output:\n%q", out.String())
	}
	if err := statsCommand(context.Background(), []string{"--metrics", "127.0.0.1:1", "--once"}, &out); err == nil || !strings.Contains(err.Error(), "is the daemon running?") {
		t.Errorf("no daemon: %v", err)
	}
}

// TestRenderFallback: a data path that fell back to a slow path says so in
// the header, with each path it left and why.
func TestRenderFallback(t *testing.T) {
	text := `fabricbridge_attach_mode{interface="eth1",mode="afpacket"} 1
fabricbridge_attach_fallback{interface="eth1",from="native-copy",to="afpacket",reason="queue 1: xsk: bind (copy): invalid argument"} 1
fabricbridge_attach_fallback{interface="eth1",from="generic",to="afpacket",reason="queue 1: busy"} 1
`
	cur := newSnapshot(time.Unix(2000, 0), exposition(t, text))
	var b bytes.Buffer
	render(&b, "127.0.0.1:9469", cur, cur)
	for _, want := range []string{
		"interface eth1  mode afpacket  FELL BACK to a slow path\n",
		"  not native-copy: queue 1: xsk: bind (copy): invalid argument\n",
		"  not generic: queue 1: busy\n",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("lacks %q:\n%s", want, b.String())
		}
	}
}

// TestRenderGroups: a stream shows its application's instance name, and
// each shared listener its instances and digest: by name where /v1/groups
// answered, counted from the metrics where it did not.
func TestRenderGroups(t *testing.T) {
	text := `fabricbridge_application_instance{app="web",stream="2",instance="web-b"} 1
fabricbridge_stream_rx_packets_total{interface="eth1",stream="2",app="web"} 10
fabricbridge_stream_rx_bytes_total{interface="eth1",stream="2",app="web"} 1000
fabricbridge_spread_instances{app="web",listener="tcp/*:80"} 2
fabricbridge_spread_draining{app="web",listener="tcp/*:80"} 1
fabricbridge_spread_info{app="web",listener="tcp/*:80",digest="00112233aabbccdd"} 1
fabricbridge_spread_drains_started_total 4
fabricbridge_spread_drains_expired_total 3
`
	cur := newSnapshot(time.Unix(2000, 0), exposition(t, text))
	for _, tc := range []struct {
		groups []appliance.Group
		row    string
	}{
		{nil, `(?m)^ +web tcp/\*:80 +2 +1 +00112233aabbccdd\s*$`},
		{[]appliance.Group{{App: "web", Listener: "tcp/*:80", Instances: []string{"web-a", "web-c"}, Draining: []string{"web-b"}}},
			`(?m)^ +web tcp/\*:80 +web-a,web-c +web-b +00112233aabbccdd\s*$`},
	} {
		cur.groups = tc.groups
		var b bytes.Buffer
		render(&b, "admin.sock", cur, cur)
		for _, re := range []string{tc.row, `(?m)^ +2 web/web-b +`, `(?m)^drains  4 started, 3 expired by the deadline$`} {
			if !regexp.MustCompile(re).MatchString(b.String()) {
				t.Errorf("groups %v: no line matching %s:\n%s", tc.groups, re, b.String())
			}
		}
	}
}
