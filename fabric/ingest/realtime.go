package ingest

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// LockRealtime locks the calling goroutine to its thread and makes the
// thread SCHED_FIFO at priority (1-99; needs CAP_SYS_NICE). A woken
// real-time thread preempts ordinary ones at once instead of waiting for
// its turn, which is what the latency tail on a shared machine is made of
// (docs/performance.md#the-latency-tail). Call it at the top of the goroutine that
// will wait in Next, open that consumer with NoYield, and call unlock
// before the goroutine ends: it gives the thread its old policy back and
// unlocks it. (A goroutine that ends locked takes its thread with it,
// except the process's main thread, which Go keeps, here real-time.)
//
// A real-time thread that never sleeps takes its CPU from everything
// else up to the kernel's limit (sched_rt_runtime_us, 95 % by default):
// keep Spin bounded unless the CPU is the consumer's alone.
func LockRealtime(priority int) (unlock func(), err error) {
	if priority < 1 || priority > 99 {
		return nil, fmt.Errorf("ingest: real-time priority %d outside 1-99", priority)
	}
	runtime.LockOSThread()
	old, err := unix.SchedGetAttr(0, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("ingest: sched_getattr: %w", err)
	}
	// Threads this one creates (the Go runtime may start one from any
	// thread) get the ordinary policy.
	attr := unix.SchedAttr{Policy: unix.SCHED_FIFO, Priority: uint32(priority), Flags: unix.SCHED_FLAG_RESET_ON_FORK}
	if err := unix.SchedSetAttr(0, &attr, 0); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("ingest: SCHED_FIFO %d: %w", priority, err)
	}
	return func() {
		if unix.SchedSetAttr(0, old, 0) == nil {
			runtime.UnlockOSThread()
		}
		// Otherwise the thread stays locked and ends with the
		// goroutine.
	}, nil
}
