// Package ingesttest holds what the UDP offload tests share, whichever path
// fills the ring (the XDP engine or the bridge's AF_PACKET path): kernel
// UDP senders in a namespace, a trigger payload that depends on its source
// port and sequence number so that any mix-up shows, a consumer that
// drains a ring in the background and checks every record, and the
// malformed datagrams that must never reach a ring.
package ingesttest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"golang.org/x/sys/unix"
)

// Sender is a kernel UDP socket in a namespace, bound to one source port,
// sending to one destination (unconnected, so ICMP errors the receiving
// kernel may send back do not fail later sends).
type Sender struct {
	c    *net.UDPConn
	to   netip.AddrPort
	Port uint16
}

// NewSender binds local:sport in ns.
func NewSender(tb testing.TB, ns *topology.NS, local netip.Addr, sport uint16, to netip.AddrPort) *Sender {
	tb.Helper()
	var c *net.UDPConn
	if err := ns.Do(func() (err error) {
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, sport)))
		return err
	}); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return &Sender{c: c, to: to, Port: sport}
}

// Send sends one datagram.
func (s *Sender) Send(p []byte) error {
	_, err := s.c.WriteToUDPAddrPort(p, s.to)
	return err
}

// TriggerPayload is what source port sport sends as datagram seq: a
// trigger payload whose length and energies depend on both. Every 50th is
// the bare 4-byte sequence number, shorter than an Ethernet header: the
// XDP program cannot strip those whole.
func TriggerPayload(buf []byte, sport uint16, seq uint32) []byte {
	n := int(seq*7+uint32(sport)) % 700
	if seq%50 == 0 {
		n = 0
	}
	var e [700]uint16
	for i := range n {
		e[i] = uint16(seq) ^ uint16(sport)*uint16(i+1)
	}
	return buf[:ingest.PutTriggerPayload(buf, seq, e[:n])]
}

// CheckTrigger verifies a payload byte for byte against what its source
// port sends under the sequence number it carries.
func CheckTrigger(src ingest.Source, p []byte) error {
	if len(p) < 4 {
		return fmt.Errorf("%v: %d-byte payload", src, len(p))
	}
	var buf [1500]byte
	want := TriggerPayload(buf[:], src.SrcPort, binary.BigEndian.Uint32(p))
	if !bytes.Equal(p, want) {
		return fmt.Errorf("%v: payload % x, want % x", src, p[:min(len(p), 16)], want[:min(len(want), 16)])
	}
	return nil
}

// Reader drains a ring's consumer in the background: it checks every
// record's payload with a check function (if set), feeds the reference
// consumer, and releases each buffer. After Close, Ref, Bad and Err are the
// results; Records counts records as they come.
type Reader struct {
	C       *ingest.Consumer
	Ref     ingest.Reference
	Records atomic.Uint64
	Bad     []string // the first ten payloads that failed the check
	Err     error    // what stopped the reader early

	// Describe, if set, adds the producer side's counters to failures.
	Describe func() string

	mu   sync.Mutex
	stop atomic.Bool
	done chan struct{}
}

// NewReader opens the ring by name and starts draining it.
func NewReader(tb testing.TB, name string, check func(src ingest.Source, payload []byte) error) *Reader {
	tb.Helper()
	c, err := ingest.Open(name, ingest.ConsumerOptions{Spin: 200 * time.Microsecond})
	if err != nil {
		tb.Fatal(err)
	}
	r := &Reader{C: c, done: make(chan struct{})}
	tb.Cleanup(func() { r.Close(); c.Close() })
	go r.run(check)
	return r
}

func (r *Reader) run(check func(src ingest.Source, payload []byte) error) {
	defer close(r.done)
	for !r.stop.Load() {
		b, err := r.C.Next(20 * time.Millisecond)
		if errors.Is(err, ingest.ErrTimeout) {
			continue
		}
		if err != nil {
			if !errors.Is(err, ingest.ErrClosed) {
				r.Err = err
			}
			return
		}
		r.mu.Lock()
		if check != nil {
			it := b.Iter()
			for it.Next() {
				rec := it.Record()
				src, _ := r.C.Source(rec.Source)
				if err := check(src, rec.Payload); err != nil && len(r.Bad) < 10 {
					r.Bad = append(r.Bad, err.Error())
				}
			}
		}
		if err := r.Ref.Process(&b); err != nil {
			r.Err = err
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		r.Records.Add(uint64(b.Records))
		if err := r.C.Release(&b); err != nil {
			r.Err = err
			return
		}
	}
}

func (r *Reader) describe() string {
	if r.Describe == nil {
		return ""
	}
	return r.Describe()
}

// Close stops the reader (the consumer stays open for inspection).
func (r *Reader) Close() {
	if r.stop.Swap(true) {
		return
	}
	<-r.done
}

// CloseComplete stops the reader and fails the test unless it read, from
// exactly sources sources, perSource records each with sequence numbers
// 0..perSource-1, in order, none lost, every payload passing the check.
func (r *Reader) CloseComplete(tb testing.TB, sources, perSource int) {
	tb.Helper()
	r.Close()
	if r.Err != nil {
		tb.Fatal(r.Err)
	}
	if len(r.Bad) > 0 {
		tb.Fatalf("payloads differ: %v", r.Bad)
	}
	if got := len(r.Ref.Sources); got != sources {
		tb.Fatalf("%d sources in the ring, want %d", got, sources)
	}
	for i, s := range r.Ref.Sources {
		src, _ := r.C.Source(uint16(i))
		if s.Records != uint64(perSource) || s.FirstSeq != 0 || s.LastSeq != uint32(perSource-1) || s.SenderGaps != 0 || s.SenderBackwards != 0 || s.DroppedHere != 0 {
			tb.Errorf("source %d (%v): %+v", i, src, s)
		}
	}
}

// WaitRecords waits until the reader has seen n records; it fails the test
// if the reader stopped or d passed first.
func (r *Reader) WaitRecords(tb testing.TB, n uint64, d time.Duration) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for r.Records.Load() < n {
		select {
		case <-r.done:
			tb.Fatalf("the consumer stopped after %d of %d records: %v (%v)", r.Records.Load(), n, r.Err, r.describe())
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("the consumer saw %d of %d records (%v)", r.Records.Load(), n, r.describe())
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// SendPaced sends perSender trigger payloads (TriggerPayload) from every
// sender, chunk from each in turn, and after each round waits until r has
// seen them all: the senders go at the consumer's pace, so a test about
// correctness loses nothing to a full ring. r must have seen no records
// before.
func SendPaced(tb testing.TB, r *Reader, senders []*Sender, perSender, chunk int) {
	tb.Helper()
	var buf [1500]byte
	for base := 0; base < perSender; base += chunk {
		for _, s := range senders {
			for seq := base; seq < base+chunk; seq++ {
				if err := s.Send(TriggerPayload(buf[:], s.Port, uint32(seq))); err != nil {
					tb.Fatal(err)
				}
			}
		}
		r.WaitRecords(tb, uint64(len(senders)*(base+chunk)), 10*time.Second)
	}
}

// Endpoints are the addresses of a veth's outside end (Src) and inside
// end (Dst), for building frames by hand.
type Endpoints struct {
	Src4, Dst4, Src6, Dst6 netip.Addr
}

// MalformedFrames are UDP frames to dport, from sport, that an ingest rule
// matches but must refuse, for IPv4 and IPv6: a UDP length short of the IP
// payload, beyond it, under the header, an IP packet truncated by the
// frame, and a first and a later fragment. Their MAC addresses are left
// for the caller to fill in.
func MalformedFrames(ep Endpoints, sport, dport uint16) [][]byte {
	spec := func(v6 bool, payload int) framegen.Spec {
		s := framegen.Spec{L3: 4, L4: 17, Src: ep.Src4, Dst: ep.Dst4, SrcPort: sport, DstPort: dport, Payload: payload}
		if v6 {
			s.L3, s.Src, s.Dst = 6, ep.Src6, ep.Dst6
		}
		return s
	}
	edit := func(b []byte, f func([]byte)) []byte { f(b); return b }
	be := binary.BigEndian
	var bad [][]byte
	for _, v6 := range []bool{false, true} {
		l4 := 34
		if v6 {
			l4 = 54
		}
		whole := spec(v6, 100)
		first, later := whole, whole
		first.Frag, first.FragID = 1, 77
		later.Frag, later.FragID = 2, 77
		bad = append(bad,
			edit(whole.Build(), func(b []byte) { be.PutUint16(b[l4+4:], 8+99) }),  // UDP length short of the IP payload
			edit(whole.Build(), func(b []byte) { be.PutUint16(b[l4+4:], 8+101) }), // beyond it
			edit(whole.Build(), func(b []byte) { be.PutUint16(b[l4+4:], 7) }),     // under the header
			whole.Build()[:l4+8+50],      // truncated: IP length beyond the frame
			first.Build(), later.Build(), // a fragmented datagram
		)
	}
	return bad
}

// MaxShort is the longest payload of the short-payload checks: a few bytes
// beyond the Ethernet header's 14 that the XDP program must leave in front
// of a payload shorter than that (classifier.IngestMeta.PayloadOffset).
const MaxShort = 20

// ShortPayload is the n-byte payload of the short-payload checks. Its bytes
// depend on n and their position and are never 0xee (the padding
// ShortFrames adds), so a payload cut short, a header byte left in front
// or padding left behind all show.
func ShortPayload(n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(0x10*n+i) & 0x7f
	}
	return p
}

// ShortFrames are IPv4 UDP frames from ep.Src4:sport to ep.Dst4:dport with
// ShortPayload(0..MaxShort), each padded with 0xee bytes to the Ethernet
// minimum of 60 bytes as a NIC pads a short frame (the IP and UDP lengths
// leave the padding out). MAC addresses are left for the caller.
func ShortFrames(ep Endpoints, sport, dport uint16) [][]byte {
	var out [][]byte
	for n := 0; n <= MaxShort; n++ {
		f := framegen.Spec{L3: 4, L4: 17, Src: ep.Src4, Dst: ep.Dst4, SrcPort: sport, DstPort: dport, Payload: n}.Build()
		// The builder pads to 60 bytes with zeros already: write the
		// payload after the headers and recognisable padding after it.
		const hdr = 14 + 20 + 8
		f = f[:hdr+n]
		copy(f[hdr:], ShortPayload(n))
		// The UDP checksum no longer matches the payload: zero means none
		// for IPv4.
		binary.BigEndian.PutUint16(f[hdr-2:], 0)
		for len(f) < 60 {
			f = append(f, 0xee)
		}
		out = append(out, f)
	}
	return out
}

// SendShort sends every payload of MaxShort bytes and less from v4 and v6,
// and the frame of ShortFrames of the same length, addressed to v's bridge
// end, through raw, a packet socket on v's outside end.
func SendShort(t testing.TB, v4, v6 *Sender, raw int, frames [][]byte, v *topology.Veth) {
	t.Helper()
	for n := 0; n <= MaxShort; n++ {
		p := ShortPayload(n)
		if err := v4.Send(p); err != nil {
			t.Fatal(err)
		}
		if err := v6.Send(p); err != nil {
			t.Fatal(err)
		}
		f := frames[n]
		copy(f[0:6], v.A.MAC)
		copy(f[6:12], v.B.MAC)
		if err := unix.Sendto(raw, f, 0, &unix.SockaddrLinklayer{Ifindex: v.B.Index}); err != nil {
			t.Fatal(err)
		}
	}
}

// Collected is one record a Collect call read.
type Collected struct {
	Src     ingest.Source
	Payload []byte // a copy
}

// Collect opens the ring by name, calls send (a consumer sees only what
// is published after it attached), reads records until it has n or d has
// passed, and returns copies of them in ring order.
func Collect(tb testing.TB, name string, n int, d time.Duration, send func()) []Collected {
	tb.Helper()
	c, err := ingest.Open(name, ingest.ConsumerOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	defer c.Close()
	send()
	var out []Collected
	deadline := time.Now().Add(d)
	for len(out) < n && time.Now().Before(deadline) {
		b, err := c.Next(20 * time.Millisecond)
		if errors.Is(err, ingest.ErrTimeout) {
			continue
		}
		if err != nil {
			tb.Fatal(err)
		}
		it := b.Iter()
		for it.Next() {
			rec := it.Record()
			src, _ := c.Source(rec.Source)
			out = append(out, Collected{Src: src, Payload: bytes.Clone(rec.Payload)})
		}
		if err := it.Err(); err != nil {
			tb.Fatal(err)
		}
		c.Release(&b)
	}
	return out
}

// CheckShort fails the test unless got holds, from each source port in
// sports, exactly ShortPayload(0), ShortPayload(1), ... ShortPayload(MaxShort)
// in that order, and nothing else.
func CheckShort(tb testing.TB, got []Collected, sports ...uint16) {
	tb.Helper()
	next := map[uint16]int{}
	for _, p := range sports {
		next[p] = 0
	}
	for i, r := range got {
		n, ok := next[r.Src.SrcPort]
		switch {
		case !ok:
			tb.Errorf("record %d from unexpected source %v", i, r.Src)
			continue
		case n > MaxShort:
			tb.Errorf("record %d from %v: more than %d records", i, r.Src, MaxShort+1)
			continue
		}
		if want := ShortPayload(n); !bytes.Equal(r.Payload, want) {
			tb.Errorf("%v, datagram %d: payload [% x] (%d bytes), want [% x] (%d bytes)", r.Src, n, r.Payload, len(r.Payload), want, len(want))
		}
		next[r.Src.SrcPort] = n + 1
	}
	for p, n := range next {
		if n != MaxShort+1 {
			tb.Errorf("source port %d: %d of %d datagrams", p, n, MaxShort+1)
		}
	}
}
