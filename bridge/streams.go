package bridge

import (
	"sync/atomic"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// streamEntry is the bridge's side of one stream. The loops of every queue
// deliver into it (a fabric.BridgeEnd serialises its senders); exactly one
// queue's loop (txQueue) drains what the application sent.
type streamEntry struct {
	id      uint32
	s       fabric.BridgeEnd
	own     atomic.Pointer[ownership]
	txQueue int

	maxPayload                     int // the stream's slot size: longer packets are dropped
	rxPackets, rxBytes, rxRingFull atomic.Uint64
	rxTooBig                       atomic.Uint64
	txPackets, txBytes, txKernel   atomic.Uint64
	txRejects                      [numReasons]atomic.Uint64
	txHandedOn                     atomic.Uint64 // handed back and given a second chance elsewhere
	dead                           atomic.Bool   // TX found it broken or closed
	capture                        atomic.Pointer[captureHook]
}

// streamTable is an immutable id → stream map; changes copy it and swap the
// pointer, so loops look streams up without a lock.
type streamTable map[uint32]*streamEntry

// epoch tells a writer when every loop's RX side has stopped using an old stream
// table: a loop is active while it holds a table it loaded, and bumps count
// when it lets go.
type epoch struct {
	active atomic.Bool
	count  atomic.Uint64
	_      [48]byte // keep loops' epochs on separate cache lines
}

func (e *epoch) enter() { e.active.Store(true) }
func (e *epoch) leave() { e.count.Add(1); e.active.Store(false) }

// dispatcher delivers received frames into streams, batching consecutive
// packets of one stream into one SendMeta. One per loop.
type dispatcher struct {
	table *streamTable
	cur   *streamEntry
	pkts  [64][]byte
	meta  [64]uint32
	ts    [64]uint64 // XDP receive timestamps, for capture hooks
	n     int
	c     rxCounters
	clock monoClock
}

// rxCounters are a loop's RX counts of one batch, added to the queue's
// atomics once per batch.
type rxCounters struct {
	packets, bytes                uint64
	ringFull, noStream, malformed uint64
	tooBig                        uint64
}

func (d *dispatcher) begin(t *streamTable, clock monoClock) {
	d.table = t
	d.clock = clock
	d.c = rxCounters{}
}

// frame delivers one frame that the classifier steered, per its metadata.
// The bytes must stay valid until end.
func (d *dispatcher) frame(frame []byte, m *classifier.Meta) {
	if m.Verdict != classifier.VerdictSteer || int(m.L3Offset) >= len(frame) {
		d.c.malformed++
		return
	}
	pkt := frame[m.L3Offset:]
	// Cut Ethernet padding: the stream gets exactly the IP packet.
	var n int
	switch pkt[0] >> 4 {
	case 4:
		if len(pkt) >= 20 {
			n = int(be.Uint16(pkt[2:]))
		}
	case 6:
		if len(pkt) >= 40 {
			n = 40 + int(be.Uint16(pkt[4:]))
		}
	}
	if n == 0 || n > len(pkt) {
		d.c.malformed++
		return
	}
	e := (*d.table)[m.StreamID]
	if e == nil {
		d.c.noStream++
		return
	}
	if n > e.maxPayload {
		// The stream would drop it too, but count it as delivered.
		d.c.tooBig++
		e.rxTooBig.Add(1)
		return
	}
	if e != d.cur || d.n == len(d.pkts) {
		d.flush()
		d.cur = e
	}
	d.pkts[d.n] = pkt[:n]
	d.meta[d.n] = deliveryWord(m)
	d.ts[d.n] = m.RxTimestampNs
	d.n++
}

func (d *dispatcher) flush() {
	if d.n == 0 {
		return
	}
	e, k := d.cur, d.n
	d.n = 0
	// The hook is loaded before the packets become visible, so that a
	// packet the application can read is captured if the hook was set when
	// it was delivered (SetCapture waits for this batch to end).
	hook := e.capture.Load()
	sent, err := e.s.SendMeta(d.pkts[:k], d.meta[:k])
	var bytes uint64
	for _, p := range d.pkts[:sent] {
		bytes += uint64(len(p))
	}
	if err != nil {
		d.c.noStream += uint64(k - sent)
	} else if sent < k {
		d.c.ringFull += uint64(k - sent)
		e.rxRingFull.Add(uint64(k - sent))
	}
	if hook != nil && sent > 0 {
		now := time.Now()
		for i, p := range d.pkts[:sent] {
			hook.fn(Inbound, p, d.clock.wall(d.ts[i], now))
		}
	}
	if sent > 0 {
		e.rxPackets.Add(uint64(sent))
		e.rxBytes.Add(bytes)
		d.c.packets += uint64(sent)
		d.c.bytes += bytes
	}
	for i := range d.pkts[:k] {
		d.pkts[i] = nil
	}
}

// end delivers what is batched; afterwards the frames may be reused.
func (d *dispatcher) end() {
	d.flush()
	d.cur = nil
}
