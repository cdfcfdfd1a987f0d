package ingest

import (
	"time"

	"golang.org/x/sys/unix"
)

// The XDP program stamps frames with bpf_ktime_get_ns, CLOCK_MONOTONIC.
// Go's runtime reads the same clock through the vDSO for time.Since, but
// only relative to a time.Time; clockBase pins one time.Time to its
// CLOCK_MONOTONIC value, so Now costs a vDSO read, not a system call.
var clockBase, clockEpoch = calibrate()

func calibrate() (uint64, time.Time) {
	var (
		best     = int64(-1)
		baseNs   uint64
		baseTime time.Time
	)
	for range 16 {
		var a, b unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &a)
		t := time.Now()
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &b)
		if w := b.Nano() - a.Nano(); best < 0 || w < best {
			best = w
			baseNs = uint64(a.Nano() + w/2)
			baseTime = t
		}
	}
	return baseNs, baseTime
}

// Now is CLOCK_MONOTONIC in nanoseconds, the clock of the RX timestamps.
func Now() uint64 { return clockBase + uint64(time.Since(clockEpoch)) }
