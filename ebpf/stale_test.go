package ebpf

import (
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestDetachStale: DetachStale removes our program left attached through
// netlink by a process that is gone, and refuses, leaving it attached,
// ours held by a live process's BPF link and anyone else's.
func TestDetachStale(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns, _, v := topology.Pair(t, topology.VethOptions{})
	ifname := v.A.Name
	attached := func() bool {
		var x *netlink.LinkXdp
		ns.Do(func() error {
			l, err := netlink.LinkByName(ifname)
			if err == nil {
				x = l.Attrs().Xdp
			}
			return err
		})
		return x != nil && x.Attached
	}
	netlinkAttach := func(p *ebpf.Program) {
		t.Helper()
		if err := ns.Do(func() error {
			l, err := netlink.LinkByName(ifname)
			if err != nil {
				return err
			}
			return netlink.LinkSetXdpFdWithFlags(l, p.FD(), unix.XDP_FLAGS_SKB_MODE)
		}); err != nil {
			t.Fatal(err)
		}
	}
	clear := func() (removed bool, err error) {
		ns.Do(func() error {
			removed, err = DetachStale(v.A.Index)
			return nil
		})
		return
	}

	// Nothing attached: nothing to do.
	if removed, err := clear(); removed || err != nil {
		t.Fatalf("clean interface: %v, %v", removed, err)
	}

	// Ours, attached through netlink by a process that is gone (the
	// program is closed here; the attachment keeps it alive).
	prog, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	netlinkAttach(prog.Program())
	prog.Close()
	if !attached() {
		t.Fatal("setup: program not attached")
	}
	if removed, err := clear(); !removed || err != nil {
		t.Fatalf("stale program: removed %v, %v", removed, err)
	}
	if attached() {
		t.Fatal("stale program still attached")
	}

	// Ours, attached through a BPF link by a live process: refused.
	prog, err = Load()
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	if err := ns.Do(func() error { _, err := prog.Attach(v.A.Index, ModeGeneric); return err }); err != nil {
		t.Fatal(err)
	}
	if _, err := clear(); err == nil || !strings.Contains(err.Error(), "running process") {
		t.Errorf("live link: %v", err)
	}
	prog.Detach()

	// Someone else's program: refused, left attached.
	other, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "operators_prog", Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	netlinkAttach(other)
	other.Close()
	if _, err := clear(); err == nil || !strings.Contains(err.Error(), `another XDP program "operators_prog"`) {
		t.Errorf("foreign program: %v", err)
	}
	if !attached() {
		t.Error("foreign program was removed")
	}
}
