package topology

import (
	"time"

	"golang.org/x/sys/unix"
)

// PacketSocket opens an AF_PACKET socket in the namespace that sees every
// frame on the interface ifindex and can write raw frames to it, with a
// 20 ms receive timeout so that readers poll. It is closed when the test ends.
func (n *NS) PacketSocket(tb TB, ifindex int) int {
	tb.Helper()
	proto := uint16(unix.ETH_P_ALL)<<8 | uint16(unix.ETH_P_ALL)>>8 // network order
	var fd int
	if err := n.Do(func() (err error) {
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(proto))
		if err != nil {
			return err
		}
		if err = unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: ifindex, Protocol: proto}); err != nil {
			unix.Close(fd)
		}
		return err
	}); err != nil {
		tb.Fatalf("netns: packet socket on ifindex %d: %v", ifindex, err)
	}
	tv := unix.NsecToTimeval(int64(20 * time.Millisecond))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	tb.Cleanup(func() { unix.Close(fd) })
	return fd
}
