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
// reason as the metric names it, addresses, ports, TCP flags), up to
// rejectLogBurst a second, and not at all above debug.
func TestLogReject(t *testing.T) {
	var out bytes.Buffer
	tx := &txSide{b: &Bridge{log: slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))}}
	e := &streamEntry{id: 7}
	p := ippkt.UDP(netip.MustParseAddrPort("198.18.0.1:41000"), netip.MustParseAddrPort("198.18.0.2:53"), []byte("x"))
	for range rejectLogBurst + 5 {
		tx.logReject(e, rejSourcePort, p)
	}
	line := out.String()
	for _, want := range []string{"stream=7", "reason=source_port", "src=198.18.0.1:41000", "dst=198.18.0.2:53", "proto=17"} {
		if !strings.Contains(line, want) {
			t.Errorf("log %q lacks %q", line, want)
		}
	}
	if n := strings.Count(line, "refused"); n != rejectLogBurst {
		t.Errorf("%d lines within a second, want %d:\n%s", n, rejectLogBurst, line)
	}
	tx.rejectLogSecond = time.Now().Add(-time.Second)
	rst := ippkt.TCP(netip.MustParseAddrPort("198.18.0.1:41000"), netip.MustParseAddrPort("198.18.0.2:80"), 1, 2, false, true, true, nil)
	tx.logReject(e, rejMTU, rst)
	if last := out.String()[len(line):]; !strings.Contains(last, "reason=mtu") || !strings.Contains(last, "tcp_flags=R.") {
		t.Errorf("after a second, a reset refused for its size:\n%s", last)
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
