package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"
)

// keptAlive is an HTTP/1.1 connection from the outside host that asks
// GET / again and again.
type keptAlive struct {
	c  net.Conn
	in *bufio.Reader
}

func (k *keptAlive) get() (string, error) {
	k.c.SetDeadline(time.Now().Add(5 * time.Second))
	defer k.c.SetDeadline(time.Time{})
	if _, err := io.WriteString(k.c, "GET / HTTP/1.1\r\nHost: service\r\n\r\n"); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(k.in, nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %s", resp.Status)
	}
	return string(body), err
}

// startApp runs `fabricbridge app http` as a process of its own in the
// bridge's namespace, with args more, and opens a kept-alive connection to
// it that has had its first answer.
func startApp(t *testing.T, tb *testBridge, args ...string) (*daemonProc, *keptAlive) {
	t.Helper()
	p := startDaemon(t, tb.bridge, append([]string{"app", "http", "--control", tb.cfg.Control.Socket, "--size", "5"}, args...)...)
	awaitOutput(t, p, "serving on")
	c := tb.dialOutside(t, "tcp", netip.AddrPortFrom(tb.v.A.Addr4.Addr(), 80))
	k := &keptAlive{c: c, in: bufio.NewReader(c)}
	if body, err := k.get(); err != nil || body != "fabri" {
		t.Fatalf("GET before the signal: %q, %v\n%s", body, err, p.out.String())
	}
	return p, k
}

func awaitOutput(t *testing.T, p *daemonProc, s string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(p.out.String(), s); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q from the application:\n%s", s, p.out.String())
		}
	}
}

// exited says whether p ended within d, and how.
func exited(p *daemonProc, d time.Duration) (bool, error) {
	select {
	case err := <-p.done:
		p.done <- err
		return true, err
	case <-time.After(d):
		return false, nil
	}
}

// TestAppDrainsOnSIGTERM: an instance told to stop with SIGTERM drains: its
// kept-alive connection still gets answers, and it exits 0 once that
// connection closes, saying none was left. A second signal ends it at once;
// an application that is no instance stops at once.
func TestAppDrainsOnSIGTERM(t *testing.T) {
	tb := newTestBridge(t, "")
	t.Run("drains", func(t *testing.T) {
		p, k := startApp(t, tb, "--instance", "web-1", "--drain-timeout", "20s")
		p.signal(t, syscall.SIGTERM)
		awaitOutput(t, p, "draining")
		for i := range 3 {
			if body, err := k.get(); err != nil || body != "fabri" {
				t.Fatalf("GET %d while draining: %q, %v\n%s", i, body, err, p.out.String())
			}
		}
		if gone, err := exited(p, 300*time.Millisecond); gone {
			t.Fatalf("exited (%v) with a connection open:\n%s", err, p.out.String())
		}
		k.c.Close()
		if err := p.wait(t); err != nil {
			t.Fatalf("exit: %v\n%s", err, p.out.String())
		}
		out := p.out.String()
		if !strings.Contains(out, "drained, 0 connections left") || strings.Contains(out, "drain:") {
			t.Fatalf("the drain failed, or its end is not logged:\n%s", out)
		}
		t.Logf("the application's log:\n%s", out)
	})
	t.Run("second signal", func(t *testing.T) {
		p, _ := startApp(t, tb, "--instance", "web-1", "--drain-timeout", "20s")
		p.signal(t, syscall.SIGTERM)
		awaitOutput(t, p, "draining")
		p.signal(t, syscall.SIGINT)
		gone, err := exited(p, 3*time.Second)
		if !gone {
			t.Fatalf("still running 3s after the second signal:\n%s", p.out.String())
		}
		if ws := p.cmd.ProcessState.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGINT {
			t.Fatalf("ended with %v, want to die of SIGINT\n%s", err, p.out.String())
		}
	})
	t.Run("no instance", func(t *testing.T) {
		p, _ := startApp(t, tb)
		p.signal(t, syscall.SIGTERM)
		gone, err := exited(p, 3*time.Second)
		if !gone || err != nil {
			t.Fatalf("exited %v (%v) within 3s of SIGTERM, with a connection open:\n%s", gone, err, p.out.String())
		}
		if strings.Contains(p.out.String(), "draining") {
			t.Fatalf("drained without --instance:\n%s", p.out.String())
		}
	})
}
