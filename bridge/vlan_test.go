package bridge

import (
	"bytes"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	ciliumebpf "github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// The VLAN of the VLAN tests, and its subnet: another 198.18.0.0/15 subnet
// than the rig's, which lives only in the test's namespaces.
const (
	testVID  = 10
	vlanMark = 0x7a6 // SO_MARK of the outside socket whose packets the emulated VLAN device tags
)

var (
	vlanLocal  = netip.MustParseAddr("198.19.254.1") // the bridge host's VLAN address, owned by stream 1
	vlanRemote = netip.MustParseAddr("198.19.254.2") // the outside host's VLAN address
	vlanNet    = netip.MustParsePrefix("198.19.254.0/24")
)

// vlanEmulation stands in, on the outside end, for a VLAN device (this
// kernel has no CONFIG_VLAN_8021Q): a TCX egress program tags, in the
// frame, the packets of sockets marked vlanMark with VLAN testVID, and a
// TCX ingress program counts frames tagged testVID and pops the tag, so
// that the outside kernel's IP stack gets them as a VLAN device would.
type vlanEmulation struct {
	counts *ciliumebpf.Map // 0: frames tagged on egress; 1: tagged frames received
}

func newVLANEmulation(t *testing.T, ns *topology.NS, ifindex int) *vlanEmulation {
	t.Helper()
	m, err := ciliumebpf.NewMap(&ciliumebpf.MapSpec{Type: ciliumebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	count := func(key int32, next string) asm.Instructions {
		return asm.Instructions{
			asm.StoreImm(asm.RFP, -4, int64(key), asm.Word),
			asm.LoadMapPtr(asm.R1, m.FD()),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, next),
			asm.Mov.Imm(asm.R1, 1),
			asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		}
	}
	// Egress: room for 4 bytes after the Ethernet header, then the tag
	// (TPID 0x8100, TCI) and the IPv4 EtherType written from offset 12.
	egress := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R1, 8, asm.Word), // __sk_buff.mark
		asm.JNE.Imm(asm.R2, vlanMark, "out"),
		asm.Mov.Imm(asm.R2, 4),
		asm.Mov.Imm(asm.R3, 1), // BPF_ADJ_ROOM_MAC
		asm.Mov.Imm(asm.R4, 0),
		asm.FnSkbAdjustRoom.Call(),
		asm.JNE.Imm(asm.R0, 0, "out"),
		asm.StoreImm(asm.RFP, -8, int64(0x81|testVID<<24), asm.Word), // 81 00 00 0a
		asm.StoreImm(asm.RFP, -4, 0x0008, asm.Half),                  // 08 00
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Imm(asm.R2, 12),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, -8),
		asm.Mov.Imm(asm.R4, 6),
		asm.Mov.Imm(asm.R5, 0),
		asm.FnSkbStoreBytes.Call(),
	}
	egress = append(egress, count(0, "out")...)
	egress = append(egress, asm.Mov.Imm(asm.R0, 0).WithSymbol("out"), asm.Return()) // TCX_PASS
	// Ingress: the kernel has moved the tag into the skb (vlan_tci).
	ingress := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R1, 24, asm.Word), // __sk_buff.vlan_tci
		asm.And.Imm(asm.R2, 0xfff),
		asm.JNE.Imm(asm.R2, testVID, "out"),
	}
	ingress = append(ingress, count(1, "pop")...)
	ingress = append(ingress,
		asm.Mov.Reg(asm.R1, asm.R6).WithSymbol("pop"),
		asm.FnSkbVlanPop.Call(),
		asm.Mov.Imm(asm.R0, 0).WithSymbol("out"),
		asm.Return(),
	)
	for _, p := range []struct {
		insns  asm.Instructions
		attach ciliumebpf.AttachType
	}{{egress, ciliumebpf.AttachTCXEgress}, {ingress, ciliumebpf.AttachTCXIngress}} {
		prog, err := ciliumebpf.NewProgram(&ciliumebpf.ProgramSpec{Type: ciliumebpf.SchedCLS, License: "MIT", Instructions: p.insns})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { prog.Close() })
		var l link.Link
		if err := ns.Do(func() (err error) {
			l, err = link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: p.attach})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
	}
	return &vlanEmulation{counts: m}
}

func (e *vlanEmulation) count(key uint32) uint64 {
	var n uint64
	e.counts.Lookup(key, &n)
	return n
}

// fakeVLANIndex is the interface index of the emulated VLAN device on the
// bridge's side: no device has it.
const fakeVLANIndex = 1 << 20

// emulateVLANDevice gives the bridge's resolver, the way netlink would, a
// VLAN device (id testVID, on the served interface, with mtu), a route to
// vlanNet through it, and the outside's address on it as a neighbour. The
// kernel of this machine has no 802.1Q devices, so the route lookup for
// vlanNet is answered here; everything else still asks the kernel.
func (r *rig) emulateVLANDevice(mtu int) {
	res := r.b.res
	res.mu.Lock()
	res.applyLink(unix.RTM_NEWLINK, &netlink.Vlan{
		LinkAttrs: netlink.LinkAttrs{Index: fakeVLANIndex, ParentIndex: r.v.A.Index, MTU: mtu, Name: "emulated.10"},
		VlanId:    testVID, VlanProtocol: netlink.VLAN_PROTOCOL_8021Q,
	})
	res.apply(unix.RTM_NEWNEIGH, &netlink.Neigh{LinkIndex: fakeVLANIndex, IP: vlanRemote.AsSlice(), HardwareAddr: r.v.B.MAC, State: netlink.NUD_PERMANENT})
	kernel := res.h.RouteGet
	res.routeGet = func(dst net.IP) ([]netlink.Route, error) {
		if a, ok := netip.AddrFromSlice(dst); ok && vlanNet.Contains(a.Unmap()) {
			return []netlink.Route{{LinkIndex: fakeVLANIndex, Type: unix.RTN_UNICAST}}, nil
		}
		return kernel(dst)
	}
	clear(res.routes)
	res.mu.Unlock()
	res.gen.Add(1)
}

// TestVLANTagged: the route to a destination goes through a VLAN device on
// the served interface. Frames to it leave tagged, straight from the
// bridge, and the outside kernel's UDP socket gets each datagram
// byte-exact; tagged frames from the outside kernel's UDP socket reach the
// stream without their tag, byte-exact; a packet that fits the interface's
// MTU but not the VLAN device's is rejected as too long.
//
// The "kernel" variant uses real VLAN devices on both ends; it needs
// CONFIG_VLAN_8021Q and is skipped, saying so, without it. The "emulated"
// variant runs everywhere: on the outside a TCX program pair does what a
// VLAN device does (tag on egress, untag on ingress), and the bridge's
// resolver is handed the VLAN device, its neighbour and the route as
// netlink would report them (see emulateVLANDevice).
func TestVLANTagged(t *testing.T) {
	forEachPath(t, func(t *testing.T, cfg Config) {
		t.Run("emulated", func(t *testing.T) { testVLAN(t, cfg, false) })
		t.Run("kernel", func(t *testing.T) { testVLAN(t, cfg, true) })
	})
}

func testVLAN(t *testing.T, cfg Config, kernel bool) {
	r := newRig(t, cfg)
	r.standardTables()
	own := r.ownership1()
	own.Addrs = append(own.Addrs, vlanLocal)
	app := r.stream(1, own, fabric.Config{})
	var emu *vlanEmulation
	const vlanMTU = 1400
	if kernel {
		if err := addVLANDevice(r.out, r.v.B.Name, netip.PrefixFrom(vlanRemote, vlanNet.Bits()), 1500); err != nil {
			if errors.Is(err, unix.EOPNOTSUPP) || strings.Contains(err.Error(), "not supported") {
				t.Skipf("this kernel has no 802.1Q VLAN devices (CONFIG_VLAN_8021Q): %v; the emulated variant covers the bridge", err)
			}
			t.Fatal(err)
		}
		if err := addVLANDevice(r.br, r.v.A.Name, netip.PrefixFrom(vlanLocal, vlanNet.Bits()), vlanMTU); err != nil {
			t.Fatal(err)
		}
	} else {
		emu = newVLANEmulation(t, r.out, r.v.B.Index)
		if err := r.out.Do(func() error {
			l, err := netlink.LinkByIndex(r.v.B.Index)
			if err != nil {
				return err
			}
			if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: vlanRemote.AsSlice(), Mask: net.CIDRMask(vlanNet.Bits(), 32)}}); err != nil {
				return err
			}
			return netlink.NeighAdd(&netlink.Neigh{LinkIndex: r.v.B.Index, IP: vlanLocal.AsSlice(), HardwareAddr: r.v.A.MAC, State: netlink.NUD_PERMANENT})
		}); err != nil {
			t.Fatal(err)
		}
		r.emulateVLANDevice(vlanMTU)
	}
	sock := udpSocket(t, r.out, netip.AddrPortFrom(vlanRemote, remotePort))
	if !kernel {
		raw, err := sock.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var serr error
		raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, vlanMark) })
		if serr != nil {
			t.Fatal(serr)
		}
	}
	local, remote := netip.AddrPortFrom(vlanLocal, udpPort1), netip.AddrPortFrom(vlanRemote, remotePort)
	const n = 20

	// RX: the outside kernel's datagrams, tagged on the wire, into the stream.
	in := payloads(n, "tagged in")
	sendTo(t, sock, local, in)
	got := recvN(t, app, n, 3*time.Second)
	if len(got) != n {
		t.Fatalf("the stream got %d of %d tagged datagrams (%+v)", len(got), n, r.b.Stats())
	}
	for i, p := range got {
		pp := r.parseDelivered("tagged datagram", p)
		if pp.Src != remote || pp.Dst != local || !pp.ChecksumOK || !bytes.Equal(pp.Payload, in[i]) {
			t.Fatalf("datagram %d: %+v, want %q from %v to %v\n%s", i, pp, in[i], remote, local, r.describe(p))
		}
	}
	if emu != nil && emu.count(0) < n {
		t.Fatalf("the outside tagged %d frames, want at least %d", emu.count(0), n)
	}

	// TX: the stream's datagrams leave tagged and reach the outside socket.
	out := payloads(n, "tagged out")
	var pkts [][]byte
	for _, p := range out {
		pkts = append(pkts, ippkt.UDP(local, remote, p))
	}
	if _, err := app.Send(pkts); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2048)
	for i := range out {
		sock.SetReadDeadline(time.Now().Add(3 * time.Second))
		k, src, err := sock.ReadFromUDPAddrPort(buf)
		if err != nil {
			t.Fatalf("the outside socket got %d of %d: %v (%+v)", i, n, err, r.b.Stats().Streams[0])
		}
		if !bytes.Equal(buf[:k], out[i]) || src.Addr().Unmap() != vlanLocal || src.Port() != udpPort1 {
			t.Fatalf("datagram %d: %q from %v, want %q from %v", i, buf[:k], src, out[i], local)
		}
	}
	s := r.eventually(func(s Stats) bool { return s.Streams[0].TxPackets+s.Streams[0].TxViaKernel >= n }).Streams[0]
	// With real devices the first packet may go through the kernel, which
	// resolves the neighbour; the emulation knows it from the start.
	if s.TxPackets+s.TxViaKernel != n || s.TxPackets < n-1 || (emu != nil && s.TxViaKernel != 0) {
		t.Fatalf("stream counters %+v: want %d sent tagged by the bridge", s, n)
	}
	if emu != nil && emu.count(1) != s.TxPackets {
		t.Fatalf("the outside received %d frames tagged with VLAN %d, the bridge sent %d", emu.count(1), testVID, s.TxPackets)
	}

	// The VLAN device's MTU: a packet of the interface's MTU is too long
	// for it, one of the device's MTU is not.
	long := ippkt.UDP(local, remote, make([]byte, vlanMTU+1-28))
	fits := ippkt.UDP(local, remote, bytes.Repeat([]byte{'m'}, vlanMTU-28))
	if _, err := app.Send([][]byte{long, fits}); err != nil {
		t.Fatal(err)
	}
	sock.SetReadDeadline(time.Now().Add(3 * time.Second))
	k, err := sock.Read(buf)
	if err != nil || k != vlanMTU-28 || buf[0] != 'm' {
		t.Fatalf("after the long packet the outside got %d bytes, %v; want the %d-byte datagram", k, err, vlanMTU-28)
	}
	s = r.eventually(func(s Stats) bool { return s.Streams[0].TxRejects.MTU > 0 }).Streams[0]
	if s.TxRejects.MTU != 1 || s.TxRejects.Total() != 1 {
		t.Fatalf("rejects %+v: want the one packet over the VLAN device's MTU", s.TxRejects)
	}
}

// addVLANDevice makes an 802.1Q device (VLAN testVID) on parent in ns, with
// addr and mtu, and brings it up.
func addVLANDevice(ns *topology.NS, parent string, addr netip.Prefix, mtu int) error {
	return ns.Do(func() error {
		p, err := netlink.LinkByName(parent)
		if err != nil {
			return err
		}
		v := &netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: parent + ".v", ParentIndex: p.Attrs().Index, MTU: mtu}, VlanId: testVID, VlanProtocol: netlink.VLAN_PROTOCOL_8021Q}
		if err := netlink.LinkAdd(v); err != nil {
			return err
		}
		if err := netlink.AddrAdd(v, &netlink.Addr{IPNet: &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), 32)}}); err != nil {
			return err
		}
		return netlink.LinkSetUp(v)
	})
}

// TestResolverVLANLinks: which links count as the bridge's VLAN devices
// (stacked directly on the served interface), their tags (802.1Q and
// 802.1ad), and how a destination is framed through them; no kernel needed.
func TestResolverVLANLinks(t *testing.T) {
	const served, q, ad, other, plain = 5, 50, 51, 52, 53
	route := map[netip.Addr]int{}
	r := &resolver{ifindex: served, neigh: map[neighKey]net.HardwareAddr{}, vlans: map[int]vlanLink{}, routes: map[netip.Addr]nextHop{},
		routeGet: func(dst net.IP) ([]netlink.Route, error) {
			a, _ := netip.AddrFromSlice(dst)
			return []netlink.Route{{LinkIndex: route[a.Unmap()], Type: unix.RTN_UNICAST}}, nil
		}}
	vlan := func(idx, parent, vid int, proto netlink.VlanProtocol, mtu int) *netlink.Vlan {
		return &netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Index: idx, ParentIndex: parent, MTU: mtu}, VlanId: vid, VlanProtocol: proto}
	}
	if !r.applyLink(unix.RTM_NEWLINK, vlan(q, served, 10, netlink.VLAN_PROTOCOL_8021Q, 1500)) ||
		!r.applyLink(unix.RTM_NEWLINK, vlan(ad, served, 20, netlink.VLAN_PROTOCOL_8021AD, 1496)) ||
		r.applyLink(unix.RTM_NEWLINK, vlan(other, 99, 30, netlink.VLAN_PROTOCOL_8021Q, 1500)) ||
		r.applyLink(unix.RTM_NEWLINK, &netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Index: plain}}) {
		t.Fatalf("VLAN devices known: %v", r.vlans)
	}
	if r.applyLink(unix.RTM_NEWLINK, vlan(q, served, 10, netlink.VLAN_PROTOCOL_8021Q, 1500)) {
		t.Fatal("an unchanged VLAN device counted as a change")
	}
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 7}
	dsts := map[int]netip.Addr{}
	for i, link := range []int{served, q, ad, other, plain} {
		a := netip.AddrFrom4([4]byte{198, 18, 9, byte(i + 1)})
		dsts[link], route[a] = a, link
		r.apply(unix.RTM_NEWNEIGH, &netlink.Neigh{LinkIndex: link, IP: a.AsSlice(), HardwareAddr: mac, State: netlink.NUD_REACHABLE})
	}
	for _, c := range []struct {
		link int
		ok   bool
		tag  uint32
		mtu  int32
	}{{served, true, 0, 0}, {q, true, 0x8100<<16 | 10, 1500}, {ad, true, 0x88a8<<16 | 20, 1496}, {other, false, 0, 0}, {plain, false, 0, 0}} {
		h, ok := r.resolve(dsts[c.link])
		if ok != c.ok || (ok && (h.tag != c.tag || h.mtu != c.mtu || !bytes.Equal(h.mac[:], mac))) {
			t.Errorf("link %d: %+v %v, want ok %v tag %#x mtu %d", c.link, h, ok, c.ok, c.tag, c.mtu)
		}
	}
	// Deleted, or no longer a VLAN on the served interface: gone.
	if !r.applyLink(unix.RTM_DELLINK, vlan(q, served, 10, netlink.VLAN_PROTOCOL_8021Q, 1500)) || !r.applyLink(unix.RTM_NEWLINK, vlan(ad, 99, 20, netlink.VLAN_PROTOCOL_8021AD, 1496)) {
		t.Fatal("removing VLAN devices reported no change")
	}
	clear(r.routes)
	for _, link := range []int{q, ad} {
		if _, ok := r.resolve(dsts[link]); ok {
			t.Errorf("link %d: still resolved after its VLAN device went", link)
		}
	}
}
