package appliance

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// This file clears what a crashed daemon leaves behind, so that a restart
// is never blocked by it: a control socket file nobody listens on and pins
// under PinDir (an XDP program of ours left attached is ebpf.DetachStale's). Everything it removes is provably ours and provably dead; anything
// else is an error that says what is in the way.

// PinDir is where a fabricbridge would pin BPF objects. The daemon pins
// nothing; the directory is swept at start in case an older version or an
// operator left objects there.
const PinDir = "/sys/fs/bpf/fabricbridge"

// runLock is an exclusive flock held for the daemon's lifetime next to its
// control socket. The kernel releases it when the process dies however it
// dies, so holding it proves that any socket file at the path is stale.
type runLock struct{ f *os.File }

func lockRun(socket string) (*runLock, error) {
	if err := os.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
		return nil, err
	}
	path := socket + ".lock"
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			owner, _ := os.ReadFile(path)
			return nil, fmt.Errorf("another fabricbridge (pid %s) runs with control socket %s; a second daemon needs its own control.socket (and reserved_ports and metrics.address)", strings.TrimSpace(string(owner)), socket)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	f.Truncate(0)
	fmt.Fprintf(f, "%d\n", os.Getpid())
	return &runLock{f}, nil
}

func (l *runLock) release() {
	os.Remove(l.f.Name())
	l.f.Close()
}

// removeStaleSocket removes a socket file left by a dead daemon. The caller
// holds the run lock; the extra dial only protects against a process that
// listens on the path without the lock (another program altogether).
func removeStaleSocket(path string) (removed bool, err error) {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return false, fmt.Errorf("%s exists and is not a socket; refusing to remove it", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return false, fmt.Errorf("%s is in use by a process that does not hold %s.lock", path, path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, os.ErrNotExist) {
		return false, fmt.Errorf("probe %s: %w", path, err)
	}
	return true, os.Remove(path)
}

// sweepPins removes BPF objects pinned under PinDir.
func sweepPins() ([]string, error) {
	entries, err := os.ReadDir(PinDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range entries {
		p := filepath.Join(PinDir, e.Name())
		if err := os.RemoveAll(p); err != nil {
			return removed, err
		}
		removed = append(removed, p)
	}
	return removed, nil
}
