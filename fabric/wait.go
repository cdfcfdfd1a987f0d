package fabric

import (
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// eventfdOne is the 8-byte native-endian value 1 that an eventfd write adds.
var eventfdOne = [8]byte{1}

func newEventfd() (int, error) {
	return unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
}

// eventfdSignal adds one to an eventfd. Errors are ignored on purpose: the
// only possible one for a valid fd is a counter at its maximum, which means
// the sleeper already has a pending wake-up.
func eventfdSignal(fd int) {
	_, _ = unix.Write(fd, eventfdOne[:])
}

// eventfdDrain resets an eventfd's counter (non-blocking).
func eventfdDrain(fd int, buf *[8]byte) {
	_, _ = unix.Read(fd, buf[:])
}

// readier is a condition a waiter waits for. Implementations are pointers
// to fields of long-lived objects, so passing one does not allocate.
type readier interface{ ready() bool }

// defaultSpin is how long a waiter polls before it arms the tripwire and
// sleeps. A wake-up through the kernel costs a few microseconds, so
// spinning about that long catches a busy peer's next batch without a
// system call while an idle stream stops burning the CPU quickly.
const defaultSpin = 20 * time.Microsecond

// waiter is CLAN's tripwire in software: it spins on a condition, then sets
// an armed flag in shared memory, re-checks the condition, and only then
// sleeps on an eventfd. The other side signals the eventfd only when it
// finds the flag armed (and clears it), so a stream that never runs dry
// makes no system calls at all. One waiter belongs to one goroutine.
//
// With MaxSpin above Spin the spin adapts: a wait that ended within
// MaxSpin (slept or not) moves the spin toward 1.5 times its length, one
// that took longer moves it back toward Spin. Traffic with steady gaps
// shorter than MaxSpin is then caught spinning (sub-microsecond instead of
// a kernel wake-up, about 20 µs on a VM) at the price of a core busy for
// those gaps; an idle stream still parks after Spin.
type waiter struct {
	fd   int
	flag *uint32
	// Spin is the polling period before sleeping; zero sleeps at once.
	Spin time.Duration
	// MaxSpin, if above Spin, lets the spin adapt up to it. Zero: fixed.
	MaxSpin time.Duration
	budget  time.Duration // current adaptive spin

	pfd    [1]unix.PollFd
	buf    [8]byte
	sleeps atomic.Uint64
}

func newWaiter(fd int, flag *uint32) *waiter {
	return &waiter{fd: fd, flag: flag, Spin: defaultSpin}
}

// Sleeps counts how often the waiter had to enter the kernel.
func (w *waiter) Sleeps() uint64 { return w.sleeps.Load() }

// spinFor is how long the next wait spins.
func (w *waiter) spinFor() time.Duration {
	if w.MaxSpin <= w.Spin {
		return w.Spin
	}
	return min(max(w.budget, w.Spin), w.MaxSpin)
}

// learn moves the adaptive spin toward what the last wait needed.
func (w *waiter) learn(d time.Duration) {
	if w.MaxSpin <= w.Spin {
		return
	}
	target := w.Spin
	if d <= w.MaxSpin {
		target = min(max(d+d/2, w.Spin), w.MaxSpin)
	}
	b := max(w.budget, w.Spin)
	w.budget = b + (target-b)/4
}

// Budget is the spin the next wait will use (Spin unless MaxSpin adapts it).
func (w *waiter) Budget() time.Duration { return w.spinFor() }

// wait returns nil once r is ready, ErrTimeout when timeout (if >= 0)
// passes first. Spurious eventfd wake-ups are harmless: the loop re-checks.
func (w *waiter) wait(r readier, timeout time.Duration) error {
	if r.ready() {
		return nil
	}
	start := time.Now()
	err := w.block(r, timeout, start)
	w.learn(time.Since(start))
	return err
}

// block spins, then arms the tripwire and sleeps, until r is ready.
func (w *waiter) block(r readier, timeout time.Duration, start time.Time) error {
	if spin := w.spinFor(); spin > 0 {
		for i := 1; ; i++ {
			if r.ready() {
				return nil
			}
			if i&31 == 0 {
				el := time.Since(start)
				if el >= spin || (timeout >= 0 && el >= timeout) {
					break
				}
			}
		}
	}
	for {
		// Empty the eventfd before arming, not after the wake-up, so the
		// wake-up path makes one system call (poll), not two. Before
		// arming, never after: a producer that clears our flag once it is
		// armed (even one late with a signal meant for an earlier round)
		// writes its signal after that, so it cannot be drained here, and
		// sleeping with the flag cleared always finds the signal pending.
		eventfdDrain(w.fd, &w.buf)
		atomic.SwapUint32(w.flag, 1) // a full barrier before the re-check
		if r.ready() {
			atomic.StoreUint32(w.flag, 0)
			return nil
		}
		ms := -1
		if timeout >= 0 {
			left := timeout - time.Since(start)
			if left <= 0 {
				atomic.StoreUint32(w.flag, 0)
				return ErrTimeout
			}
			ms = int((left + time.Millisecond - 1) / time.Millisecond)
		}
		w.sleeps.Add(1)
		w.pfd[0] = unix.PollFd{Fd: int32(w.fd), Events: unix.POLLIN}
		_, err := unix.Poll(w.pfd[:], ms)
		if err != nil && err != unix.EINTR {
			atomic.StoreUint32(w.flag, 0)
			return err
		}
		if r.ready() {
			atomic.StoreUint32(w.flag, 0)
			return nil
		}
	}
}
