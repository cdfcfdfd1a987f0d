package features

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Channels are an interface's queue channels, as `ethtool -l` shows them:
// the most the device can have and how many it uses now. A channel is a
// queue or a group of queues served by one interrupt; drivers count
// receive-and-transmit pairs as combined channels, lone ones as RX or TX.
type Channels struct {
	MaxRx, MaxTx, MaxOther, MaxCombined uint32
	Rx, Tx, Other, Combined             uint32
}

// RxQueues is how many receive queues the channels in use give: queues
// 0 to RxQueues-1 receive frames.
func (c Channels) RxQueues() int { return int(c.Rx + c.Combined) }

// TxQueues is how many transmit queues the channels in use give.
func (c Channels) TxQueues() int { return int(c.Tx + c.Combined) }

// Device is an ethtool socket for one interface, opened in the network
// namespace of the thread that opened it; its methods may then be called
// from any thread, since the kernel looks the interface up in the socket's
// namespace.
type Device struct {
	f Interface // only fd and name: the channel commands need no feature names
}

// OpenDevice opens an ethtool socket for interface name.
func OpenDevice(name string) (*Device, error) {
	fd, err := ethtoolSocket(name)
	if err != nil {
		return nil, err
	}
	return &Device{f: Interface{fd: fd, name: name}}, nil
}

// Close releases the socket.
func (d *Device) Close() error { return unix.Close(d.f.fd) }

// channelsCmd is struct ethtool_channels: the command, then the counts in
// the order Channels lists them.
type channelsCmd struct {
	cmd uint32
	c   Channels
}

// Channels reads the channels with ETHTOOL_GCHANNELS. A driver that does
// not report channels fails with an error that wraps unix.EOPNOTSUPP.
func (d *Device) Channels() (Channels, error) {
	buf := channelsCmd{cmd: unix.ETHTOOL_GCHANNELS}
	if err := d.f.ioctl(unsafe.Pointer(&buf)); err != nil {
		return Channels{}, fmt.Errorf("features: %s: ETHTOOL_GCHANNELS: %w", d.f.name, err)
	}
	return buf.c, nil
}

// SetChannels sets the channels in use, as `ethtool -L` does; the maxima
// in c are ignored.
func (d *Device) SetChannels(c Channels) error {
	cur, err := d.Channels()
	if err != nil {
		return err
	}
	c.MaxRx, c.MaxTx, c.MaxOther, c.MaxCombined = cur.MaxRx, cur.MaxTx, cur.MaxOther, cur.MaxCombined
	buf := channelsCmd{cmd: unix.ETHTOOL_SCHANNELS, c: c}
	if err := d.f.ioctl(unsafe.Pointer(&buf)); err != nil {
		return fmt.Errorf("features: %s: ETHTOOL_SCHANNELS rx %d tx %d combined %d: %w", d.f.name, c.Rx, c.Tx, c.Combined, err)
	}
	return nil
}
