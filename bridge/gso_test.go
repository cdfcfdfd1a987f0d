package bridge

import (
	"bytes"
	"encoding/binary"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// segFlow is one TCP connection's addresses for built segments.
type segFlow struct {
	srcMAC, dstMAC net.HardwareAddr
	src, dst       netip.AddrPort
}

var testFlow4 = segFlow{
	srcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, dstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2},
	src: netip.MustParseAddrPort("198.18.0.1:80"), dst: netip.MustParseAddrPort("198.18.0.2:40000"),
}

var testFlow6 = segFlow{
	srcMAC: testFlow4.srcMAC, dstMAC: testFlow4.dstMAC,
	src: netip.MustParseAddrPort("[2001:db8::1]:80"), dst: netip.MustParseAddrPort("[2001:db8::2]:40000"),
}

// segSpec shapes one built segment.
type segSpec struct {
	size     int    // payload bytes
	psh, fin bool   // flags beside ACK
	seqGap   uint32 // added to the sequence number the previous segment leads to
	tsval    uint32 // the timestamp option's value; 0: 7
	srcPort  uint16 // 0: the flow's
	tos      uint8
}

// buildSegments makes the frames a user-space stack without offload puts
// on the wire for one connection: sequence numbers follow the payloads,
// IPv4 IDs count up, the timestamp option on every segment, complete
// checksums.
func buildSegments(t testing.TB, f segFlow, specs []segSpec) [][]byte {
	t.Helper()
	seq, id := uint32(1_000_000), uint16(4242)
	var out [][]byte
	for i, s := range specs {
		seq += s.seqGap
		eth := &layers.Ethernet{SrcMAC: f.srcMAC, DstMAC: f.dstMAC}
		tsval := s.tsval
		if tsval == 0 {
			tsval = 7
		}
		ts := make([]byte, 8)
		binary.BigEndian.PutUint32(ts, tsval)
		binary.BigEndian.PutUint32(ts[4:], 99)
		sport := f.src.Port()
		if s.srcPort != 0 {
			sport = s.srcPort
		}
		tcp := &layers.TCP{
			SrcPort: layers.TCPPort(sport), DstPort: layers.TCPPort(f.dst.Port()),
			Seq: seq, Ack: 5555, ACK: true, PSH: s.psh, FIN: s.fin, Window: 502,
			Options: []layers.TCPOption{
				{OptionType: layers.TCPOptionKindNop}, {OptionType: layers.TCPOptionKindNop},
				{OptionType: layers.TCPOptionKindTimestamps, OptionLength: 10, OptionData: ts},
			},
		}
		var net gopacket.SerializableLayer
		if f.src.Addr().Is4() {
			eth.EthernetType = layers.EthernetTypeIPv4
			ip := &layers.IPv4{Version: 4, IHL: 5, TOS: s.tos, TTL: 64, Id: id + uint16(i), Flags: layers.IPv4DontFragment,
				Protocol: layers.IPProtocolTCP, SrcIP: f.src.Addr().AsSlice(), DstIP: f.dst.Addr().AsSlice()}
			tcp.SetNetworkLayerForChecksum(ip)
			net = ip
		} else {
			eth.EthernetType = layers.EthernetTypeIPv6
			ip := &layers.IPv6{Version: 6, TrafficClass: s.tos, HopLimit: 64, NextHeader: layers.IPProtocolTCP,
				SrcIP: f.src.Addr().AsSlice(), DstIP: f.dst.Addr().AsSlice()}
			tcp.SetNetworkLayerForChecksum(ip)
			net = ip
		}
		// Each byte a function of its place in the stream, so that the
		// same bytes cut at other boundaries build the same frames.
		payload := make([]byte, s.size)
		for k := range payload {
			payload[k] = byte((seq + uint32(k)) * 7)
		}
		buf := gopacket.NewSerializeBuffer()
		if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
			eth, net, tcp, gopacket.Payload(payload)); err != nil {
			t.Fatal(err)
		}
		out = append(out, append([]byte(nil), buf.Bytes()...))
		seq += uint32(s.size)
	}
	return out
}

func cloneFrames(fs [][]byte) [][]byte {
	out := make([][]byte, len(fs))
	for i, f := range fs {
		out[i] = append([]byte(nil), f...)
	}
	return out
}

// offloadForTest is a segOffload with no socket: it plans and builds, and
// its sends fail.
func offloadForTest(max int) *segOffload {
	return &segOffload{
		fd: -1, segs: make([]tcpSeg, max), frames: make([][]byte, max), vnet: make([][vnetHdrLen]byte, max),
		iovs: make([]unix.Iovec, 2*max), msgs: make([]unix.Mmsghdr, max), names: make([]unix.RawSockaddrLinklayer, max),
	}
}

// runsOf is how send would group frames: the length of each message.
func runsOf(frames [][]byte) []int {
	o := offloadForTest(len(frames))
	if !o.plan(frames, tsoIPv4|tsoIPv6) {
		return nil
	}
	o.send(frames) // fd -1: nothing leaves; the messages are built
	var runs []int
	for _, m := range o.msgs[:msgCount(o, len(frames))] {
		runs = append(runs, int(m.Hdr.Iovlen)-1)
	}
	return runs
}

// msgCount counts the messages send built for n frames (their frames add
// up to n).
func msgCount(o *segOffload, n int) int {
	k := 0
	for seen := 0; seen < n; k++ {
		seen += int(o.msgs[k].Hdr.Iovlen) - 1
	}
	return k
}

func TestSegmentJoinRules(t *testing.T) {
	full := 1448
	for _, fl := range []struct {
		name string
		f    segFlow
	}{{"IPv4", testFlow4}, {"IPv6", testFlow6}} {
		t.Run(fl.name, func(t *testing.T) {
			for _, c := range []struct {
				name  string
				specs []segSpec
				runs  []int // nil: nothing joins, the flush stays on the AF_XDP ring
			}{
				// net/http's answer and the flush after it.
				{"answer", []segSpec{{size: full}, {size: full}, {size: 1200, psh: true}, {size: 150, psh: true}}, []int{4}},
				{"with FIN", []segSpec{{size: full}, {size: 10, psh: true, fin: true}}, []int{2}},
				{"bare FIN after the answer", []segSpec{{size: full}, {size: 700, psh: true}, {size: 0, fin: true}}, []int{3}},
				{"pure ACK after data", []segSpec{{size: full}, {size: 0}}, nil},
				{"FIN in the middle", []segSpec{{size: full}, {size: 10, psh: true, fin: true}, {size: 10}}, []int{2, 1}},
				{"two writes", []segSpec{{size: 600, psh: true}, {size: 600, psh: true}}, []int{2}},
				// Too small to ask a device to cut at: sent as they are.
				{"two small writes", []segSpec{{size: 100, psh: true}, {size: 100, psh: true}}, []int{1, 1}},
				{"a small answer and a bare FIN", []segSpec{{size: 100, psh: true}, {size: 0, fin: true}}, []int{2}},
				{"sequence gap", []segSpec{{size: full}, {size: full, seqGap: 1}}, nil},
				{"a write's end in the middle", []segSpec{{size: full, psh: true}, {size: full}}, []int{2}},
				{"short then full", []segSpec{{size: 1000}, {size: full}}, nil},
				{"longer than the first", []segSpec{{size: 1000}, {size: full}, {size: full}}, []int{1, 2}},
				{"other connection", []segSpec{{size: full}, {size: full, srcPort: 81}}, nil},
				{"timestamp moved", []segSpec{{size: full}, {size: full, tsval: 8}}, nil},
				{"TOS differs", []segSpec{{size: full}, {size: full, tos: 4}}, nil},
				{"short in the middle", []segSpec{{size: full}, {size: 5, psh: true}, {size: full}, {size: full, psh: true}}, []int{4}},
				{"two runs", []segSpec{{size: full}, {size: 5, psh: true}, {size: full, seqGap: 1}, {size: full, psh: true}}, []int{2, 2}},
				{"pure ACK first", []segSpec{{size: 0}, {size: full}, {size: full}}, []int{1, 2}},
			} {
				t.Run(c.name, func(t *testing.T) {
					frames := buildSegments(t, fl.f, c.specs)
					if got := runsOf(frames); !slices.Equal(got, c.runs) {
						t.Fatalf("runs %v, want %v", got, c.runs)
					}
				})
			}
		})
	}
	t.Run("VLAN", func(t *testing.T) {
		frames := buildSegments(t, testFlow4, []segSpec{{size: full}, {size: full}})
		for i, f := range frames {
			tagged := append(append(append([]byte(nil), f[:12]...), 0x81, 0x00, 0x00, 0x05), f[12:]...)
			frames[i] = tagged
		}
		if runs := runsOf(frames); runs != nil {
			t.Fatalf("tagged frames joined: %v", runs)
		}
	})
	t.Run("IPv4 options", func(t *testing.T) {
		frames := buildSegments(t, testFlow4, []segSpec{{size: full}, {size: full}})
		for _, f := range frames {
			f[ethHeader] = 0x46 // a header of 24 bytes: no longer parsed as plain
		}
		if runs := runsOf(frames); runs != nil {
			t.Fatalf("frames with IPv4 options joined: %v", runs)
		}
	})
	t.Run("family the device does not segment", func(t *testing.T) {
		for _, c := range []struct {
			f   segFlow
			tso uint32
		}{{testFlow4, tsoIPv6}, {testFlow6, tsoIPv4}, {testFlow4, 0}} {
			o := offloadForTest(2)
			if o.plan(buildSegments(t, c.f, []segSpec{{size: full}, {size: full}}), c.tso) {
				t.Fatalf("%v joined with offloads %b", c.f.src, c.tso)
			}
		}
	})
	t.Run("too many", func(t *testing.T) {
		specs := make([]segSpec, gsoMaxSegments+3)
		for i := range specs {
			specs[i].size = 600
		}
		frames := buildSegments(t, testFlow4, specs)
		if runs := runsOf(frames); !slices.Equal(runs, []int{gsoMaxSegments, 3}) {
			t.Fatalf("runs %v, want %d and 3", runs, gsoMaxSegments)
		}
	})
}

// cutLikeTSO cuts an offload packet with its virtio-net header the way the
// kernel's software GSO (and a NIC's TSO) does: headers repeated, sequence
// numbers advanced, IPv4 IDs counted up, FIN and PSH only on the last
// segment, every length and checksum computed in full.
func cutLikeTSO(t *testing.T, vh [vnetHdrLen]byte, pkt []byte) [][]byte {
	t.Helper()
	hdrLen := int(binary.LittleEndian.Uint16(vh[2:]))
	size := int(binary.LittleEndian.Uint16(vh[4:]))
	l4 := int(binary.LittleEndian.Uint16(vh[6:]))
	v6 := pkt[ethHeader]>>4 == 6
	switch {
	case vh[0] != vnetNeedsCsum || binary.LittleEndian.Uint16(vh[8:]) != tcpChecksumField:
		t.Fatalf("virtio-net header % x: want a partial TCP checksum", vh)
	case vh[1] == 0:
		size = len(pkt) // one segment: only its checksum to complete
	case size == 0 || vh[1] != map[bool]byte{false: vnetGSOTCPv4, true: vnetGSOTCPv6}[v6]:
		t.Fatalf("virtio-net header % x: want the family's GSO type and a segment size", vh)
	}
	payload := pkt[hdrLen:]
	flags := header.TCP(pkt[l4:]).Flags()
	var out [][]byte
	for i, off := 0, 0; off < len(payload); i++ {
		n := min(size, len(payload)-off)
		seg := append(append([]byte(nil), pkt[:hdrLen]...), payload[off:off+n]...)
		tcp := header.TCP(seg[l4:])
		tcp.SetSequenceNumber(header.TCP(pkt[l4:]).SequenceNumber() + uint32(off))
		if off+n < len(payload) {
			tcp.SetFlags(uint8(flags &^ (header.TCPFlagFin | header.TCPFlagPsh)))
		}
		var src, dst tcpip.Address
		if v6 {
			ip := header.IPv6(seg[ethHeader:])
			ip.SetPayloadLength(uint16(len(seg) - l4))
			src, dst = ip.SourceAddress(), ip.DestinationAddress()
		} else {
			ip := header.IPv4(seg[ethHeader:])
			ip.SetTotalLength(uint16(len(seg) - ethHeader))
			ip.SetID(header.IPv4(pkt[ethHeader:]).ID() + uint16(i))
			ip.SetChecksum(0)
			ip.SetChecksum(^ip.CalculateChecksum())
			src, dst = ip.SourceAddress(), ip.DestinationAddress()
		}
		tcp.SetChecksum(0)
		tcp.SetChecksum(^checksum.Checksum(seg[l4:], header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(len(seg)-l4))))
		out = append(out, seg)
		off += n
	}
	return out
}

// TestSegmentOffloadPacket checks the offload packet a run becomes: cut
// as a NIC or the kernel cuts it, it gives back the very frames it was
// joined from when they were whole segments, and the frames a TCP sender
// would have made of the same bytes when they were not (writes that met
// in the flush); its TCP checksum holds the pseudo-header sum a device
// completes.
func TestSegmentOffloadPacket(t *testing.T) {
	for _, fl := range []struct {
		name string
		f    segFlow
	}{{"IPv4", testFlow4}, {"IPv6", testFlow6}} {
		for _, c := range []struct {
			name      string
			sent, cut []segSpec
		}{
			{"whole segments", []segSpec{{size: 1448}, {size: 1448}, {size: 1448}, {size: 700, psh: true}}, nil},
			{"writes that meet", []segSpec{{size: 1448}, {size: 1448}, {size: 1200, psh: true}, {size: 150, psh: true}},
				[]segSpec{{size: 1448}, {size: 1448}, {size: 1350, psh: true}}},
			{"a bare FIN after the answer", []segSpec{{size: 700, psh: true}, {size: 0, fin: true}},
				[]segSpec{{size: 700, fin: true}}},
		} {
			t.Run(fl.name+"/"+c.name, func(t *testing.T) {
				frames := buildSegments(t, fl.f, c.sent)
				want := cloneFrames(frames)
				if c.cut != nil {
					want = buildSegments(t, fl.f, c.cut)
				}
				o := offloadForTest(len(frames))
				if !o.plan(frames, tsoIPv4|tsoIPv6) {
					t.Fatal("the segments do not join")
				}
				o.send(frames)
				if n := msgCount(o, len(frames)); n != 1 {
					t.Fatalf("%d messages, want one", n)
				}
				var pkt []byte
				iovs := o.iovs[1:o.msgs[0].Hdr.Iovlen]
				for _, v := range iovs {
					pkt = append(pkt, unsafeBytes(v)...)
				}
				vh := o.vnet[0]
				l4 := int(binary.LittleEndian.Uint16(vh[6:]))
				var src, dst tcpip.Address
				if fl.f.src.Addr().Is4() {
					ip := header.IPv4(pkt[ethHeader:])
					if !ip.IsChecksumValid() || int(ip.TotalLength()) != len(pkt)-ethHeader {
						t.Fatalf("IPv4 header of the offload packet: checksum valid %v, length %d of %d", ip.IsChecksumValid(), ip.TotalLength(), len(pkt)-ethHeader)
					}
					src, dst = ip.SourceAddress(), ip.DestinationAddress()
				} else {
					ip := header.IPv6(pkt[ethHeader:])
					if int(ip.PayloadLength()) != len(pkt)-l4 {
						t.Fatalf("IPv6 payload length %d, want %d", ip.PayloadLength(), len(pkt)-l4)
					}
					src, dst = ip.SourceAddress(), ip.DestinationAddress()
				}
				if got, want := header.TCP(pkt[l4:]).Checksum(), header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(len(pkt)-l4)); got != want {
					t.Fatalf("TCP checksum field %#04x, want the pseudo-header sum %#04x", got, want)
				}
				got := cutLikeTSO(t, vh, pkt)
				if len(got) != len(want) {
					t.Fatalf("cut into %d segments, want %d", len(got), len(want))
				}
				for i := range got {
					if !bytes.Equal(got[i], want[i]) {
						t.Fatalf("segment %d differs:\n got % x\nwant % x", i, got[i], want[i])
					}
				}
				if n := uint64(len(frames)); o.joined.Load() != n || o.lost.Load() != n {
					t.Fatalf("joined %d lost %d, want %d and %d (a socket-less send loses all)", o.joined.Load(), o.lost.Load(), n, n)
				}
			})
		}
	}
}

func unsafeBytes(v unix.Iovec) []byte {
	if v.Len == 0 {
		return nil
	}
	return unsafe.Slice(v.Base, int(v.Len))
}

// TestSegmentOffloadAllocatesNothing: planning and sending a flush, joined
// runs and lone frames, allocates nothing.
func TestSegmentOffloadAllocatesNothing(t *testing.T) {
	pristine := buildSegments(t, testFlow4, []segSpec{{size: 1448}, {size: 1448}, {size: 1200, psh: true}, {size: 150, psh: true}, {size: 0}})
	frames := cloneFrames(pristine)
	o := offloadForTest(len(frames))
	allocs := testing.AllocsPerRun(200, func() {
		for i := range frames {
			copy(frames[i], pristine[i])
		}
		if o.plan(frames, tsoIPv4|tsoIPv6) {
			o.send(frames)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per flush, want 0", allocs)
	}
	if o.joined.Load() == 0 {
		t.Fatal("nothing was joined: the loop measured the wrong path")
	}
}

// TestSegmentOffloadOnTheWire sends joined runs through a real packet
// socket on a veth and reads what the peer receives. With the sender's
// offloads on, a run arrives as one packet of all its bytes, as the
// kernel's own TCP sends it through a veth. With them off, the bridge
// would not join (tsoOf), and the kernel's software segmentation, reached
// here through the qdisc, cuts a joined run back into exactly the frames
// it was joined from, checksums completed from the partial one.
func TestSegmentOffloadOnTheWire(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, offloads := range []bool{true, false} {
		for _, v6 := range []bool{false, true} {
			name := map[bool]string{true: "offloads on", false: "offloads off"}[offloads] + map[bool]string{false: "/IPv4", true: "/IPv6"}[v6]
			t.Run(name, func(t *testing.T) {
				a, b, v := topology.Pair(t, topology.VethOptions{})
				if err := ethtool.SetOffloads(a, v.A.Name, offloads); err != nil {
					t.Fatal(err)
				}
				f := segFlow{srcMAC: v.A.MAC, dstMAC: v.B.MAC,
					src: netip.AddrPortFrom(v.A.Addr4.Addr(), 80), dst: netip.AddrPortFrom(v.B.Addr4.Addr(), 40000)}
				if v6 {
					f.src, f.dst = netip.AddrPortFrom(v.A.Addr6.Addr(), 80), netip.AddrPortFrom(v.B.Addr6.Addr(), 40000)
				}
				mss := 1448 // a 1500-byte MTU less the headers and the timestamps
				if v6 {
					mss -= 20
				}
				// The last segment is not the run's next (a gap), so it
				// leaves alone.
				want := buildSegments(t, f, []segSpec{{size: mss}, {size: mss}, {size: 1200, psh: true}, {size: 150, psh: true, seqGap: 1}})
				var rx int
				if err := b.Do(func() (err error) {
					rx, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
					if err != nil {
						return err
					}
					return unix.Bind(rx, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: v.B.Index})
				}); err != nil {
					t.Fatal(err)
				}
				defer unix.Close(rx)
				var o *segOffload
				var tso uint32
				if err := a.Do(func() error {
					feats, err := features.Open(v.A.Name)
					if err != nil {
						return err
					}
					tso = tsoOf(feats)
					feats.Close()
					o, err = newSegOffload(v.A.Index, 8)
					return err
				}); err != nil {
					t.Fatal(err)
				}
				defer o.close()
				frames := cloneFrames(want)
				if !offloads {
					if tso != 0 {
						t.Fatalf("offloads %b on a veth with TSO off", tso)
					}
					if o.plan(frames, tso) {
						t.Fatal("segments joined for a device that cannot cut them")
					}
					// Joined all the same, the run is refused and lost
					// alone: the lone segment after it still leaves.
					if !o.plan(frames, tsoIPv4|tsoIPv6) {
						t.Fatal("the segments do not join")
					}
					if n := o.send(frames); n != 1 || o.lost.Load() != 3 {
						t.Fatalf("a refused run: %d frames sent, %d lost; want 1 and 3", n, o.lost.Load())
					}
					if got := receiveFlow(t, rx, f, 1, 3*time.Second); len(got) != 1 || !bytes.Equal(got[0], want[3]) {
						t.Fatalf("after a refused run, received %v bytes, want the lone segment", lens(got))
					}
					frames = cloneFrames(want)
					// The qdisc's path segments in software, which the
					// bypass (production's path) does not.
					if err := unix.SetsockoptInt(o.fd, unix.SOL_PACKET, unix.PACKET_QDISC_BYPASS, 0); err != nil {
						t.Fatal(err)
					}
					tso = tsoIPv4 | tsoIPv6
				}
				if !o.plan(frames, tso) {
					t.Fatal("the segments do not join")
				}
				if n := o.send(frames); n != len(frames) {
					t.Fatalf("sent %d of %d frames", n, len(frames))
				}
				if offloads {
					got := receiveFlow(t, rx, f, 2, 3*time.Second)
					joined := append(append([]byte(nil), want[0]...), want[1][len(want[1])-mss:]...)
					joined = append(joined, want[2][len(want[2])-1200:]...)
					if len(got) != 2 || len(got[0]) != len(joined) || !bytes.Equal(got[0][len(got[0])-3000:], joined[len(joined)-3000:]) || !bytes.Equal(got[1], want[3]) {
						t.Fatalf("received %d packets (%v bytes), want 2: the joined run of %d bytes and the lone segment", len(got), lens(got), len(joined))
					}
					// An answer's last segment and the bare FIN after it
					// arrive as one segment that carries the FIN.
					closing := buildSegments(t, f, []segSpec{{size: 700, psh: true}, {size: 0, fin: true}})
					if !o.plan(closing, tso) {
						t.Fatal("a bare FIN does not join the segment before it")
					}
					if n := o.send(closing); n != 2 {
						t.Fatalf("sent %d of 2 frames", n)
					}
					got = receiveFlow(t, rx, f, 1, 3*time.Second)
					if len(got) != 1 || len(got[0]) != len(closing[0]) || !bytes.Equal(got[0][len(got[0])-700:], closing[0][len(closing[0])-700:]) {
						t.Fatalf("received %d packets (%v bytes), want one of %d bytes", len(got), lens(got), len(closing[0]))
					}
					l4 := ethHeader + header.IPv4MinimumSize
					if v6 {
						l4 = ethHeader + header.IPv6MinimumSize
					}
					if fl := header.TCP(got[0][l4:]).Flags(); fl&header.TCPFlagFin == 0 {
						t.Fatalf("the segment's flags %v carry no FIN", fl)
					}
					return
				}
				got := receiveFlow(t, rx, f, len(want), 3*time.Second)
				if len(got) != len(want) {
					t.Fatalf("received %d packets (%v bytes), want the %d segments", len(got), lens(got), len(want))
				}
				for i := range got {
					if !bytes.Equal(got[i], want[i]) {
						t.Fatalf("segment %d differs from the frame it was joined from:\n got % x\nwant % x", i, got[i], want[i])
					}
				}
			})
		}
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func lens(ps [][]byte) []int {
	var n []int
	for _, p := range ps {
		n = append(n, len(p))
	}
	return n
}

// receiveFlow reads frames of flow f from a packet socket until it has
// want of them or the time is up.
func receiveFlow(t *testing.T, fd int, f segFlow, want int, wait time.Duration) [][]byte {
	t.Helper()
	tv := unix.NsecToTimeval((100 * time.Millisecond).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<16)
	var got [][]byte
	deadline := time.Now().Add(wait)
	for len(got) < want && time.Now().Before(deadline) {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			continue
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		p := gopacket.NewPacket(buf[:n], layers.LayerTypeEthernet, gopacket.NoCopy)
		tcp, ok := p.Layer(layers.LayerTypeTCP).(*layers.TCP)
		if !ok || uint16(tcp.SrcPort) != f.src.Port() || uint16(tcp.DstPort) != f.dst.Port() {
			continue
		}
		got = append(got, append([]byte(nil), buf[:n]...))
	}
	return got
}
