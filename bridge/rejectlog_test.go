package bridge

import (
	"bytes"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// TestLogReject: a refused packet is described at debug level (stream,
// reason as the metric names it, addresses and ports), at most once per
// rejectLogEvery, and not at all above debug.
func TestLogReject(t *testing.T) {
	var out bytes.Buffer
	tx := &txSide{b: &Bridge{log: slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))}}
	e := &streamEntry{id: 7}
	p := ippkt.UDP(netip.MustParseAddrPort("198.18.0.1:41000"), netip.MustParseAddrPort("198.18.0.2:53"), []byte("x"))
	tx.logReject(e, rejSourcePort, p)
	tx.logReject(e, rejSourcePort, p) // within rejectLogEvery: not logged
	line := out.String()
	for _, want := range []string{"stream=7", "reason=source_port", "src=198.18.0.1:41000", "dst=198.18.0.2:53", "proto=17"} {
		if !strings.Contains(line, want) {
			t.Errorf("log %q lacks %q", line, want)
		}
	}
	if n := strings.Count(line, "refused"); n != 1 {
		t.Errorf("%d lines within %v, want 1:\n%s", n, rejectLogEvery, line)
	}
	tx.lastRejectLog = time.Now().Add(-rejectLogEvery)
	tx.logReject(e, rejMTU, p)
	if !strings.Contains(out.String(), "reason=mtu") {
		t.Errorf("no line after the interval:\n%s", out.String())
	}

	out.Reset()
	quiet := &txSide{b: &Bridge{log: slog.New(slog.NewTextHandler(&out, nil))}}
	quiet.logReject(e, rejSourcePort, p)
	if out.Len() != 0 {
		t.Errorf("logged at info level: %s", out.String())
	}
	for r := reason(0); r < numReasons; r++ {
		if r.String() == "" {
			t.Errorf("reason %d has no name", r)
		}
	}
}
