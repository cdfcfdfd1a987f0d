package capture

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

var (
	app    = netip.MustParseAddrPort("198.18.0.1:80")
	client = netip.MustParseAddrPort("198.18.0.2:40000")
	app6   = netip.MustParseAddrPort("[2001:db8::1]:53")
	peer6  = netip.MustParseAddrPort("[2001:db8::2]:5353")
)

func TestFilter(t *testing.T) {
	tcpIn := ippkt.TCP(client, app, 1, 0, true, false, false, nil)
	tcpOut := ippkt.TCP(app, client, 9, 2, true, true, false, nil)
	udp6 := ippkt.UDP(peer6, app6, []byte("q"))
	for _, tc := range []struct {
		expr string
		want [3]bool // tcpIn, tcpOut, udp6
	}{
		{"", [3]bool{true, true, true}},
		{"tcp", [3]bool{true, true, false}},
		{"udp and port 53", [3]bool{false, false, true}},
		{"port 80", [3]bool{true, true, false}},
		{"dst port 80", [3]bool{true, false, false}},
		{"src port 80", [3]bool{false, true, false}},
		{"host 198.18.0.2", [3]bool{true, true, false}},
		{"src host 198.18.0.2 and tcp", [3]bool{true, false, false}},
		{"dst host 2001:db8::1", [3]bool{false, false, true}},
		{"port 9", [3]bool{false, false, false}},
	} {
		f, err := ParseFilter(tc.expr)
		if err != nil {
			t.Fatalf("%q: %v", tc.expr, err)
		}
		got := [3]bool{f.Match(tcpIn), f.Match(tcpOut), f.Match(udp6)}
		if got != tc.want {
			t.Errorf("%q: %v, want %v", tc.expr, got, tc.want)
		}
	}
	for _, bad := range []string{"port", "host x", "port 70000", "tcp or udp", "not tcp", "src tcp", "ether host 1", "dst"} {
		if _, err := ParseFilter(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	f, _ := ParseFilter("tcp")
	for _, junk := range [][]byte{nil, {0x45}, {0x60, 1, 2}, {0x10, 0, 0, 0}} {
		if f.Match(junk) {
			t.Errorf("junk %x matched", junk)
		}
	}
}

func TestSessionWritesPcap(t *testing.T) {
	f, _ := ParseFilter("tcp")
	s := NewSession(Options{Filter: f, Snaplen: 60, Count: 3})
	var buf bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- s.Run(context.Background(), &buf, nil) }()
	t0 := time.Unix(1700000000, 123456000)
	big := ippkt.TCP(client, app, 1, 0, false, true, false, bytes.Repeat([]byte("x"), 100))
	s.Packet(In, t0, big)
	s.Packet(In, t0, ippkt.UDP(peer6, app6, nil)) // filtered
	s.Packet(Out, t0.Add(time.Millisecond), ippkt.TCP(app, client, 9, 2, true, true, false, nil))
	s.Packet(In, t0.Add(2*time.Millisecond), ippkt.TCP(client, app, 2, 10, false, true, false, nil))
	s.Packet(In, t0, big) // beyond Count
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("session did not end at its count")
	}
	if c, d, fl := s.Stats(); c != 3 || d != 0 || fl != 1 {
		t.Errorf("stats %d %d %d", c, d, fl)
	}

	r, err := readPcap(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if r.linkType != layers.LinkTypeRaw || r.snaplen != 60 {
		t.Errorf("link type %v snaplen %d", r.linkType, r.snaplen)
	}
	if len(r.records) != 3 {
		t.Fatalf("%d records, want 3", len(r.records))
	}
	ci, data := r.records[0].ci, r.records[0].data
	if ci.CaptureLength != 60 || ci.Length != len(big) || !ci.Timestamp.Equal(t0) || !bytes.Equal(data, big[:60]) {
		t.Errorf("first record: %+v, %d bytes", ci, len(data))
	}
	// gopacket decodes the raw IP record.
	p := gopacket.NewPacket(data, layers.LayerTypeIPv4, gopacket.Default)
	if tl, _ := p.Layer(layers.LayerTypeTCP).(*layers.TCP); tl == nil || tl.DstPort != 80 {
		t.Errorf("not decodable as TCP: %v", p)
	}
	if d := r.records[2].ci.Timestamp.Sub(t0); d != 2*time.Millisecond {
		t.Errorf("third record %v after the first, want 2ms", d)
	}
}

type pcapFile struct {
	snaplen  uint32
	linkType layers.LinkType
	records  []struct {
		ci   gopacket.CaptureInfo
		data []byte
	}
}

// readPcap is an independent reader of the classic format.
func readPcap(b []byte) (*pcapFile, error) {
	if len(b) < 24 || binary.LittleEndian.Uint32(b) != 0xa1b2c3d4 || binary.LittleEndian.Uint16(b[4:]) != 2 || binary.LittleEndian.Uint16(b[6:]) != 4 {
		return nil, fmt.Errorf("bad pcap header % x", b[:min(len(b), 24)])
	}
	f := &pcapFile{snaplen: binary.LittleEndian.Uint32(b[16:]), linkType: layers.LinkType(binary.LittleEndian.Uint32(b[20:]))}
	for b = b[24:]; len(b) > 0; {
		if len(b) < 16 {
			return nil, io.ErrUnexpectedEOF
		}
		sec, usec := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:])
		incl, orig := int(binary.LittleEndian.Uint32(b[8:])), int(binary.LittleEndian.Uint32(b[12:]))
		if len(b) < 16+incl || incl > int(f.snaplen) {
			return nil, io.ErrUnexpectedEOF
		}
		f.records = append(f.records, struct {
			ci   gopacket.CaptureInfo
			data []byte
		}{gopacket.CaptureInfo{Timestamp: time.Unix(int64(sec), int64(usec)*1000), CaptureLength: incl, Length: orig}, b[16 : 16+incl]})
		b = b[16+incl:]
	}
	return f, nil
}

func TestSessionDropsInsteadOfBlocking(t *testing.T) {
	s := NewSession(Options{Queue: 4})
	pkt := ippkt.UDP(peer6, app6, []byte("x"))
	start := time.Now()
	for range 100 {
		s.Packet(In, time.Now(), pkt) // nobody runs the writer
	}
	if time.Since(start) > time.Second {
		t.Fatal("Packet blocked")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var buf bytes.Buffer
	if err := s.Run(ctx, &buf, nil); err != nil {
		t.Fatal(err)
	}
	if c, d, _ := s.Stats(); c != 4 || d != 96 {
		t.Errorf("captured %d dropped %d, want 4 and 96", c, d)
	}
}

// TestTsharkReadsIt has Wireshark's command-line reader decode a capture,
// the proof that the files open in Wireshark. CI installs tshark.
func TestTsharkReadsIt(t *testing.T) {
	tshark, err := exec.LookPath("tshark")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("tshark is not installed")
		}
		t.Skip("tshark is not installed")
	}
	s := NewSession(Options{Count: 2})
	var buf bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- s.Run(context.Background(), &buf, nil) }()
	s.Packet(In, time.Now(), ippkt.TCP(client, app, 1, 0, true, false, false, nil))
	s.Packet(Out, time.Now(), ippkt.UDP(app6, peer6, []byte("answer")))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "c.pcap")
	os.WriteFile(path, buf.Bytes(), 0o644)
	var stderr bytes.Buffer
	cmd := exec.Command(tshark, "-r", path, "-T", "fields", "-E", "separator=,", "-e", "ip.src", "-e", "ipv6.src", "-e", "tcp.dstport", "-e", "udp.dstport")
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tshark: %v\n%s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	want := []string{"198.18.0.2,,80,", ",2001:db8::1,,5353"}
	if strings.Join(lines, "|") != strings.Join(want, "|") {
		t.Errorf("tshark decoded:\n%s\nwant:\n%s", out, strings.Join(want, "\n"))
	}
}

// lockedBuffer is a bytes.Buffer a test reads while the writer writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return bytes.Clone(l.b.Bytes())
}

// TestSessionWritesInTimestampOrder: an answer offered before the packet
// it answers (as the bridge's TX loop can) is written after it, and held
// packets reach the file within the hold time, not only at the end.
func TestSessionWritesInTimestampOrder(t *testing.T) {
	s := NewSession(Options{Hold: 30 * time.Millisecond})
	var buf lockedBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, &buf, nil) }()
	t0 := time.Now()
	syn := ippkt.TCP(client, app, 1, 0, true, false, false, nil)
	synAck := ippkt.TCP(app, client, 9, 2, true, true, false, nil)
	ack := ippkt.TCP(client, app, 2, 10, false, true, false, nil)
	s.Packet(Out, t0.Add(time.Millisecond), synAck)
	s.Packet(In, t0, syn)
	s.Packet(In, t0.Add(2*time.Millisecond), ack)
	var r *pcapFile
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		b := buf.bytes()
		// Before the header, or in the middle of a record, the file does
		// not parse yet.
		if f, err := readPcap(b); err == nil && len(f.records) == 3 {
			r = f
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of 3 records written while the session runs", len(r.records))
		}
	}
	if since := time.Since(t0); since < 30*time.Millisecond {
		t.Errorf("written after %v, before the hold time", since)
	}
	for i, want := range [][]byte{syn, synAck, ack} {
		if !bytes.Equal(r.records[i].data, want) {
			t.Errorf("record %d is not the %s", i, []string{"SYN", "SYN-ACK", "ACK"}[i])
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
