package afpacket

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MergingOffloads are the receive offloads (the kernel's feature names;
// ethtool calls rx-lro large-receive-offload) that merge frames before packet
// taps see them: a tap on an interface with any of them on receives
// super-packets of up to 64 KiB that no stream slot holds, and that are not
// the frames on the wire.
var MergingOffloads = []string{"rx-gro", "rx-gro-hw", "rx-lro", "rx-gro-list", "rx-udp-gro-forwarding"}

// Offloads turns an interface's merging offloads off and can turn them back
// on. It uses the ethtool ioctl's feature interface (ETHTOOL_GFEATURES and
// ETHTOOL_SFEATURES), the one that names every feature.
type Offloads struct {
	fd      int
	ifname  string
	turned  []string // features turned off, to turn on again
	indices map[string]int
	blocks  int
}

// DisableMerging turns every feature of MergingOffloads that is on and
// changeable off on ifname, and reports which it turned off (Changed). A
// feature that is on but fixed is an error: the interface would hand the
// tap merged frames. Call it on a thread in the interface's network
// namespace; Restore may then be called from anywhere.
func DisableMerging(ifname string) (*Offloads, error) {
	if len(ifname) >= unix.IFNAMSIZ {
		return nil, fmt.Errorf("afpacket: interface name %q too long", ifname)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("afpacket: ethtool socket: %w", err)
	}
	o := &Offloads{fd: fd, ifname: ifname}
	if err := o.load(); err != nil {
		unix.Close(fd)
		return nil, err
	}
	active, avail, err := o.features()
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	var off []string
	for _, name := range MergingOffloads {
		i, ok := o.indices[name]
		if !ok || !bit(active, i) {
			continue
		}
		if !bit(avail, i) {
			unix.Close(fd)
			return nil, fmt.Errorf("afpacket: %s has %s on and it cannot be turned off", ifname, name)
		}
		off = append(off, name)
	}
	if err := o.set(off, false); err != nil {
		unix.Close(fd)
		return nil, err
	}
	o.turned = off
	return o, nil
}

// Changed lists the features DisableMerging turned off.
func (o *Offloads) Changed() []string { return append([]string(nil), o.turned...) }

// Active reports whether feature name is on now.
func (o *Offloads) Active(name string) (bool, error) {
	i, ok := o.indices[name]
	if !ok {
		return false, fmt.Errorf("afpacket: %s has no feature %q", o.ifname, name)
	}
	active, _, err := o.features()
	return bit(active, i), err
}

// Restore turns back on what DisableMerging turned off, and releases the
// socket.
func (o *Offloads) Restore() error {
	if o.fd < 0 {
		return nil
	}
	err := o.set(o.turned, true)
	unix.Close(o.fd)
	o.fd = -1
	return err
}

// SetFeature turns one named feature on or off (tests use it to make an
// interface merge).
func (o *Offloads) SetFeature(name string, on bool) error { return o.set([]string{name}, on) }

func bit(words []uint32, i int) bool { return words[i/32]&(1<<(i%32)) != 0 }

// ethtool issues one SIOCETHTOOL request whose data is p.
func (o *Offloads) ethtool(p unsafe.Pointer) error {
	var ifr [40]byte
	copy(ifr[:unix.IFNAMSIZ-1], o.ifname)
	*(*unsafe.Pointer)(unsafe.Pointer(&ifr[16])) = p
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(o.fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	runtime.KeepAlive(p)
	if e != 0 {
		return e
	}
	return nil
}

const ethSSFeatures = 4 // ETH_SS_FEATURES
const ethGStringLen = 32

// load reads the feature names and their bit numbers.
func (o *Offloads) load() error {
	// struct ethtool_sset_info: cmd, reserved, sset_mask (u64), data[1].
	var info [24]byte
	ne := binary.NativeEndian
	ne.PutUint32(info[0:], unix.ETHTOOL_GSSET_INFO)
	ne.PutUint64(info[8:], 1<<ethSSFeatures)
	if err := o.ethtool(unsafe.Pointer(&info[0])); err != nil {
		return fmt.Errorf("afpacket: %s: ETHTOOL_GSSET_INFO: %w", o.ifname, err)
	}
	if ne.Uint64(info[8:]) == 0 {
		return fmt.Errorf("afpacket: %s reports no feature names", o.ifname)
	}
	n := int(ne.Uint32(info[16:]))
	// struct ethtool_gstrings: cmd, string_set, len, data[len*32].
	buf := make([]byte, 12+n*ethGStringLen)
	ne.PutUint32(buf[0:], unix.ETHTOOL_GSTRINGS)
	ne.PutUint32(buf[4:], ethSSFeatures)
	ne.PutUint32(buf[8:], uint32(n))
	if err := o.ethtool(unsafe.Pointer(&buf[0])); err != nil {
		return fmt.Errorf("afpacket: %s: ETHTOOL_GSTRINGS: %w", o.ifname, err)
	}
	o.indices = make(map[string]int, n)
	for i := range n {
		s := buf[12+i*ethGStringLen : 12+(i+1)*ethGStringLen]
		if z := bytes.IndexByte(s, 0); z >= 0 {
			s = s[:z]
		}
		o.indices[string(s)] = i
	}
	o.blocks = (n + 31) / 32
	return nil
}

// features reads the active and the changeable feature bits.
func (o *Offloads) features() (active, avail []uint32, err error) {
	// struct ethtool_gfeatures: cmd, size, then per block available,
	// requested, active, never_changed.
	buf := make([]byte, 8+16*o.blocks)
	ne := binary.NativeEndian
	ne.PutUint32(buf[0:], unix.ETHTOOL_GFEATURES)
	ne.PutUint32(buf[4:], uint32(o.blocks))
	if err := o.ethtool(unsafe.Pointer(&buf[0])); err != nil {
		return nil, nil, fmt.Errorf("afpacket: %s: ETHTOOL_GFEATURES: %w", o.ifname, err)
	}
	active, avail = make([]uint32, o.blocks), make([]uint32, o.blocks)
	for b := range o.blocks {
		avail[b] = ne.Uint32(buf[8+16*b:])
		active[b] = ne.Uint32(buf[8+16*b+8:])
	}
	return active, avail, nil
}

// set turns the named features on or off in one request.
func (o *Offloads) set(names []string, on bool) error {
	if len(names) == 0 {
		return nil
	}
	// struct ethtool_sfeatures: cmd, size, then per block valid, requested.
	buf := make([]byte, 8+8*o.blocks)
	ne := binary.NativeEndian
	ne.PutUint32(buf[0:], unix.ETHTOOL_SFEATURES)
	ne.PutUint32(buf[4:], uint32(o.blocks))
	for _, name := range names {
		i, ok := o.indices[name]
		if !ok {
			return fmt.Errorf("afpacket: %s has no feature %q", o.ifname, name)
		}
		off := 8 + 8*(i/32)
		ne.PutUint32(buf[off:], ne.Uint32(buf[off:])|1<<(i%32))
		if on {
			ne.PutUint32(buf[off+4:], ne.Uint32(buf[off+4:])|1<<(i%32))
		}
	}
	// A positive return (ETHTOOL_F_WISH etc.) means the kernel could not do
	// everything asked; the caller checks with Active where it matters.
	if err := o.ethtool(unsafe.Pointer(&buf[0])); err != nil {
		return fmt.Errorf("afpacket: %s: ETHTOOL_SFEATURES %v on=%v: %w", o.ifname, names, on, err)
	}
	active, _, err := o.features()
	if err != nil {
		return err
	}
	var stuck []string
	for _, name := range names {
		if bit(active, o.indices[name]) != on {
			stuck = append(stuck, name)
		}
	}
	if len(stuck) > 0 {
		return errors.New("afpacket: " + o.ifname + ": could not turn " + fmt.Sprint(stuck) + fmt.Sprintf(" %v", map[bool]string{true: "on", false: "off"}[on]))
	}
	return nil
}
