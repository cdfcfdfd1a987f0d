// Package capture records the packets of one application stream, both
// directions, into a pcap file that tcpdump and Wireshark read (the classic
// libpcap format, microsecond timestamps, link type RAW: each record is an
// IPv4 or IPv6 packet as it crosses the stream).
//
// The format is written here, 24 bytes of file header and 16 per record,
// rather than with gopacket's pcapgo, whose package would add
// golang.org/x/net to the module for its live-capture half.
//
// Capturing must never slow the data path down to the speed of a disk or a
// network client, so Session.Packet copies the packet into a bounded queue
// and returns at once; when the queue is full the packet is counted as
// dropped by the capture, never held up.
//
// Records are written in timestamp order, not in the order they were
// offered: the bridge hands an inbound packet to the capture after the
// application could read it, so the application's answer, seen by another
// loop, may be offered first. The writer holds each packet for a short
// while (Options.Hold) and writes what it holds in timestamp order, so a
// file reads cause before effect.
package capture

import (
	"container/heap"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// Direction says which way a packet crossed the stream.
type Direction uint8

const (
	// In: from the wire to the application.
	In Direction = iota
	// Out: from the application to the wire.
	Out
)

func (d Direction) String() string {
	if d == Out {
		return "out"
	}
	return "in"
}

// Options bound a session.
type Options struct {
	// Filter selects packets; the zero Filter takes all.
	Filter Filter
	// Snaplen is how many bytes of each packet are kept; default 65535.
	Snaplen int
	// Count stops the session after this many packets; 0 means no limit.
	Count int
	// Queue is how many packets may wait for the writer; default 4096.
	// The writer holds as many again while it puts them in order.
	Queue int
	// Hold is how long the writer keeps a packet back for ones stamped
	// earlier that are offered later; default 20ms.
	Hold time.Duration
}

type record struct {
	ts   time.Time
	size int
	data []byte

	seq     uint64    // order of arrival at the writer, for equal stamps
	arrived time.Time // when the writer took it
}

// held is the writer's records in timestamp order (a min-heap).
type held []record

func (h held) Len() int { return len(h) }
func (h held) Less(i, j int) bool {
	if !h[i].ts.Equal(h[j].ts) {
		return h[i].ts.Before(h[j].ts)
	}
	return h[i].seq < h[j].seq
}
func (h held) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *held) Push(x any)   { *h = append(*h, x.(record)) }
func (h *held) Pop() any {
	old := *h
	r := old[len(old)-1]
	old[len(old)-1] = record{}
	*h = old[:len(old)-1]
	return r
}

// Session is one capture in progress.
type Session struct {
	opts  Options
	queue chan record
	done  chan struct{}
	once  sync.Once

	captured, dropped, filtered atomic.Uint64
	accepted                    atomic.Int64
}

// NewSession starts a session; Run writes it out.
func NewSession(opts Options) *Session {
	if opts.Snaplen <= 0 || opts.Snaplen > 65535 {
		opts.Snaplen = 65535
	}
	if opts.Queue <= 0 {
		opts.Queue = 4096
	}
	if opts.Hold <= 0 {
		opts.Hold = 20 * time.Millisecond
	}
	return &Session{opts: opts, queue: make(chan record, opts.Queue), done: make(chan struct{})}
}

// Packet offers one packet to the session. It copies what it keeps and never
// blocks; it is safe to call from several goroutines.
func (s *Session) Packet(dir Direction, ts time.Time, pkt []byte) {
	select {
	case <-s.done:
		return
	default:
	}
	if !s.opts.Filter.Match(pkt) {
		s.filtered.Add(1)
		return
	}
	var nth int64
	if s.opts.Count > 0 {
		if nth = s.accepted.Add(1); nth > int64(s.opts.Count) {
			return
		}
	}
	n := min(len(pkt), s.opts.Snaplen)
	r := record{ts: ts, size: len(pkt), data: append([]byte(nil), pkt[:n]...)}
	select {
	case s.queue <- r:
	default:
		s.dropped.Add(1)
	}
	if nth == int64(s.opts.Count) && nth > 0 {
		s.stop() // the last one is queued: Run writes it, then ends
	}
}

func (s *Session) stop() { s.once.Do(func() { close(s.done) }) }

// Done is closed when the session has taken its Count of packets.
func (s *Session) Done() <-chan struct{} { return s.done }

// Stats reports packets written, dropped because the writer fell behind,
// and left out by the filter.
func (s *Session) Stats() (captured, dropped, filtered uint64) {
	return s.captured.Load(), s.dropped.Load(), s.filtered.Load()
}

// Run writes the pcap header and then every accepted packet to w, in
// timestamp order, each once it has been held for Options.Hold (sooner if
// the writer holds more than Options.Queue), calling flush (if not nil)
// after each round of writes, until ctx ends or the session has its Count;
// then it writes what is still queued and held, and returns.
func (s *Session) Run(ctx context.Context, w io.Writer, flush func()) error {
	if _, err := w.Write(fileHeader(s.opts.Snaplen)); err != nil {
		return err
	}
	if flush != nil {
		flush()
	}
	var hdr [16]byte
	write := func(r record) error {
		us := r.ts.UnixMicro()
		binary.LittleEndian.PutUint32(hdr[0:], uint32(us/1e6))
		binary.LittleEndian.PutUint32(hdr[4:], uint32(us%1e6))
		binary.LittleEndian.PutUint32(hdr[8:], uint32(len(r.data)))
		binary.LittleEndian.PutUint32(hdr[12:], uint32(r.size))
		if _, err := w.Write(hdr[:]); err != nil {
			return err
		}
		if _, err := w.Write(r.data); err != nil {
			return err
		}
		s.captured.Add(1)
		return nil
	}
	var (
		h   held
		seq uint64
	)
	take := func(r record) {
		seq++
		r.seq, r.arrived = seq, time.Now()
		heap.Push(&h, r)
	}
	// release writes, in order, what has been held long enough (all of
	// it if all).
	release := func(all bool) error {
		wrote := false
		for len(h) > 0 && (all || len(h) > s.opts.Queue || time.Since(h[0].arrived) >= s.opts.Hold) {
			if err := write(heap.Pop(&h).(record)); err != nil {
				return err
			}
			wrote = true
		}
		if wrote && flush != nil {
			flush()
		}
		return nil
	}
	finish := func() error {
		for {
			select {
			case r := <-s.queue:
				take(r)
			default:
				return release(true)
			}
		}
	}
	tick := time.NewTicker(s.opts.Hold / 4)
	defer tick.Stop()
	for {
		select {
		case r := <-s.queue:
			take(r)
			if len(h) > s.opts.Queue {
				if err := release(false); err != nil {
					s.stop()
					return err
				}
			}
		case <-tick.C:
			if err := release(false); err != nil {
				s.stop()
				return err
			}
		case <-s.done:
			return finish()
		case <-ctx.Done():
			s.stop()
			if err := finish(); err != nil {
				return err
			}
			if errors.Is(context.Cause(ctx), context.DeadlineExceeded) || errors.Is(context.Cause(ctx), context.Canceled) {
				return nil
			}
			return context.Cause(ctx)
		}
	}
}

// LinkTypeRaw is the pcap link type of raw IPv4 and IPv6 packets.
const LinkTypeRaw = 101

// fileHeader is the classic pcap file header: magic (microsecond
// timestamps, little-endian), version 2.4, zone 0, sigfigs 0, snaplen,
// link type.
func fileHeader(snaplen int) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 0xa1b2c3d4)
	b = binary.LittleEndian.AppendUint16(b, 2)
	b = binary.LittleEndian.AppendUint16(b, 4)
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = binary.LittleEndian.AppendUint32(b, uint32(snaplen))
	return binary.LittleEndian.AppendUint32(b, LinkTypeRaw)
}

// Summary is the one line a capture ends with.
func (s *Session) Summary() string {
	c, d, f := s.Stats()
	return fmt.Sprintf("%d packets captured, %d dropped by the capture (writer too slow), %d not matching the filter", c, d, f)
}
