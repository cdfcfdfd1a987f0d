package bridge

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// From <linux/ethtool.h>, which x/sys/unix does not carry.
const (
	ethSSFeatures = 4  // ETH_SS_FEATURES: the string set of feature names
	ethGStringLen = 32 // ETH_GSTRING_LEN
)

// vlanStripFeatures are the kernel's names of the receive stripping features.
var vlanStripFeatures = []string{"rx-vlan-hw-parse", "rx-vlan-stag-hw-parse"}

// tablesMatchVLAN reports whether any rule matches on a VLAN id.
func tablesMatchVLAN(t *classifier.Tables) bool {
	for _, r := range t.Rules() {
		if r.VLAN != 0 {
			return true
		}
	}
	return false
}

// keepVLANTags makes sure the interface hands XDP its frames with their VLAN
// tags, once the tables need them. Called with b.mu held.
func (b *Bridge) keepVLANTags(t *classifier.Tables) {
	if b.prog == nil || b.vlanChecked || !tablesMatchVLAN(t) {
		return
	}
	b.vlanChecked = true
	feats, err := readFeatures(b.ethfd, b.cfg.Interface)
	if err != nil {
		// A device without ethtool features (no such ioctl) strips nothing.
		if !errors.Is(err, unix.EOPNOTSUPP) {
			b.log.Warn("bridge: cannot read the interface's VLAN stripping; rules on VLAN ids may not match", "interface", b.cfg.Interface, "err", err)
		}
		return
	}
	var off []string
	for _, name := range vlanStripFeatures {
		f, ok := feats.get(name)
		if !ok || !f.active {
			continue
		}
		if !f.changeable {
			b.vlanBlind.Store(true)
			b.log.Warn("bridge: the interface strips VLAN tags and cannot stop: rules on VLAN ids will not match", "interface", b.cfg.Interface, "feature", name)
			continue
		}
		off = append(off, name)
	}
	if len(off) == 0 {
		return
	}
	if err := feats.set(b.ethfd, b.cfg.Interface, off, false); err != nil {
		b.vlanBlind.Store(true)
		b.log.Warn("bridge: cannot turn the interface's VLAN stripping off: rules on VLAN ids will not match", "interface", b.cfg.Interface, "features", off, "err", err)
		return
	}
	b.vlanRestore = off
	b.log.Info("bridge: turned VLAN stripping off so that XDP sees VLAN tags (restored at close)", "interface", b.cfg.Interface, "features", off)
}

// restoreVLANStripping turns back on what keepVLANTags turned off.
func (b *Bridge) restoreVLANStripping() error {
	if len(b.vlanRestore) == 0 {
		return nil
	}
	feats, err := readFeatures(b.ethfd, b.cfg.Interface)
	if err == nil {
		err = feats.set(b.ethfd, b.cfg.Interface, b.vlanRestore, true)
	}
	if err != nil {
		return fmt.Errorf("bridge: restoring VLAN stripping on %s: %w", b.cfg.Interface, err)
	}
	b.vlanRestore = nil
	return nil
}

// featureSet is an interface's ethtool feature table: the names of the
// feature bits and their state, in the kernel's 32-bit blocks.
type featureSet struct {
	names  []string
	blocks []featureBlock
}

type featureBlock struct{ available, requested, active, neverChanged uint32 }

type featureState struct{ active, changeable bool }

func (fs *featureSet) get(name string) (featureState, bool) {
	for i, n := range fs.names {
		if n == name {
			b := fs.blocks[i/32]
			bit := uint32(1) << (i % 32)
			return featureState{
				active:     b.active&bit != 0,
				changeable: b.available&bit != 0 && b.neverChanged&bit == 0,
			}, true
		}
	}
	return featureState{}, false
}

// set requests the named features on or off and checks that the device took
// the request.
func (fs *featureSet) set(fd int, ifname string, names []string, on bool) error {
	type change struct{ valid, requested uint32 }
	changes := make([]change, len(fs.blocks))
	for _, name := range names {
		i := -1
		for j, n := range fs.names {
			if n == name {
				i = j
			}
		}
		if i < 0 {
			return fmt.Errorf("no feature %q", name)
		}
		changes[i/32].valid |= 1 << (i % 32)
		if on {
			changes[i/32].requested |= 1 << (i % 32)
		}
	}
	buf := make([]uint32, 2+2*len(changes))
	buf[0], buf[1] = unix.ETHTOOL_SFEATURES, uint32(len(changes))
	for i, c := range changes {
		buf[2+2*i], buf[3+2*i] = c.valid, c.requested
	}
	if err := ethtoolIoctl(fd, ifname, unix.ETHTOOL_SFEATURES, unsafe.Pointer(&buf[0])); err != nil {
		return err
	}
	runtime.KeepAlive(buf)
	now, err := readFeatures(fd, ifname)
	if err != nil {
		return err
	}
	for _, name := range names {
		if f, _ := now.get(name); f.active != on {
			return fmt.Errorf("%s did not change", name)
		}
	}
	*fs = *now
	return nil
}

// readFeatures reads the interface's feature names and state through fd, a
// datagram socket in the interface's network namespace.
func readFeatures(fd int, ifname string) (*featureSet, error) {
	// How many features the device has.
	info := struct {
		cmd, reserved uint32
		mask          uint64
		count         uint32
	}{cmd: unix.ETHTOOL_GSSET_INFO, mask: 1 << ethSSFeatures}
	if err := ethtoolIoctl(fd, ifname, unix.ETHTOOL_GSSET_INFO, unsafe.Pointer(&info)); err != nil {
		return nil, err
	}
	runtime.KeepAlive(&info)
	if info.mask == 0 || info.count == 0 {
		return nil, unix.EOPNOTSUPP
	}
	n := int(info.count)

	// Their names: 12 bytes of header, then 32 bytes per name.
	strs := make([]uint32, 3+n*ethGStringLen/4)
	strs[0], strs[1], strs[2] = unix.ETHTOOL_GSTRINGS, ethSSFeatures, uint32(n)
	if err := ethtoolIoctl(fd, ifname, unix.ETHTOOL_GSTRINGS, unsafe.Pointer(&strs[0])); err != nil {
		return nil, err
	}
	runtime.KeepAlive(strs)
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&strs[3])), n*ethGStringLen)
	fs := &featureSet{names: make([]string, n), blocks: make([]featureBlock, (n+31)/32)}
	for i := range n {
		s := raw[i*ethGStringLen : (i+1)*ethGStringLen]
		if z := bytes.IndexByte(s, 0); z >= 0 {
			s = s[:z]
		}
		fs.names[i] = string(s)
	}

	// Their state, 32 features per block.
	get := make([]uint32, 2+4*len(fs.blocks))
	get[0], get[1] = unix.ETHTOOL_GFEATURES, uint32(len(fs.blocks))
	if err := ethtoolIoctl(fd, ifname, unix.ETHTOOL_GFEATURES, unsafe.Pointer(&get[0])); err != nil {
		return nil, err
	}
	runtime.KeepAlive(get)
	for i := range fs.blocks {
		w := get[2+4*i:]
		fs.blocks[i] = featureBlock{w[0], w[1], w[2], w[3]}
	}
	return fs, nil
}

// ifreqData is struct ifreq with its union holding ifr_data, laid out by Go
// so that the pointer is word-aligned (checkptr refuses one at an odd offset
// of a byte array).
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte
}

// ethtoolIoctl runs one ethtool command; arg points at its struct, whose
// first word is cmd.
func ethtoolIoctl(fd int, ifname string, cmd uint32, arg unsafe.Pointer) error {
	if len(ifname) >= unix.IFNAMSIZ {
		return fmt.Errorf("interface name %q too long", ifname)
	}
	var ifr ifreqData
	copy(ifr.name[:], ifname)
	ifr.data = arg
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	if e != 0 {
		return fmt.Errorf("ethtool command %#x on %s: %w", cmd, ifname, e)
	}
	return nil
}
