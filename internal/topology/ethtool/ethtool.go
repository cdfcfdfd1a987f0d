// Package ethtool changes interface offloads the way `ethtool -K` does, on
// the veths of a topology (package topology) that stand in for a wire. Like
// topology, tests and `fabricbridge demo` use it.
//
// A veth with transmit checksum offload hands its peer packets whose TCP and
// UDP checksums are only partial: fine for the peer's kernel, which knows,
// but AF_XDP copies the bytes as they are, so a user-space stack behind the
// bridge sees wrong checksums. A real NIC puts complete checksums on the
// wire; turning the offload off on the outside end of the veth does the same.
package ethtool

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// DisableTxChecksum is `ethtool -K name tx off` inside ns.
func DisableTxChecksum(ns *topology.NS, name string) error {
	return ns.Do(func() error {
		_, err := ethtoolValue(name, unix.ETHTOOL_STXCSUM, 0)
		return err
	})
}

// TxChecksum reports whether transmit checksum offload is on.
func TxChecksum(ns *topology.NS, name string) (on bool, err error) {
	err = ns.Do(func() error {
		v, err := ethtoolValue(name, unix.ETHTOOL_GTXCSUM, 0)
		on = v != 0
		return err
	})
	return on, err
}

// ifreqData is struct ifreq with its union used as a pointer, laid out with
// Go's own alignment so the pointer field is word-aligned (the race detector's
// checkptr refuses a pointer written at an odd offset of a byte array).
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte
}

// ethtoolValue runs one struct ethtool_value command (a get or a set) on the
// interface in the calling thread's namespace and returns the value field.
func ethtoolValue(name string, cmd, value uint32) (uint32, error) {
	if len(name) >= unix.IFNAMSIZ {
		return 0, fmt.Errorf("ethtool: interface name %q too long", name)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	ev := struct{ cmd, data uint32 }{cmd, value}
	var ifr ifreqData
	copy(ifr.name[:], name)
	ifr.data = unsafe.Pointer(&ev)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); e != 0 {
		return 0, fmt.Errorf("ethtool: command %#x on %s: %w", cmd, name, e)
	}
	runtime.KeepAlive(&ev)
	return ev.data, nil
}
