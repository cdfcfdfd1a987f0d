package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// testBridge is the daemon in a bridge namespace with an outside host.
type testBridge struct {
	bridge, outside *topology.NS
	v               *topology.Veth
	cfg             *config.Config
	path            string // of the configuration file
	d               *appliance.Daemon
}

func newTestBridge(t *testing.T, extra string) *testBridge {
	t.Helper()
	testenv.RequirePrivileged(t)
	tb := &testBridge{}
	tb.bridge, tb.outside, tb.v = topology.Pair(t, topology.VethOptions{})
	// Complete checksums on the "wire", as a NIC would send them.
	if err := ethtool.DisableTxChecksum(tb.outside, tb.v.B.Name); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "fb.yaml")
	os.WriteFile(path, []byte(fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\ncontrol: {socket: %s}\nmetrics: {address: \"\"}\n%s",
		tb.v.A.Name, tb.v.A.Addr4.Addr(), filepath.Join(dir, "control.sock"), extra)), 0o644)
	var err error
	tb.path = path
	if tb.cfg, err = config.Load(path); err != nil {
		t.Fatal(err)
	}
	if err := tb.bridge.Do(func() (err error) {
		tb.d, err = appliance.Start(tb.cfg, appliance.Options{Log: io.Discard})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tb.d.Close() })
	return tb
}

// dialOutside opens a kernel TCP connection from the outside host.
func (tb *testBridge) dialOutside(t *testing.T, network string, to netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	if err := tb.outside.Do(func() (err error) {
		c, err = net.DialTimeout(network, to.String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestPcapCounter(t *testing.T) {
	var file []byte
	file = append(file, make([]byte, 24)...)
	for _, n := range []int{3, 0, 70} {
		var h [16]byte
		binary.LittleEndian.PutUint32(h[8:], uint32(n))
		file = append(file, h[:]...)
		file = append(file, bytes.Repeat([]byte{0xee}, n)...)
	}
	for _, chunk := range []int{1, 7, 16, 1000} {
		var out bytes.Buffer
		c := &pcapCounter{w: &out}
		for b := file; len(b) > 0; {
			k := min(chunk, len(b))
			c.Write(b[:k])
			b = b[k:]
		}
		if c.records != 3 || !bytes.Equal(out.Bytes(), file) {
			t.Errorf("chunks of %d: %d records", chunk, c.records)
		}
	}
}

// TestCaptureStream captures a live application stream through the
// daemon's admin socket: both directions, the filter, the count; the
// stream works before, during and after.
func TestCaptureStream(t *testing.T) {
	tb := newTestBridge(t, "")
	bridgeNS, outside, v, cfg := tb.bridge, tb.outside, tb.v, tb.cfg
	_ = bridgeNS
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := control.DialLocal(ctx, cfg.Control.Socket, "echo")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, stream, err := c.RegisterLocal(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	local := netip.AddrPortFrom(v.A.Addr4.Addr(), 5000)
	if _, err := c.Listen(ctx, "udp", local.Addr(), local.Port()); err != nil {
		t.Fatal(err)
	}
	// The application echoes every datagram.
	go func() {
		bufs := [][]byte{make([]byte, stream.MaxPayload())}
		for {
			n, err := stream.Recv(bufs)
			if err != nil {
				return
			}
			if n == 1 {
				p, err := ippkt.Parse(bufs[0])
				if err == nil {
					stream.Send([][]byte{ippkt.UDP(p.Dst, p.Src, p.Payload)})
				}
			}
			bufs[0] = bufs[0][:cap(bufs[0])]
		}
	}()
	defer stream.Close()

	var sock *net.UDPConn
	if err := outside.Do(func() (err error) { sock, err = net.ListenUDP("udp", &net.UDPAddr{}); return err }); err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	ping := func(msg string) {
		t.Helper()
		sock.WriteToUDP([]byte(msg), net.UDPAddrFromAddrPort(local))
		sock.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 100)
		n, _, err := sock.ReadFromUDP(buf)
		if err != nil || string(buf[:n]) != msg {
			t.Fatalf("echo of %q: %q, %v", msg, buf[:n], err)
		}
	}
	ping("before")

	pcap := filepath.Join(t.TempDir(), "echo.pcap")
	var stderr bytes.Buffer
	done := make(chan error, 1)
	go func() {
		done <- captureCommand(ctx, []string{"--admin", cfg.Control.AdminSocket, "--stream", "echo", "-w", pcap, "-c", "4", "udp", "and", "port", "5000"}, &stderr)
	}()
	// Wait until the tap is in place: the capture's file header arrives.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if fi, err := os.Stat(pcap); err == nil && fi.Size() >= 24 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("capture did not start: %s", stderr.String())
		}
	}
	ping("one")
	ping("two")
	if err := <-done; err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "4 packets captured, 0 dropped") {
		t.Errorf("summary: %s", stderr.String())
	}
	data, _ := os.ReadFile(pcap)
	// Records are in the order the bridge's loops saw them (RX and TX run
	// apart); their timestamps give the order on the wire.
	type rec struct {
		us  uint64
		txt string
	}
	var recs []rec
	for b := data[24:]; len(b) >= 16; {
		us := uint64(binary.LittleEndian.Uint32(b))*1e6 + uint64(binary.LittleEndian.Uint32(b[4:]))
		n := int(binary.LittleEndian.Uint32(b[8:]))
		p, err := ippkt.Parse(b[16 : 16+n])
		if err != nil {
			t.Fatal(err)
		}
		dirn := "in"
		if p.Src == local {
			dirn = "out"
		}
		recs = append(recs, rec{us, dirn + " " + string(p.Payload)})
		b = b[16+n:]
	}
	slices.SortStableFunc(recs, func(a, b rec) int { return cmp.Compare(a.us, b.us) })
	var got []string
	for _, r := range recs {
		got = append(got, r.txt)
	}
	if want := "in one|out one|in two|out two"; strings.Join(got, "|") != want {
		t.Errorf("captured %q, want %q", strings.Join(got, "|"), want)
	}
	ping("after") // the capture hook is gone, the stream works on

	// stats over the admin socket (this configuration has no metrics address).
	var st bytes.Buffer
	if err := statsCommand(ctx, []string{"--config", tb.path, "--once", "--interval", "100ms"}, &st); err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^ +\d+ echo +normal `).MatchString(st.String()) || !strings.Contains(st.String(), cfg.Control.AdminSocket) {
		t.Errorf("stats over the admin socket:\n%s", st.String())
	}

	// A capture without a count ends when the application goes.
	stderr.Reset()
	go func() {
		done <- captureCommand(ctx, []string{"--admin", cfg.Control.AdminSocket, "--stream", "echo", "-w", pcap}, &stderr)
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if fi, err := os.Stat(pcap); err == nil && fi.Size() == 24 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("second capture did not start: %s", stderr.String())
		}
	}
	ping("captured once more")
	c.Close()
	select {
	case err := <-done:
		if err != nil || !strings.Contains(stderr.String(), "2 packets captured") {
			t.Errorf("capture after the application left: %v\n%s", err, stderr.String())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the capture did not end with its application")
	}
}
