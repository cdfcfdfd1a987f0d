package appliance

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// TestGeneveRefusalsExported: datagrams to the GENEVE port with a VNI no
// stream has, and ones too short to be GENEVE, appear on /metrics as
// fabricbridge_geneve_refused_total with their reason, counted exactly.
func TestGeneveRefusalsExported(t *testing.T) {
	tp := newTopo(t)
	peerNS := topology.New(t)
	link := topology.Connect(t, tp.bridge, peerNS, topology.VethOptions{})
	ctl := netip.AddrPortFrom(link.A.Addr4.Addr(), 7070)
	sf := writeSecret(t, tp.dir, "far.secret", "0123456789abcdef-far-away", 0o600)
	cfg := tp.config(t, fmt.Sprintf("applications:\n  - {name: far, secret_file: %s}\n", sf),
		fmt.Sprintf("  tcp: {address: %q, auth: secret}\n", ctl))
	d := tp.start(t, cfg, io.Discard)
	defer d.Close()

	const wrongVNI, malformed = 3, 2
	// An IPv4 data packet under VNI 0xabcde, which no stream has.
	stray := make([]byte, 8+20)
	stray[2], stray[3] = 0x08, 0x00
	binary.BigEndian.PutUint32(stray[4:], 0xabcde<<8)
	stray[8] = 0x45
	if err := peerNS.Do(func() error {
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(d.remote.LocalAddr()))
		if err != nil {
			return err
		}
		defer c.Close()
		for range wrongVNI {
			if _, err := c.Write(stray); err != nil {
				return err
			}
		}
		for range malformed {
			if _, err := c.Write([]byte("x")); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"wrong_vni": wrongVNI, "malformed": malformed, "wrong_source": 0, "bad_credit": 0, "overflow": 0, "dead": 0}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		s := tp.scrape(t, d)
		got := map[string]float64{}
		for reason := range want {
			got[reason] = value(t, s, "fabricbridge_geneve_refused_total", "reason", reason)
		}
		if fmt.Sprint(got) == fmt.Sprint(want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fabricbridge_geneve_refused_total: %v, want %v", got, want)
		}
	}
}
