package ethtool

import (
	"errors"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// SetOffloads turns the segmentation and checksum offloads of an interface
// on or off together: transmit checksum, scatter-gather, TSO, GSO and GRO,
// like `ethtool -K name tx on|off sg on|off tso on|off gso on|off gro
// on|off`. Benchmarks use it to compare a user-space stack, which gets no
// offload from the kernel, with the kernel's stack with and without them.
// Features the device cannot change (EOPNOTSUPP) are skipped: a veth whose
// peer runs an XDP program, for one, has no TSO to turn on or off.
func SetOffloads(ns *topology.NS, name string, on bool) error {
	v := uint32(0)
	if on {
		v = 1
	}
	// Order matters turning on: TSO needs scatter-gather and checksums.
	cmds := []uint32{unix.ETHTOOL_STXCSUM, unix.ETHTOOL_SSG, unix.ETHTOOL_STSO, unix.ETHTOOL_SGSO, unix.ETHTOOL_SGRO}
	if !on {
		cmds = []uint32{unix.ETHTOOL_SGRO, unix.ETHTOOL_SGSO, unix.ETHTOOL_STSO, unix.ETHTOOL_SSG, unix.ETHTOOL_STXCSUM}
	}
	return ns.Do(func() error {
		for _, cmd := range cmds {
			if _, err := ethtoolValue(name, cmd, v); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
				return err
			}
		}
		return nil
	})
}
