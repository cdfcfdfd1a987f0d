// Package fakebridge is an in-memory stand-in for the bridge, for tests of
// the control plane and of user-space stacks without namespaces or XDP.
//
// It implements control.Dataplane. Every packet an application sends is
// checked against its stream's ownership the way the real bridge checks it
// (IP version and lengths, source address, protocol and source port), then
// classified with the reference classifier, exactly as if it had arrived
// from the wire: a packet for another application's listener or flow goes
// into that application's stream, anything else to the Wire function (the
// stand-in for the kernel and the world), or is dropped when Wire is nil.
// Inject delivers a packet from the wire.
package fakebridge

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Counters are what the fake bridge did with packets.
type Counters struct {
	Steered  uint64 // delivered into a stream
	ToWire   uint64 // given to Wire
	Dropped  uint64 // no stream and no Wire, or the stream's ring was full
	Rejected uint64 // refused on transmit: not owned or malformed
}

// Bridge is the fake. The zero value is not usable; call New.
type Bridge struct {
	// Wire receives packets that no stream claims. It is called from the
	// streams' goroutines, concurrently; it must not keep pkt.
	Wire func(pkt []byte)

	mu      sync.Mutex
	streams map[uint32]*stream
	tables  atomic.Pointer[classifier.Tables]

	steered, toWire, dropped, rejected atomic.Uint64
}

type stream struct {
	id    uint32
	send  func([][]byte) (int, error)
	recv  func([][]byte) (int, error)
	sendM sync.Mutex // bridge-side sends are single-producer
	own   atomic.Pointer[classifier.Ownership]
	gone  atomic.Bool
}

// New returns a fake bridge with empty tables.
func New() *Bridge {
	b := &Bridge{streams: make(map[uint32]*stream)}
	t, _ := classifier.Compile(&classifier.RuleSet{})
	b.tables.Store(t)
	return b
}

// Counters returns a snapshot.
func (b *Bridge) Counters() Counters {
	return Counters{Steered: b.steered.Load(), ToWire: b.toWire.Load(), Dropped: b.dropped.Load(), Rejected: b.rejected.Load()}
}

// AddStream implements control.Dataplane.
func (b *Bridge) AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error {
	b.add(id, s.Send, s.Recv, own)
	return nil
}

// AddRemoteStream implements control.Dataplane.
func (b *Bridge) AddRemoteStream(id uint32, s *fabric.RemoteStream, own classifier.Ownership) error {
	b.add(id, s.Send, s.Recv, own)
	return nil
}

func (b *Bridge) add(id uint32, send, recv func([][]byte) (int, error), own classifier.Ownership) {
	st := &stream{id: id, send: send, recv: recv}
	st.own.Store(&own)
	b.mu.Lock()
	b.streams[id] = st
	b.mu.Unlock()
	go b.transmitLoop(st)
}

// SetOwnership implements control.Dataplane.
func (b *Bridge) SetOwnership(id uint32, own classifier.Ownership) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if st := b.streams[id]; st != nil {
		st.own.Store(&own)
	}
	return nil
}

// RemoveStream implements control.Dataplane. The stream's loop ends when
// the server closes the stream.
func (b *Bridge) RemoveStream(id uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if st := b.streams[id]; st != nil {
		st.gone.Store(true)
		delete(b.streams, id)
	}
	return nil
}

// SetTables implements control.Dataplane.
func (b *Bridge) SetTables(t *classifier.Tables) error {
	b.tables.Store(t)
	return nil
}

// Inject delivers a packet as if it had arrived from the wire.
func (b *Bridge) Inject(pkt []byte) { b.InjectAll([][]byte{pkt}) }

// InjectAll delivers packets as if they had arrived from the wire, with
// one classifier: a flood costs the test no more than the packets.
func (b *Bridge) InjectAll(pkts [][]byte) {
	c := classifier.New(b.tables.Load(), 0)
	frame := make([]byte, 0, 65536+14)
	for _, pkt := range pkts {
		b.route(c, frame, pkt)
	}
}

// transmitLoop takes what an application sends, checks it and routes it.
func (b *Bridge) transmitLoop(st *stream) {
	bufs := make([][]byte, 64)
	for i := range bufs {
		bufs[i] = make([]byte, 65536)
	}
	frame := make([]byte, 0, 65536+14)
	t := b.tables.Load()
	c := classifier.New(t, 0)
	for {
		for i := range bufs {
			bufs[i] = bufs[i][:cap(bufs[i])]
		}
		n, err := st.recv(bufs)
		if nt := b.tables.Load(); nt != t {
			t = nt
			c.SetTables(t)
		}
		for _, pkt := range bufs[:n] {
			if st.gone.Load() || !owned(st.own.Load(), pkt) {
				b.rejected.Add(1)
				continue
			}
			b.route(c, frame, pkt)
		}
		if err != nil {
			return
		}
	}
}

// route classifies pkt as a frame from the wire and delivers it.
func (b *Bridge) route(c *classifier.Classifier, frame, pkt []byte) {
	frame = frame[:14]
	clear(frame[:12])
	if pkt[0]>>4 == 6 {
		binary.BigEndian.PutUint16(frame[12:], 0x86dd)
	} else {
		binary.BigEndian.PutUint16(frame[12:], 0x0800)
	}
	frame = append(frame, pkt...)
	m := c.Classify(frame)
	if m.Verdict == classifier.VerdictSteer {
		b.mu.Lock()
		dst := b.streams[m.StreamID]
		b.mu.Unlock()
		if dst != nil {
			dst.sendM.Lock()
			n, _ := dst.send([][]byte{pkt})
			dst.sendM.Unlock()
			if n == 1 {
				b.steered.Add(1)
			} else {
				b.dropped.Add(1)
			}
			return
		}
	}
	if w := b.Wire; w != nil && m.Verdict != classifier.VerdictDrop {
		w(pkt)
		b.toWire.Add(1)
		return
	}
	b.dropped.Add(1)
}

// owned is the bridge's transmit check: well-formed IPv4 or IPv6 carrying
// TCP or UDP, from an address and port the stream owns.
func owned(own *classifier.Ownership, pkt []byte) bool {
	if len(pkt) < 20 {
		return false
	}
	var src netip.Addr
	var proto uint8
	var l4 int
	switch pkt[0] >> 4 {
	case 4:
		ihl := int(pkt[0]&0xf) * 4
		if ihl < 20 || int(binary.BigEndian.Uint16(pkt[2:])) != len(pkt) || len(pkt) < ihl+8 {
			return false
		}
		src, proto, l4 = netip.AddrFrom4([4]byte(pkt[12:16])), pkt[9], ihl
	case 6:
		if len(pkt) < 48 || int(binary.BigEndian.Uint16(pkt[4:]))+40 != len(pkt) {
			return false
		}
		src, proto, l4 = netip.AddrFrom16([16]byte(pkt[8:24])), pkt[6], 40
	default:
		return false
	}
	if proto != uint8(classifier.ProtoTCP) && proto != uint8(classifier.ProtoUDP) {
		return false
	}
	port := binary.BigEndian.Uint16(pkt[l4:])
	return slices.Contains(own.Addrs, src) &&
		slices.Contains(own.Ports, classifier.PortClaim{Proto: classifier.Protocol(proto), Port: port})
}
