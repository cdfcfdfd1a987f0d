package ingest

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/testenv"
)

// TestLockRealtime: the calling goroutine's thread becomes SCHED_FIFO at
// the priority asked; a priority outside 1-99 is refused and leaves the
// thread as it was.
func TestLockRealtime(t *testing.T) {
	testenv.RequirePrivileged(t)
	type result struct {
		bad, err    error
		before, got *unix.SchedAttr
	}
	done := make(chan result)
	go func() {
		// The goroutine exits locked: its thread, real-time, exits too.
		var r result
		r.before, _ = unix.SchedGetAttr(0, 0)
		r.bad = LockRealtime(100)
		if r.err = LockRealtime(7); r.err == nil {
			r.got, r.err = unix.SchedGetAttr(0, 0)
		}
		done <- r
	}()
	r := <-done
	if r.bad == nil {
		t.Error("priority 100 accepted")
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.before.Policy != unix.SCHED_NORMAL {
		t.Fatalf("the thread started with policy %d", r.before.Policy)
	}
	if r.got.Policy != unix.SCHED_FIFO || r.got.Priority != 7 {
		t.Fatalf("policy %d priority %d, want SCHED_FIFO (%d) 7", r.got.Policy, r.got.Priority, unix.SCHED_FIFO)
	}
}
