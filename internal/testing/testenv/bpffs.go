package testenv

import (
	"testing"

	"golang.org/x/sys/unix"
)

// BPFFS mounts a bpf file system of the test's own on a fresh directory and
// returns the directory. Whatever the test pins there goes when the test
// ends, failed or not: unmounting the last mount of a bpf file system frees
// its pins, and a pinned XDP link detaches with them. The mount is in the
// test process's mount namespace, so that a daemon the test starts in it or
// under `ip netns exec` (which copies the mounts) pins where the next one
// finds the pins.
func BPFFS(tb testing.TB) string {
	tb.Helper()
	RequirePrivileged(tb)
	dir := tb.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		tb.Fatalf("mount a bpf file system on %s: %v", dir, err)
	}
	// Registered after TempDir's cleanup, so it runs before it.
	tb.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}
