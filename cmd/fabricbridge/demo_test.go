package main

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testenv"
)

// TestDemo runs the demo with a small load and checks its summary against
// the traffic it drove, and that it left no namespace behind.
func TestDemo(t *testing.T) {
	testenv.RequirePrivileged(t)
	opts := defaultDemo
	opts.Requests, opts.TriggerPerPort, opts.Blocked = 20, 50, 30
	var log bytes.Buffer
	sum, err := runDemo(context.Background(), opts, &log)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	if sum.Requests != opts.Requests || sum.ResponseBytes != int64(opts.Requests*opts.ResponseBytes) {
		t.Errorf("served %d requests, %d bytes; want %d, %d", sum.Requests, sum.ResponseBytes, opts.Requests, opts.Requests*opts.ResponseBytes)
	}
	if sum.PingReplies != opts.Pings {
		t.Errorf("%d ping replies, want %d", sum.PingReplies, opts.Pings)
	}
	if got := sum.Rules[idTrigger].Packets; got != uint64(4*opts.TriggerPerPort) || sum.TriggerSent != 4*opts.TriggerPerPort {
		t.Errorf("trigger rule counted %d of %d sent", got, sum.TriggerSent)
	}
	if got := sum.Rules[idBlocked].Packets; got != uint64(opts.Blocked) || sum.BlockedReceived != 0 {
		t.Errorf("blocked: %d dropped, %d received, want %d and 0", got, sum.BlockedReceived, opts.Blocked)
	}
	// At least SYN, request and final ACK of every connection.
	if got := sum.Rules[idHTTP].Packets; got < uint64(3*opts.Requests) {
		t.Errorf("HTTP listener counted %d packets for %d connections", got, opts.Requests)
	}
	if sum.Counters.Verdicts[classifier.VerdictMalformed].Packets != 0 {
		t.Errorf("malformed frames in clean traffic: %d", sum.Counters.Verdicts[classifier.VerdictMalformed].Packets)
	}
	var out bytes.Buffer
	printSummary(&out, sum)
	for _, want := range []string{"attach mode", "HTTP requests served  20", "p99", "30 dropped in XDP"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
	if len(sum.Namespaces) != 2 {
		t.Fatalf("the demo reports namespaces %v, want two", sum.Namespaces)
	}
	for _, name := range sum.Namespaces {
		if _, err := os.Stat("/run/netns/" + name); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("namespace %s left behind (stat: %v)", name, err)
		}
	}
}
