package ingest

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// TestLockRealtime: the calling goroutine's thread becomes SCHED_FIFO at
// the priority asked and gets its old policy back from unlock; a priority
// outside 1-99 is refused and leaves the thread as it was.
func TestLockRealtime(t *testing.T) {
	testenv.RequirePrivileged(t)
	type result struct {
		bad, err           error
		before, got, after *unix.SchedAttr
	}
	done := make(chan result)
	go func() {
		var r result
		r.before, _ = unix.SchedGetAttr(0, 0)
		_, r.bad = LockRealtime(100)
		unlock, err := LockRealtime(7)
		if r.err = err; err == nil {
			r.got, r.err = unix.SchedGetAttr(0, 0)
			unlock()
			if r.err == nil {
				r.after, r.err = unix.SchedGetAttr(0, 0)
			}
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
	if r.after.Policy != r.before.Policy || r.after.Priority != r.before.Priority {
		t.Fatalf("after unlock: policy %d priority %d, want %d %d back", r.after.Policy, r.after.Priority, r.before.Policy, r.before.Priority)
	}
}
