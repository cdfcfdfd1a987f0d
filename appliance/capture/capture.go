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
package capture

import (
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
	Queue int
}

type record struct {
	ts   time.Time
	size int
	data []byte
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

// Run writes the pcap header and then every accepted packet to w, calling
// flush (if not nil) whenever the queue runs empty, until ctx ends or the
// session has its Count; then it writes what is still queued and returns.
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
	drain := func() error {
		for {
			select {
			case r := <-s.queue:
				if err := write(r); err != nil {
					return err
				}
			default:
				return nil
			}
		}
	}
	for {
		select {
		case r := <-s.queue:
			if err := write(r); err != nil {
				s.stop()
				return err
			}
			if len(s.queue) == 0 && flush != nil {
				flush()
			}
		case <-s.done:
			return drain()
		case <-ctx.Done():
			s.stop()
			if err := drain(); err != nil {
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
