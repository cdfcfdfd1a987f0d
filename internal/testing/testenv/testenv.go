// Package testenv decides whether a test that needs a real kernel may run.
//
// Most of fabricbridge is only meaningful against the kernel itself: XDP
// programs, AF_XDP sockets, veth pairs in private network namespaces. Those
// tests cannot run as an ordinary user, and on a developer laptop that is fine:
// they should step aside quietly. On CI, though, a quiet skip would let the
// whole kernel-facing suite vanish without anyone noticing, so CI sets
// FB_REQUIRE_PRIVILEGED=1 and the same condition becomes a failure.
package testenv

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// RequireEnv is the environment variable that turns a missing privilege from
// a skip into a failure. Only the exact value "1" counts, so that a stray
// empty or "0" setting keeps the forgiving default.
const RequireEnv = "FB_REQUIRE_PRIVILEGED"

// Capability numbers from linux/capability.h. They are spelled out here
// because only these three matter and their numbers are part of the kernel ABI.
const (
	capNetAdmin = 12
	capSysAdmin = 21
	capBPF      = 39
)

// privileges is what the decision depends on, gathered once from the running
// process so that the decision itself can be tested with made-up values.
type privileges struct {
	euid int
	// effective is the effective capability set; capsErr is non-nil when it
	// could not be read, in which case only the euid is judged.
	effective uint64
	capsErr   error
}

// verdict is what RequirePrivileged will do.
type verdict int

const (
	run verdict = iota
	skip
	fail
)

// decide is the whole policy, kept free of side effects so that it can be
// tested without root. It returns what to do and, unless the answer is run,
// a message naming every missing privilege so that a skip in a log explains
// itself.
func decide(p privileges, requireEnv string) (verdict, string) {
	var missing []string
	if p.euid != 0 {
		missing = append(missing, fmt.Sprintf("root (euid is %d)", p.euid))
	}
	if p.capsErr == nil {
		has := func(c uint) bool { return p.effective&(1<<c) != 0 }
		if !has(capNetAdmin) {
			missing = append(missing, "CAP_NET_ADMIN")
		}
		if !has(capSysAdmin) {
			missing = append(missing, "CAP_SYS_ADMIN")
		}
		// The kernel lets CAP_SYS_ADMIN stand in for CAP_BPF, and kernels
		// before 5.8 only know the former; either is enough to load programs.
		if !has(capBPF) && !has(capSysAdmin) {
			missing = append(missing, "CAP_BPF")
		}
	}
	if len(missing) == 0 {
		return run, ""
	}
	msg := "privileged test: missing " + strings.Join(missing, ", ")
	if requireEnv == "1" {
		return fail, msg + " (" + RequireEnv + "=1 makes this a failure)"
	}
	return skip, msg + " (set " + RequireEnv + "=1 to fail instead of skipping)"
}

// current reads the privileges of the calling thread. Capabilities are per
// thread in Linux, but Go never changes them behind our back, so any thread
// is representative.
func current() privileges {
	p := privileges{euid: os.Geteuid()}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	// Version 3 returns two 32-bit halves; the kernel writes both elements.
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		p.capsErr = err
		return p
	}
	p.effective = uint64(data[0].Effective) | uint64(data[1].Effective)<<32
	return p
}

// RequirePrivileged skips tb (or fails it, under FB_REQUIRE_PRIVILEGED=1)
// unless the process can create namespaces, configure links and load BPF.
// Call it first in any test that touches the kernel so the reason for not
// running is stated once, plainly, instead of as an obscure EPERM later.
//
// When the test may run, it also lifts RLIMIT_MEMLOCK: kernels before 5.11
// charge BPF maps against it and refuse even small maps under the default
// limit. Newer kernels ignore it, so a failure there is not reported.
func RequirePrivileged(tb testing.TB) {
	tb.Helper()
	if require(tb, current(), os.Getenv(RequireEnv)) {
		raiseMemlock()
	}
}

// raiseMemlock lifts RLIMIT_MEMLOCK as far as it will go. Raising the hard
// limit needs CAP_SYS_RESOURCE, which containers often withhold from root; then
// the soft limit is at least brought up to the hard one.
func raiseMemlock() {
	inf := unix.Rlimit{Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY}
	if unix.Setrlimit(unix.RLIMIT_MEMLOCK, &inf) == nil {
		return
	}
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) == nil && lim.Cur < lim.Max {
		lim.Cur = lim.Max
		_ = unix.Setrlimit(unix.RLIMIT_MEMLOCK, &lim)
	}
}

// require applies decide to tb and reports whether the test goes on. It is
// separate from RequirePrivileged so the wiring to Skip and Fatal can be
// checked with a fake testing.TB.
func require(tb testing.TB, p privileges, requireEnv string) bool {
	tb.Helper()
	v, msg := decide(p, requireEnv)
	switch v {
	case skip:
		tb.Skip(msg)
		return false
	case fail:
		tb.Fatal(msg)
		return false
	}
	return true
}

// FIFOThreads returns the ids of this process's threads that run
// SCHED_FIFO at priority.
func FIFOThreads(tb testing.TB, priority uint32) []int {
	tb.Helper()
	dirs, err := os.ReadDir("/proc/self/task")
	if err != nil {
		tb.Fatal(err)
	}
	var tids []int
	for _, d := range dirs {
		tid, _ := strconv.Atoi(d.Name())
		if a, err := unix.SchedGetAttr(tid, 0); err == nil && a.Policy == unix.SCHED_FIFO && a.Priority == priority {
			tids = append(tids, tid)
		}
	}
	return tids
}
