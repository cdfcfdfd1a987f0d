// Package ethtool changes interface offloads the way `ethtool -K` does, for
// topologies of veth pairs that stand in for a wire.
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

	"github.com/fabricbridge/fabricbridge/internal/netns"
)

// DisableTxChecksum is `ethtool -K name tx off` inside ns.
func DisableTxChecksum(ns *netns.NS, name string) error {
	return ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ev := struct{ cmd, data uint32 }{unix.ETHTOOL_STXCSUM, 0}
		var ifr [40]byte // struct ifreq: name, then a pointer to the command
		copy(ifr[:unix.IFNAMSIZ-1], name)
		*(*unsafe.Pointer)(unsafe.Pointer(&ifr[unix.IFNAMSIZ])) = unsafe.Pointer(&ev)
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); e != 0 {
			return fmt.Errorf("ethtool: ETHTOOL_STXCSUM off on %s: %w", name, e)
		}
		runtime.KeepAlive(&ev)
		return nil
	})
}

// TxChecksum reports whether transmit checksum offload is on.
func TxChecksum(ns *netns.NS, name string) (on bool, err error) {
	err = ns.Do(func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ev := struct{ cmd, data uint32 }{unix.ETHTOOL_GTXCSUM, 0}
		var ifr [40]byte
		copy(ifr[:unix.IFNAMSIZ-1], name)
		*(*unsafe.Pointer)(unsafe.Pointer(&ifr[unix.IFNAMSIZ])) = unsafe.Pointer(&ev)
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr))); e != 0 {
			return fmt.Errorf("ethtool: ETHTOOL_GTXCSUM on %s: %w", name, e)
		}
		runtime.KeepAlive(&ev)
		on = ev.data != 0
		return nil
	})
	return on, err
}
