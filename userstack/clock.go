package userstack

import (
	"time"
	"unsafe"

	"gvisor.dev/gvisor/pkg/tcpip"
)

// monotonicClock is gVisor's standard clock without its costly monotonic
// reading. gVisor's TCP reads the monotonic clock several times a segment
// (timestamps, RTT, timers), and its standard clock turns each reading
// into a tcpip.MonotonicTime with MonotonicTime.Add, which goes through
// time.Unix, Time.Add and Time.Sub: about as much again as the clock read
// itself. In the serving benchmark's application profiles NowMonotonic
// was 3.3 % of all samples, half of it that conversion.
type monotonicClock struct {
	// base carries Go's monotonic reading, so time.Since reads only the
	// monotonic clock.
	base time.Time
}

var _ tcpip.Clock = (*monotonicClock)(nil)

func newMonotonicClock() *monotonicClock { return &monotonicClock{base: time.Now()} }

// Now is the wall clock, as gVisor's standard clock gives it.
func (*monotonicClock) Now() time.Time { return time.Now() }

// NowMonotonic counts from the clock's creation, as the standard clock
// does (a reading of zero means "never" in places of gVisor's TCP, and
// neither clock gives it after the first nanosecond).
func (c *monotonicClock) NowMonotonic() tcpip.MonotonicTime {
	return monotonicTime(int64(time.Since(c.base)))
}

// AfterFunc is the standard clock's timer.
func (*monotonicClock) AfterFunc(d time.Duration, f func()) tcpip.Timer {
	return tcpip.NewStdTimer(time.AfterFunc(d, f))
}

// monotonicTime makes a reading of ns nanoseconds. tcpip.MonotonicTime is
// a struct of one unexported int64, and gVisor offers no constructor but
// the costly Add; the arrays below stop the build if its size ever
// changes, and TestMonotonicTime checks the value against Add.
func monotonicTime(ns int64) tcpip.MonotonicTime {
	return *(*tcpip.MonotonicTime)(unsafe.Pointer(&ns))
}

var (
	_ [unsafe.Sizeof(tcpip.MonotonicTime{}) - unsafe.Sizeof(int64(0))]struct{}
	_ [unsafe.Sizeof(int64(0)) - unsafe.Sizeof(tcpip.MonotonicTime{})]struct{}
)
