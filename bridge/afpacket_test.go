package bridge

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge/afpacket"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/nft"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestAFPacketHidesSteered: on the AF_PACKET path the kernel never sees
// steered or dropped frames (no ICMP port unreachable for steered UDP, no
// datagram for a kernel socket behind a drop rule) while it still gets what
// is its own; the table goes with Close, and a leftover of a crashed run is
// replaced by the next Open.
func TestAFPacketHidesSteered(t *testing.T) {
	r := newRig(t, Config{Path: PathAFPacket, Mode: ModeStrict})
	const dropPort = 7300
	r.setTables(&classifier.RuleSet{
		Listeners: []classifier.Listener{{ID: 1, Protocol: classifier.ProtoUDP, Port: udpPort1, Stream: 1}},
		Rules:     []classifier.Rule{{ID: 2, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(dropPort), Action: classifier.ActionDrop}},
	})
	app := r.stream(1, r.ownership1(), fabric.Config{})
	ks := udpSocket(t, r.br, netip.AddrPortFrom(r.local4, kernelPort))
	dropped := udpSocket(t, r.br, netip.AddrPortFrom(r.local4, dropPort))
	capt := newCapture(t, r.out, r.v.B.Index)
	c := udpSocket(t, r.out, netip.AddrPortFrom(r.remote4, remotePort))
	c6 := udpSocket(t, r.out, netip.AddrPortFrom(r.remote6, remotePort))
	sendTo(t, c, netip.AddrPortFrom(r.local4, udpPort1), payloads(10, "steered"))
	sendTo(t, c6, netip.AddrPortFrom(r.local6, udpPort1), payloads(10, "steered6"))
	sendTo(t, c, netip.AddrPortFrom(r.local4, dropPort), payloads(10, "dropped"))
	sendTo(t, c, netip.AddrPortFrom(r.local4, kernelPort), [][]byte{[]byte("kernel's")})
	if got := recvN(t, app, 20, 3*time.Second); len(got) != 20 {
		t.Fatalf("stream got %d of 20", len(got))
	}
	buf := make([]byte, 2048)
	ks.SetReadDeadline(time.Now().Add(3 * time.Second))
	if n, err := ks.Read(buf); err != nil || string(buf[:n]) != "kernel's" {
		t.Fatalf("kernel socket: %q %v", buf[:n], err)
	}
	dropped.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := dropped.Read(buf); err == nil {
		t.Fatalf("the kernel socket behind a drop rule got %q", buf[:n])
	}
	// An ICMP(v6) error from the bridge host would be on its way by now.
	frames, _ := capt.until(200*time.Millisecond, func([]byte) bool { return false })
	for _, f := range frames {
		if icmpError(f) {
			t.Fatalf("the bridge host's kernel answered a steered or dropped frame: %x", f)
		}
	}

	table := nft.TableName(r.v.A.Name)
	listTables := func() string {
		out, err := r.br.Exec(context.Background(), "nft", "list", "tables")
		if err != nil {
			t.Fatal(err)
		}
		return string(out)
	}
	if !strings.Contains(listTables(), table) {
		t.Fatalf("no table %s while open: %s", table, listTables())
	}
	if err := r.b.Close(); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(listTables(), table) {
		t.Fatalf("table %s left after Close", table)
	}

	// A crashed run's table (here: one that hides UDP 7200, the kernel's
	// port) is replaced by Open, on any path.
	if out, err := r.br.Exec(context.Background(), "nft", fmt.Sprintf("add table netdev %s; add chain netdev %s ingress { type filter hook ingress device %q priority -500; }; add rule netdev %s ingress udp dport %d drop", table, table, r.v.A.Name, table, kernelPort)); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	for _, p := range paths {
		cfg := p.cfg
		cfg.Interface, cfg.FrameCount = r.v.A.Name, 256
		var b *Bridge
		if err := r.br.Do(func() (err error) { b, err = Open(cfg); return err }); err != nil {
			t.Fatal(err)
		}
		sendTo(t, c, netip.AddrPortFrom(r.local4, kernelPort), [][]byte{[]byte("after " + p.name)})
		ks.SetReadDeadline(time.Now().Add(3 * time.Second))
		if n, err := ks.Read(buf); err != nil || string(buf[:n]) != "after "+p.name {
			t.Fatalf("%s: the kernel socket after a leftover table: %q %v", p.name, buf[:n], err)
		}
		b.Close()
		if strings.Contains(listTables(), table) {
			t.Fatalf("%s: table %s left after Close", p.name, table)
		}
		// Leave a leftover for the next path too.
		r.br.Exec(context.Background(), "nft", fmt.Sprintf("add table netdev %s; add chain netdev %s ingress { type filter hook ingress device %q priority -500; }; add rule netdev %s ingress udp dport %d drop", table, table, r.v.A.Name, table, kernelPort))
	}
}

// icmpError reports whether an Ethernet frame is an ICMP destination
// unreachable or an ICMPv6 error.
func icmpError(f []byte) bool {
	if len(f) < 14+40+1 {
		return len(f) >= 14+20+1 && bytes.Equal(f[12:14], []byte{8, 0}) && f[14+9] == 1 && f[14+20] == 3
	}
	switch {
	case bytes.Equal(f[12:14], []byte{8, 0}):
		ihl := int(f[14]&0xf) * 4
		return f[14+9] == 1 && len(f) > 14+ihl && f[14+ihl] == 3
	case bytes.Equal(f[12:14], []byte{0x86, 0xdd}):
		return f[14+6] == 58 && f[14+40] < 128
	}
	return false
}

// TestAFPacketTurnsOffMerging: the AF_PACKET path turns GRO off on its
// interface (a tap would see merged super-packets) and turns it back on at
// Close.
func TestAFPacketTurnsOffMerging(t *testing.T) {
	testenv.RequirePrivileged(t)
	br, _, v := topology.Pair(t, topology.VethOptions{})
	gro := func() (on bool) {
		t.Helper()
		if err := br.Do(func() error {
			o, err := afpacket.DisableMerging(v.A.Name)
			if err != nil {
				return err
			}
			on = slices.Contains(o.Changed(), "rx-gro")
			return o.Restore()
		}); err != nil {
			t.Fatal(err)
		}
		return on
	}
	if err := br.Do(func() error {
		o, err := afpacket.DisableMerging(v.A.Name)
		if err != nil {
			return err
		}
		defer o.Restore()
		return o.SetFeature("rx-gro", true)
	}); err != nil {
		t.Fatal(err)
	}
	if !gro() {
		t.Fatal("could not turn GRO on for the test")
	}
	var b *Bridge
	if err := br.Do(func() (err error) {
		b, err = Open(Config{Interface: v.A.Name, Path: PathAFPacket, Mode: ModeStrict, FrameCount: 256})
		if err != nil {
			return err
		}
		o, err := afpacket.DisableMerging(v.A.Name)
		if err != nil {
			return err
		}
		defer o.Restore()
		if on, err := o.Active("rx-gro"); err != nil || on {
			return fmt.Errorf("GRO on while the AF_PACKET path runs (%v)", err)
		}
		return nil
	}); err != nil {
		if b != nil {
			b.Close()
		}
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if !gro() {
		t.Fatal("GRO not turned back on at Close")
	}
}
