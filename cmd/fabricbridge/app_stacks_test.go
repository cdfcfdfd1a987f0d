package main

import (
	"bufio"
	"net/netip"
	"regexp"
	"strconv"
	"syscall"
	"testing"
)

// TestAppStacks runs `app http --stacks 2`: one process, two stacks, each
// registered as an instance of the application. The bridge spreads new
// connections over both, and on SIGTERM both drain and the process exits 0,
// each stack's lines carrying its instance's name.
func TestAppStacks(t *testing.T) {
	tb := newTestBridge(t, "")
	p := startDaemon(t, tb.bridge, "app", "http", "--control", tb.cfg.Control.Socket, "--size", "5",
		"--stacks", "2", "--instance", "web", "--drain-timeout", "5s")
	awaitOutput(t, p, "web-1: http: serving on")
	awaitOutput(t, p, "web-2: http: serving on")
	const conns = 40
	for i := range conns {
		c := tb.dialOutside(t, "tcp", netip.AddrPortFrom(tb.v.A.Addr4.Addr(), 80))
		k := &keptAlive{c: c, in: bufio.NewReader(c)}
		if body, err := k.get(); err != nil || body != "fabri" {
			t.Fatalf("GET on connection %d: %q, %v\n%s", i, body, err, p.out.String())
		}
		c.Close()
	}
	p.signal(t, syscall.SIGTERM)
	if err := p.wait(t); err != nil {
		t.Fatalf("exit: %v\n%s", err, p.out.String())
	}
	out := p.out.String()
	served := 0
	for _, inst := range []string{"web-1", "web-2"} {
		m := regexp.MustCompile(inst + `: http: (\d+) requests`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("%s did not say what it served:\n%s", inst, out)
		}
		n, _ := strconv.Atoi(m[1])
		if n < conns/5 {
			t.Errorf("%s served %d of %d connections: the bridge did not spread them over both stacks\n%s", inst, n, conns, out)
		}
		served += n
		if !regexp.MustCompile(inst + `: http: drained, 0 connections left`).MatchString(out) {
			t.Errorf("%s did not drain:\n%s", inst, out)
		}
		if !regexp.MustCompile(inst + `: http: link: received \d+ packets`).MatchString(out) {
			t.Errorf("%s did not say what its link moved:\n%s", inst, out)
		}
	}
	if served != conns {
		t.Errorf("the stacks served %d requests, want %d", served, conns)
	}
	t.Logf("the application's log:\n%s", out)
}
