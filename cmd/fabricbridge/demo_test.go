package main

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// TestDemo runs the demo with a small load and checks its summary against
// the traffic it drove, and that it left nothing behind.
func TestDemo(t *testing.T) {
	testenv.RequirePrivileged(t)
	opts := defaultDemo
	opts.Requests, opts.TriggerPerPort, opts.Blocked = 20, 50, 30
	var log bytes.Buffer
	sum, err := runDemo(context.Background(), opts, &log)
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, log.String(), sum.Log)
	}
	if sum.Mode == "" {
		t.Error("no data path reported")
	}
	if sum.Requests != opts.Requests || sum.Served != int64(opts.Requests) || sum.ResponseBytes != int64(opts.Requests*opts.ResponseBytes) {
		t.Errorf("HTTP: %d answered, %d served, %d bytes; want %d, %d, %d", sum.Requests, sum.Served, sum.ResponseBytes, opts.Requests, opts.Requests, opts.Requests*opts.ResponseBytes)
	}
	if sum.Latency[0] <= 0 || sum.Latency[0] > sum.Latency[1] || sum.Latency[1] > sum.Latency[2] {
		t.Errorf("latencies not ordered: %v", sum.Latency)
	}
	if sum.PingReplies != opts.Pings {
		t.Errorf("%d ping replies, want %d", sum.PingReplies, opts.Pings)
	}
	sent := 4 * opts.TriggerPerPort
	if sum.TriggerSent != sent || sum.IngestRecords != uint64(sent) || sum.IngestBytes != uint64(sent*(4+2*triggerHits)) {
		t.Errorf("ingest: %d sent, %d records, %d bytes", sum.TriggerSent, sum.IngestRecords, sum.IngestBytes)
	}
	if sum.DroppedHere != 0 || sum.SenderGaps != 0 || sum.TriggerKernel != 0 || sum.IngestBuffers == 0 || sum.Windows == 0 {
		t.Errorf("ingest: %d dropped here, %d sender gaps, %d in the kernel, %d buffers, %d windows", sum.DroppedHere, sum.SenderGaps, sum.TriggerKernel, sum.IngestBuffers, sum.Windows)
	}
	if sum.BlockedDropped != uint64(opts.Blocked) || sum.BlockedReceived != 0 {
		t.Errorf("blocked: %d dropped, %d received, want %d and 0", sum.BlockedDropped, sum.BlockedReceived, opts.Blocked)
	}
	// At least SYN, request and final ACK of every connection were steered.
	if got := sum.Verdicts["steer"]; got < uint64(3*opts.Requests) {
		t.Errorf("%d frames steered for %d connections", got, opts.Requests)
	}
	for _, r := range sum.Rules {
		if r.ID == 1 && r.Packets < uint64(3*opts.Requests) {
			t.Errorf("listener http (id 1) counted %d frames for %d connections", r.Packets, opts.Requests)
		}
	}
	if got := sum.Verdicts["ingest"]; got != uint64(sent) {
		t.Errorf("%d frames ingested, want %d", got, sent)
	}
	for k, v := range sum.Drops {
		if v != 0 {
			t.Errorf("drops %s: %d in clean traffic", k, v)
		}
	}
	var out bytes.Buffer
	printSummary(&out, sum)
	for _, re := range []string{
		`data path +\S+`,
		`HTTP requests served +20 by the application on its user-space stack \(20 answered, 81920 response bytes\)`,
		`HTTP latency +p50 \d+µs +p99 \d+µs +max \d+µs`,
		`trigger datagrams +200 sent, 200 ingest records \(4000 payload bytes\) in \d+ buffers, 0 dropped here, 0 sender gaps, 0 reached the kernel`,
		`ingest latency +p50 < \d+µs +p99 < \d+µs`,
		`blocked datagrams +30 sent, 30 dropped in XDP, 0 reached the kernel`,
		`(?m)^ +1 +http +\d+ +\d+ *$`, // the configured listener the application's claim shares
		`(?m)^ +3 +blocked +30 +\d+ *$`,
		`(?m)^ +2 +trigger +200 +\d+ *$`,
	} {
		if !regexp.MustCompile(re).MatchString(out.String()) {
			t.Errorf("summary lacks %s:\n%s", re, out.String())
		}
	}
	if !strings.Contains(sum.Log, "fabricbridge stopped") {
		t.Errorf("the daemon did not stop cleanly:\n%s", sum.Log)
	}
	if len(sum.Namespaces) != 2 {
		t.Fatalf("the demo reports namespaces %v, want two", sum.Namespaces)
	}
	for _, p := range append([]string{sum.Dir}, "/run/netns/"+sum.Namespaces[0], "/run/netns/"+sum.Namespaces[1]) {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s left behind (stat: %v)", p, err)
		}
	}
}
