package userstack

import (
	"math"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
)

func TestMonotonicTime(t *testing.T) {
	for _, ns := range []int64{0, 1, 1e9, 123456789012345, math.MaxInt64, -1, math.MinInt64 + 1} {
		want := tcpip.MonotonicTime{}.Add(time.Duration(ns))
		if got := monotonicTime(ns); got != want {
			t.Errorf("monotonicTime(%d) = %v, want %v", ns, got, want)
		}
	}
}

func TestMonotonicClock(t *testing.T) {
	c := newMonotonicClock()
	first := c.NowMonotonic()
	if first == (tcpip.MonotonicTime{}) {
		// a reading of zero means "never" to parts of gVisor's TCP
		t.Errorf("first reading is zero")
	}
	time.Sleep(2 * time.Millisecond)
	second := c.NowMonotonic()
	if d := second.Sub(first); d < 2*time.Millisecond || d > 2*time.Second {
		t.Errorf("readings 2 ms apart differ by %v", d)
	}
	fired := make(chan struct{})
	c.AfterFunc(time.Millisecond, func() { close(fired) })
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("AfterFunc's function did not run")
	}
	stopped := c.AfterFunc(time.Hour, func() { t.Error("a stopped timer fired") })
	if !stopped.Stop() {
		t.Error("Stop of a pending timer reported it had already fired")
	}
}

// The reading gVisor's TCP takes several times a segment, against the
// standard clock's.
func BenchmarkNowMonotonic(b *testing.B) {
	for _, c := range []struct {
		name  string
		clock tcpip.Clock
	}{{"std", tcpip.NewStdClock()}, {"monotonic", newMonotonicClock()}} {
		b.Run(c.name, func(b *testing.B) {
			var last tcpip.MonotonicTime
			for b.Loop() {
				last = c.clock.NowMonotonic()
			}
			if last == (tcpip.MonotonicTime{}) {
				b.Fatal("no reading")
			}
		})
	}
}
