package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestStopWhileReadingConfig: `check` and `run` given a configuration
// that never comes (a pipe nobody writes to) stop at once on SIGTERM and on
// Ctrl-C (SIGINT): `check` dies of the signal, `run` returns.
func TestStopWhileReadingConfig(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(t.TempDir(), "never.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cmd    string
		sig    syscall.Signal
		killed bool // the signal ends the process, rather than the command returning
	}{
		{"check", syscall.SIGTERM, true},
		{"check", syscall.SIGINT, true},
		{"run", syscall.SIGTERM, false},
		{"run", syscall.SIGINT, false},
	} {
		t.Run(c.cmd+" "+c.sig.String(), func(t *testing.T) {
			p := exec.Command(self, c.cmd, "--config", fifo)
			p.Env = append(os.Environ(), "FB_TEST_MAIN=1")
			if err := p.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- p.Wait() }()
			defer awaitReader(t, fifo).Close()
			sent := time.Now()
			p.Process.Signal(c.sig)
			select {
			case <-done:
			case <-time.After(3 * time.Second):
				p.Process.Kill()
				<-done
				t.Fatalf("%s still reading its configuration 3s after %v", c.cmd, c.sig)
			}
			ws := p.ProcessState.Sys().(syscall.WaitStatus)
			if c.killed && !(ws.Signaled() && ws.Signal() == c.sig) {
				t.Errorf("%s ended with %v, want to die of %v", c.cmd, p.ProcessState, c.sig)
			}
			if !c.killed && (ws.Signaled() || ws.ExitStatus() != 1) {
				t.Errorf("%s ended with %v, want exit status 1", c.cmd, p.ProcessState)
			}
			t.Logf("%s ended %v after %v: %v", c.cmd, time.Since(sent).Round(time.Millisecond), c.sig, p.ProcessState)
		})
	}
}

// awaitReader returns once a process has opened fifo for reading, and
// with it a writer that keeps the reader waiting for data: a command opens
// its configuration after its signal handling is set up, so a signal sent
// then tests the handling, not the Go runtime's default. Close the writer
// when done.
func awaitReader(t *testing.T, fifo string) *os.File {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		// Without a reader, a non-blocking open for writing fails (ENXIO).
		w, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0)
		if err == nil {
			return w
		}
		if time.Now().After(end) {
			t.Fatalf("nothing opened %s for reading within 20s: %v", fifo, err)
		}
	}
}
