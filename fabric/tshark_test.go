package fabric

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// innerUDP builds a well-formed inner IP/UDP packet, the kind an
// application's stack hands to its stream.
func innerUDP(t *testing.T, src, dst netip.Addr, sport, dport uint16, payload []byte) []byte {
	t.Helper()
	udp := &layers.UDP{SrcPort: layers.UDPPort(sport), DstPort: layers.UDPPort(dport)}
	var ip gopacket.SerializableLayer
	if src.Is4() {
		ip4 := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolUDP, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
		udp.SetNetworkLayerForChecksum(ip4)
		ip = ip4
	} else {
		ip6 := &layers.IPv6{Version: 6, HopLimit: 64, NextHeader: layers.IPProtocolUDP, SrcIP: src.AsSlice(), DstIP: dst.AsSlice()}
		udp.SetNetworkLayerForChecksum(ip6)
		ip = ip6
	}
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	if err := gopacket.SerializeLayers(buf, opts, ip, udp, gopacket.Payload(payload)); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// capture is an AF_PACKET socket on one interface: what tcpdump would
// see there, in both directions.
type capture struct{ fd int }

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func startCapture(ifindex int) (*capture, error) {
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return nil, err
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifindex}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &capture{fd: fd}, nil
}

// writePcap drains what the socket holds into a pcap file (the classic
// libpcap format: a 24-byte file header, then a 16-byte header per
// frame; written here rather than with gopacket's pcapgo, whose package
// would pull golang.org/x/net into the module for its live capture).
func (c *capture) writePcap(path string) (int, error) {
	defer unix.Close(c.fd)
	var file []byte
	file = binary.LittleEndian.AppendUint32(file, 0xa1b2c3d4) // magic, microseconds
	file = binary.LittleEndian.AppendUint16(file, 2)          // version 2.4
	file = binary.LittleEndian.AppendUint16(file, 4)
	file = binary.LittleEndian.AppendUint32(file, 0) // thiszone
	file = binary.LittleEndian.AppendUint32(file, 0) // sigfigs
	file = binary.LittleEndian.AppendUint32(file, 65536)
	file = binary.LittleEndian.AppendUint32(file, uint32(layers.LinkTypeEthernet))
	buf := make([]byte, 65536)
	n := 0
	for {
		k, _, err := unix.Recvfrom(c.fd, buf, unix.MSG_DONTWAIT|unix.MSG_TRUNC)
		if err == unix.EAGAIN {
			break
		}
		if err != nil {
			return n, err
		}
		now := time.Now()
		capLen := min(k, len(buf))
		file = binary.LittleEndian.AppendUint32(file, uint32(now.Unix()))
		file = binary.LittleEndian.AppendUint32(file, uint32(now.Nanosecond()/1000))
		file = binary.LittleEndian.AppendUint32(file, uint32(capLen))
		file = binary.LittleEndian.AppendUint32(file, uint32(k))
		file = append(file, buf[:capLen]...)
		n++
	}
	return n, os.WriteFile(path, file, 0o644)
}

// tsharkPath finds tshark; CI installs it (.ci/run), elsewhere the test
// steps aside unless privileged tests are required.
func tsharkPath(t *testing.T) string {
	p, err := exec.LookPath("tshark")
	if err != nil {
		if os.Getenv(testenv.RequireEnv) == "1" {
			t.Fatal("tshark is not installed (apt-get install tshark)")
		}
		t.Skip("tshark is not installed")
	}
	return p
}

// tshark's view of one frame: the fields asked for, each with all its
// occurrences (outer header first, inner after).
type tsharkFrame map[string][]string

func runTshark(t *testing.T, tshark, pcap string, fields []string) []tsharkFrame {
	t.Helper()
	args := []string{"-n", "-r", pcap, "-T", "fields", "-E", "separator=|", "-E", "occurrence=a", "-E", "aggregator=,"}
	for _, f := range fields {
		args = append(args, "-e", f)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, tshark, args...)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir()) // no profile of ours
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tshark: %v", err)
	}
	var frames []tsharkFrame
	for _, line := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		cols := strings.Split(line, "|")
		if len(cols) != len(fields) {
			t.Fatalf("tshark line %q has %d columns, want %d", line, len(cols), len(fields))
		}
		fr := tsharkFrame{}
		for i, f := range fields {
			if cols[i] != "" {
				fr[f] = strings.Split(cols[i], ",")
			}
		}
		frames = append(frames, fr)
	}
	return frames
}

// The fabric traffic on the wire is standard GENEVE: tshark, with no
// configuration, decodes a capture of the remote transport (taken with
// AF_PACKET on the receiving veth) as GENEVE with the stream's VNI, the
// right protocol type and the inner IPv4 or IPv6 packet with its
// addresses and ports; the credit messages flowing back decode as GENEVE
// control packets of type 0x88B5 with an option of class 0xFFF0.
//
// The sender runs without GSO here: with it, a capture on the host shows
// the unsegmented super-datagram (as TSO captures show 64 KiB TCP
// segments); the segments that leave a NIC are these same datagrams.
func TestTsharkDecodesGeneve(t *testing.T) {
	testenv.RequirePrivileged(t)
	tshark := tsharkPath(t)
	for _, outer6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("outer-v6=%v", outer6), func(t *testing.T) {
			x := newRemotes(t, outer6, RemoteConfig{}, RemoteConfig{NoGSO: true})
			const vni = 0x4242aa
			sa, sb := x.pair(t, vni)
			var c *capture
			if err := x.a.Do(func() (err error) {
				c, err = startCapture(x.veth.A.Index)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			in4s, in4d := netip.MustParseAddr("198.18.200.1"), netip.MustParseAddr("198.18.200.2")
			in6s, in6d := netip.MustParseAddr("2001:db8:200::1"), netip.MustParseAddr("2001:db8:200::2")
			const n = 20
			var pkts [][]byte
			for i := 0; i < n; i++ {
				payload := binary.BigEndian.AppendUint32(nil, uint32(i))
				if i%2 == 0 {
					pkts = append(pkts, innerUDP(t, in4s, in4d, 1234, 5678, payload))
				} else {
					pkts = append(pkts, innerUDP(t, in6s, in6d, 1234, 5678, payload))
				}
			}
			if k, err := sb.Send(pkts); k != n || err != nil {
				t.Fatalf("send: %d %v", k, err)
			}
			out := mkBufs(n, 2048)
			for got := 0; got < n; {
				k, err := sa.RecvTimeout(out, 5*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				got += k
			}
			// Wait for A to credit what it consumed (CreditInterval).
			deadline := time.Now().Add(5 * time.Second)
			for x.rb.Counters().Credits == 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			pcap := filepath.Join(t.TempDir(), "fabric.pcap")
			frames, err := c.writePcap(pcap)
			if err != nil {
				t.Fatal(err)
			}
			fields := []string{"frame.protocols", "geneve.vni", "geneve.proto_type", "geneve.flags.oam",
				"geneve.option.class", "ip.src", "ip.dst", "ipv6.src", "ipv6.dst", "udp.srcport", "udp.dstport"}
			decoded := runTshark(t, tshark, pcap, fields)
			if len(decoded) != frames {
				t.Fatalf("tshark decoded %d frames, captured %d", len(decoded), frames)
			}
			outerSrc, outerDst := x.addrB.String(), x.addrA.String()
			var data4, data6, credits int
			for i, fr := range decoded {
				if !strings.Contains(strings.Join(fr["frame.protocols"], ","), "geneve") {
					continue // ARP, neighbour discovery
				}
				if got := fr["geneve.vni"]; len(got) != 1 || got[0] != fmt.Sprintf("%#x", vni) {
					t.Errorf("frame %d: VNI %v, want %#x", i+1, got, vni)
				}
				proto := fr["geneve.proto_type"]
				if len(proto) != 1 {
					t.Fatalf("frame %d: protocol type %v", i+1, proto)
				}
				ipSrc, ipDst := fr["ip.src"], fr["ip.dst"]
				if outer6 {
					ipSrc, ipDst = fr["ipv6.src"], fr["ipv6.dst"]
				}
				switch proto[0] {
				case "0x88b5":
					// A credit from A to B.
					if fr["geneve.flags.oam"][0] != "1" && fr["geneve.flags.oam"][0] != "True" {
						t.Errorf("frame %d: control packet without the O flag: %v", i+1, fr)
					}
					if c := fr["geneve.option.class"]; len(c) == 0 || c[0] != "0xfff0" {
						t.Errorf("frame %d: option class %v, want 0xfff0", i+1, c)
					}
					switch {
					case len(ipSrc) == 1 && ipSrc[0] == outerSrc:
						// B's keepalive (a credit of what it consumed, which
						// is nothing), sent every PeerTimeout/4: a slow run
						// can see one.
						continue
					case len(ipSrc) == 0 || ipSrc[0] != outerDst:
						t.Errorf("frame %d: credit from %v, want %v", i+1, ipSrc, outerDst)
					}
					credits++
				case "0x0800", "0x86dd":
					if len(ipSrc) == 0 || ipSrc[0] != outerSrc || ipDst[0] != outerDst {
						t.Errorf("frame %d: outer %v -> %v, want %v -> %v", i+1, ipSrc, ipDst, outerSrc, outerDst)
					}
					innerSrc, innerDst := fr["ip.src"], fr["ip.dst"]
					wantSrc, wantDst := in4s, in4d
					if proto[0] == "0x86dd" {
						innerSrc, innerDst = fr["ipv6.src"], fr["ipv6.dst"]
						wantSrc, wantDst = in6s, in6d
						data6++
					} else {
						data4++
					}
					if len(innerSrc) == 0 || innerSrc[len(innerSrc)-1] != wantSrc.String() || innerDst[len(innerDst)-1] != wantDst.String() {
						t.Errorf("frame %d: inner %v -> %v, want %v -> %v", i+1, innerSrc, innerDst, wantSrc, wantDst)
					}
					ports := fr["udp.dstport"]
					if len(ports) != 2 || ports[0] != fmt.Sprint(GenevePort) || ports[1] != "5678" {
						t.Errorf("frame %d: UDP destination ports %v, want outer %d and inner 5678", i+1, ports, GenevePort)
					}
				default:
					t.Errorf("frame %d: protocol type %v", i+1, proto)
				}
			}
			if data4 != n/2 || data6 != n/2 || credits == 0 {
				t.Fatalf("tshark saw %d inner IPv4 and %d inner IPv6 data packets (want %d each) and %d credits", data4, data6, n/2, credits)
			}
			t.Logf("%d frames captured: %d+%d GENEVE data packets, %d GENEVE credit packets, all decoded by tshark", frames, data4, data6, credits)
		})
	}
}
