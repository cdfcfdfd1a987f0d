package ebpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DetachStale removes a fabricbridge XDP program that a dead process left
// attached to interface ifindex through netlink, which outlives its
// process (unlike the BPF link Attach uses). It reports whether it removed
// something. The interface is looked up in the calling thread's network
// namespace.
//
// A program attached through a BPF link belongs to a live process or to a
// pin (a daemon stopped for a restart leaves one, see Program.Leave): the
// kernel refuses to replace it, and DetachStale returns an error that says
// so. So it does for a program of another name, which is not ours to
// remove.
func DetachStale(ifindex int) (removed bool, err error) {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return false, fmt.Errorf("interface %d: %w", ifindex, err)
	}
	ifname := l.Attrs().Name
	x := l.Attrs().Xdp
	if x == nil || !x.Attached || x.ProgId == 0 {
		return false, nil
	}
	name := fmt.Sprintf("id %d", x.ProgId)
	if p, err := ebpf.NewProgramFromID(ebpf.ProgramID(x.ProgId)); err == nil {
		if info, err := p.Info(); err == nil {
			name = fmt.Sprintf("%q (id %d)", info.Name, x.ProgId)
			if info.Name != kernelName(bpfProgFabricbridge) {
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
			return false, fmt.Errorf("interface %s: XDP program %s is attached through a BPF link, held by a running process or pinned in a bpf file system; stop the process, or remove the pin (a stopped daemon's: fabricbridge release)", ifname, name)
		}
		return false, fmt.Errorf("interface %s: detach stale XDP program %s: %w", ifname, name, err)
	}
	return true, nil
}

// kernelName is a program's name as the kernel reports it: the C function's
// name, cut to BPF_OBJ_NAME_LEN-1 bytes.
func kernelName(fn string) string { return fn[:min(len(fn), unix.BPF_OBJ_NAME_LEN-1)] }

// IFLA_XDP_ATTACHED values (linux/if_link.h), which x/sys/unix lacks.
const (
	xdpAttachedDrv = 1
	xdpAttachedSKB = 2
	xdpAttachedHW  = 3
)
