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

	cebpf "github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// This file clears what a crashed daemon leaves behind, so that a restart
// is never blocked by it: a control socket file nobody listens on, an XDP
// program of ours attached the old way (through netlink, which outlives its
// process, unlike the BPF link the loader uses now), and pins under
// PinDir. Everything it removes is provably ours and provably dead; anything
// else is an error that says what is in the way.

// PinDir is where a fabricbridge would pin BPF objects. The daemon pins
// nothing; the directory is swept at start in case an older version or an
// operator left objects there.
const PinDir = "/sys/fs/bpf/fabricbridge"

// progName is the XDP program's name as the kernel reports it (the C
// function name, at most 15 bytes).
const progName = "fabricbridge"

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
			return nil, fmt.Errorf("another fabricbridge (pid %s) runs with control socket %s", strings.TrimSpace(string(owner)), socket)
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

// clearStaleXDP removes an XDP program of ours that a dead process left
// attached to the interface through netlink. A program attached through a
// BPF link belongs to a live process (links die with their owner) and the
// kernel refuses to replace it; a program of another name is not ours.
// It reports whether it removed something.
func clearStaleXDP(ifname string) (bool, error) {
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		return false, fmt.Errorf("interface %s: %w", ifname, err)
	}
	x := l.Attrs().Xdp
	if x == nil || !x.Attached || x.ProgId == 0 {
		return false, nil
	}
	name := fmt.Sprintf("id %d", x.ProgId)
	if p, err := cebpf.NewProgramFromID(cebpf.ProgramID(x.ProgId)); err == nil {
		if info, err := p.Info(); err == nil {
			name = fmt.Sprintf("%q (id %d)", info.Name, x.ProgId)
			if info.Name != progName {
				p.Close()
				return false, fmt.Errorf("interface %s already runs another XDP program %s; fabricbridge will not replace it", ifname, name)
			}
		}
		p.Close()
	}
	var flags int
	switch x.AttachMode {
	case xdpAttachedDrv:
		flags = unix.XDP_FLAGS_DRV_MODE
	case xdpAttachedSKB:
		flags = unix.XDP_FLAGS_SKB_MODE
	case xdpAttachedHW:
		flags = unix.XDP_FLAGS_HW_MODE
	}
	if err := netlink.LinkSetXdpFdWithFlags(l, -1, flags); err != nil {
		if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("interface %s: XDP program %s is attached by a running process (a BPF link); stop it first", ifname, name)
		}
		return false, fmt.Errorf("interface %s: detach stale XDP program %s: %w", ifname, name, err)
	}
	return true, nil
}

// IFLA_XDP_ATTACHED values (linux/if_link.h), which x/sys/unix lacks.
const (
	xdpAttachedDrv = 1
	xdpAttachedSKB = 2
	xdpAttachedHW  = 3
)

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
