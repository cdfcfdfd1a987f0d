package main

import (
	"bufio"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestAppStacks runs `app http --stacks 2`: one process, two stacks, each
// registered as an instance of the application, and a Go processor for
// each. The bridge spreads new connections over both, and on SIGTERM both
// drain and the process exits 0, each stack's lines carrying its
// instance's name.
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
	// The process gave its runtime one processor per stack.
	if os.Getenv("GOMAXPROCS") == "" {
		want := fmt.Sprintf("http: Go processors (GOMAXPROCS): %d, for 2 stacks", min(2, runtime.GOMAXPROCS(0)))
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the application's log:\n%s", want, out)
		}
	}
	t.Logf("the application's log:\n%s", out)
}

// TestGoProcsPerStack: without GOMAXPROCS in the environment the runtime
// gets one processor per stack, never more than it had; with it, the
// runtime is left alone.
func TestGoProcsPerStack(t *testing.T) {
	prev := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	t.Setenv("GOMAXPROCS", "")
	for _, tc := range []struct{ had, stacks, want int }{{4, 1, 1}, {4, 3, 3}, {4, 8, 4}, {1, 2, 1}} {
		runtime.GOMAXPROCS(tc.had)
		n, set := goProcsPerStack(tc.stacks)
		if got := runtime.GOMAXPROCS(0); n != tc.want || !set || got != tc.want {
			t.Errorf("%d processors, %d stacks: reported %d (set %v), runtime has %d; want %d", tc.had, tc.stacks, n, set, got, tc.want)
		}
	}
	t.Setenv("GOMAXPROCS", "3")
	runtime.GOMAXPROCS(3)
	if n, set := goProcsPerStack(1); n != 3 || set || runtime.GOMAXPROCS(0) != 3 {
		t.Errorf("with GOMAXPROCS=3 in the environment: reported %d (set %v), runtime has %d; want 3, untouched", n, set, runtime.GOMAXPROCS(0))
	}
}
