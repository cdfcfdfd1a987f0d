package appliance

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/ebpf"
)

// This file clears what a crashed daemon leaves behind, so that a restart
// is never blocked by it: a control socket file nobody listens on and pins
// of interfaces that are gone (an XDP program of ours left attached is
// ebpf.DetachStale's). Everything it removes is provably ours and provably
// dead; anything else is an error that says what is in the way.

// DefaultBPFFS is where the daemon looks for a bpf file system to pin its
// data path in (Options.BPFFS).
const DefaultBPFFS = "/sys/fs/bpf"

// pinRoot is the daemons' directory on the bpf file system at bpffs. A
// daemon pins under pinRoot/NETNS/INTERFACE (pinDir): one directory per
// network namespace and interface, so per daemon.
func pinRoot(bpffs string) string { return filepath.Join(bpffs, "fabricbridge") }

func pinDir(bpffs string, netns uint64, ifname string) string {
	return filepath.Join(pinRoot(bpffs), strconv.FormatUint(netns, 10), ifname)
}

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

// sweepPins removes the pin directories under root whose XDP link attaches
// to nothing any more: their interface (or its whole namespace) was
// deleted, and with it the program's only use. Pins of interfaces that
// exist belong to a daemon, running or to come, and stay.
func sweepPins(root string) ([]string, error) {
	dirs, err := filepath.Glob(filepath.Join(root, "*", "*"))
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, dir := range dirs {
		ifindex, pinned, err := ebpf.PinnedLink(dir)
		if err != nil || !pinned || ifindex != 0 {
			continue
		}
		if _, err := ebpf.RemovePins(dir); err != nil {
			return removed, err
		}
		removed = append(removed, dir)
		os.Remove(filepath.Dir(dir)) // the namespace's directory, once empty
	}
	return removed, nil
}
