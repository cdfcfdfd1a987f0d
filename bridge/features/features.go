// Package features reads and changes a network interface's features by the
// kernel's names for them, as `ethtool -k` and `ethtool -K` do, through the
// ethtool ioctl's feature interface (ETHTOOL_GSTRINGS for the names,
// ETHTOOL_GFEATURES and ETHTOOL_SFEATURES for the bits): the one interface
// that names every feature, receive offloads and VLAN stripping among them.
// It also reads and sets the interface's queue channels (`ethtool -l`,
// `ethtool -L`), through the same ioctl.
package features

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// From <linux/ethtool.h>, which x/sys/unix does not carry.
const (
	ethSSFeatures = 4  // ETH_SS_FEATURES: the string set of feature names
	ethGStringLen = 32 // ETH_GSTRING_LEN
)

// ErrNoFeatures is returned by Open for a device that names no features.
var ErrNoFeatures = errors.New("the device names no features")

// Interface is one interface's feature table.
type Interface struct {
	fd      int
	name    string
	indices map[string]int // feature name to bit number
	blocks  int            // 32-bit words of feature bits
}

// State is one feature's state.
type State struct {
	Active     bool // on now
	Changeable bool // the device lets it be turned on and off
}

// Open reads the feature names of interface name, in the network namespace
// of the calling thread; later calls may come from any thread.
func Open(name string) (*Interface, error) {
	fd, err := ethtoolSocket(name)
	if err != nil {
		return nil, err
	}
	f := &Interface{fd: fd, name: name}
	if err := f.load(); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return f, nil
}

// ethtoolSocket opens a socket for ethtool requests on interface name, in
// the calling thread's network namespace.
func ethtoolSocket(name string) (int, error) {
	if len(name) >= unix.IFNAMSIZ {
		return -1, fmt.Errorf("features: interface name %q too long", name)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("features: socket: %w", err)
	}
	return fd, nil
}

// Close releases the socket.
func (f *Interface) Close() error { return unix.Close(f.fd) }

// Get reports the state of the named feature.
func (f *Interface) Get(name string) (State, error) {
	i, ok := f.indices[name]
	if !ok {
		return State{}, fmt.Errorf("features: %s has no feature %q", f.name, name)
	}
	blocks, err := f.read()
	if err != nil {
		return State{}, err
	}
	b, bit := blocks[i/32], uint32(1)<<(i%32)
	return State{Active: b.active&bit != 0, Changeable: b.available&bit != 0 && b.neverChanged&bit == 0}, nil
}

// Set turns the named features on or off in one request, then checks that
// each took the state asked for.
func (f *Interface) Set(names []string, on bool) error {
	if len(names) == 0 {
		return nil
	}
	// struct ethtool_sfeatures: cmd, size, then per block valid, requested.
	buf := make([]uint32, 2+2*f.blocks)
	buf[0], buf[1] = unix.ETHTOOL_SFEATURES, uint32(f.blocks)
	for _, name := range names {
		i, ok := f.indices[name]
		if !ok {
			return fmt.Errorf("features: %s has no feature %q", f.name, name)
		}
		buf[2+2*(i/32)] |= 1 << (i % 32)
		if on {
			buf[3+2*(i/32)] |= 1 << (i % 32)
		}
	}
	// A positive return (ETHTOOL_F_WISH and the like) means the kernel did
	// not do all that was asked; the check below names what.
	if err := f.ioctl(unsafe.Pointer(&buf[0])); err != nil {
		return fmt.Errorf("features: %s: ETHTOOL_SFEATURES %v on=%v: %w", f.name, names, on, err)
	}
	runtime.KeepAlive(buf)
	var stuck []string
	for _, name := range names {
		s, err := f.Get(name)
		if err != nil {
			return err
		}
		if s.Active != on {
			stuck = append(stuck, name)
		}
	}
	if len(stuck) > 0 {
		return fmt.Errorf("features: %s: could not turn %v %s", f.name, stuck, onOff(on))
	}
	return nil
}

func onOff(on bool) string {
	if on {
		return "on"
	}
	return "off"
}

type block struct{ available, requested, active, neverChanged uint32 }

// read reads every feature bit.
func (f *Interface) read() ([]block, error) {
	// struct ethtool_gfeatures: cmd, size, then per block available,
	// requested, active, never_changed.
	buf := make([]uint32, 2+4*f.blocks)
	buf[0], buf[1] = unix.ETHTOOL_GFEATURES, uint32(f.blocks)
	if err := f.ioctl(unsafe.Pointer(&buf[0])); err != nil {
		return nil, fmt.Errorf("features: %s: ETHTOOL_GFEATURES: %w", f.name, err)
	}
	runtime.KeepAlive(buf)
	blocks := make([]block, f.blocks)
	for i := range blocks {
		w := buf[2+4*i:]
		blocks[i] = block{w[0], w[1], w[2], w[3]}
	}
	return blocks, nil
}

// load reads the feature names and their bit numbers.
func (f *Interface) load() error {
	// struct ethtool_sset_info: cmd, reserved, sset_mask (u64), data[1].
	var info [6]uint32
	ne := binary.NativeEndian
	infoBytes := unsafe.Slice((*byte)(unsafe.Pointer(&info[0])), len(info)*4)
	ne.PutUint32(infoBytes[0:], unix.ETHTOOL_GSSET_INFO)
	ne.PutUint64(infoBytes[8:], 1<<ethSSFeatures)
	if err := f.ioctl(unsafe.Pointer(&info[0])); err != nil {
		return fmt.Errorf("features: %s: ETHTOOL_GSSET_INFO: %w", f.name, err)
	}
	n := int(ne.Uint32(infoBytes[16:]))
	if ne.Uint64(infoBytes[8:]) == 0 || n == 0 {
		return fmt.Errorf("features: %s: %w", f.name, ErrNoFeatures)
	}
	// struct ethtool_gstrings: cmd, string_set, len, data[len*32].
	buf := make([]uint32, 3+n*ethGStringLen/4)
	buf[0], buf[1], buf[2] = unix.ETHTOOL_GSTRINGS, ethSSFeatures, uint32(n)
	if err := f.ioctl(unsafe.Pointer(&buf[0])); err != nil {
		return fmt.Errorf("features: %s: ETHTOOL_GSTRINGS: %w", f.name, err)
	}
	names := unsafe.Slice((*byte)(unsafe.Pointer(&buf[3])), n*ethGStringLen)
	f.indices = make(map[string]int, n)
	for i := range n {
		s := names[i*ethGStringLen : (i+1)*ethGStringLen]
		if z := bytes.IndexByte(s, 0); z >= 0 {
			s = s[:z]
		}
		f.indices[string(s)] = i
	}
	f.blocks = (n + 31) / 32
	return nil
}

// ifreqData is struct ifreq with its union holding ifr_data, laid out by Go
// so that the pointer is word-aligned (checkptr refuses one written at an
// odd offset of a byte array).
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte
}

// ioctl issues one SIOCETHTOOL request whose data is p.
func (f *Interface) ioctl(p unsafe.Pointer) error {
	var ifr ifreqData
	copy(ifr.name[:], f.name)
	ifr.data = p
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(f.fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	runtime.KeepAlive(p)
	if e != 0 {
		return e
	}
	return nil
}
