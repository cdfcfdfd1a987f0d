package bridge

import (
	"sync/atomic"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// ethHeader is the Ethernet header the bridge writes in front of packets;
// vlanHeader the same with one VLAN tag.
const (
	ethHeader  = 14
	vlanHeader = ethHeader + 4
)

// txPort is where a queue's TX side puts frames: an AF_XDP TX ring or an AF_PACKET
// TX ring. Frames are lent out, filled in place (the stream's packet is read
// straight into the frame after room for the Ethernet header), then sent or
// handed back.
type txPort interface {
	// lend fills bufs with up to len(bufs) free frames (each a whole frame
	// buffer) and returns how many.
	lend(bufs [][]byte) int
	// send queues lent frame i (of the last lend) with n bytes. Frames must
	// be sent in ascending i.
	send(i, n int)
	// settle takes back the lent frames that were not sent.
	settle()
	// flush hands the queued frames to the kernel and reclaims finished
	// ones; reclaim only reclaims.
	flush()
	reclaim()
	// maxFrame is the longest frame a TX buffer holds.
	maxFrame() int
	// release frees what the port alone owns (the RX side closes a shared
	// UMEM).
	release()
	// offloadStats counts the frames sent through the packet socket, those
	// joined into segmentation-offload packets and those such a send lost
	// (AF_XDP copy mode, gso.go).
	offloadStats() offloadCounts
}

// txCounters are a TX side's counts, added to the queue's atomics per round.
type txCounters struct {
	packets, bytes, kernel uint64
	rejects                [numReasons]uint64
}

// txSide is the TX half of a queue's loop. It drains the TX rings of the
// streams assigned to the queue, fairly: each ready stream gives at most
// budget packets per round, and the event queue hands back streams that
// still have packets in the next round.
type txSide struct {
	b      *Bridge
	q      *queue
	port   txPort
	eq     *fabric.EventQueue
	byTok  []*streamEntry
	toks   [64]int
	bufs   [64][]byte
	pkts   [64][]byte
	meta   [64]uint32 // the streams' words for pkts: their marks
	budget int
	l2     *l2cache
	srcMAC [6]byte
	// maxPacket is the longest IP packet a TX frame holds; the MTU in force
	// is the smaller of it and the interface's current MTU.
	maxPacket int
	c         txCounters
	fragBuf   []byte // sendFragments's, made on first use

	// handed and handedMeta are handOn's one-packet batch.
	handed     [1][]byte
	handedMeta [1]uint32

	rejectLogSecond time.Time // logReject's rate limit: the second it counts in
	rejectLogged    int       // and the lines it wrote in it

	// Commands from the control plane arrive on cmds; pending tells the
	// loop to look (one atomic load per turn), the queue's wakefd wakes it.
	cmds    chan txCmd
	pending atomic.Bool
	resume  chan struct{} // releases a parked loop
}

type txCmd struct {
	add, remove *streamEntry
	park        bool // wait on resume until released
	done        chan struct{}
}

func newTxSide(b *Bridge, q *queue, port txPort) (*txSide, error) {
	eq, err := fabric.NewEventQueue()
	if err != nil {
		return nil, err
	}
	return &txSide{
		b: b, q: q, port: port, eq: eq,
		budget: b.cfg.TxBudget, l2: newL2cache(b.res), srcMAC: b.mac, maxPacket: port.maxFrame() - ethHeader,
		cmds: make(chan txCmd, 16), resume: make(chan struct{}),
	}, nil
}

// command hands c to the queue's loop and wakes it; c.done, if set, is
// closed once the loop has applied it.
func (t *txSide) command(c txCmd) {
	if t.b.cfg.manual {
		t.apply(c)
		return
	}
	t.cmds <- c
	t.pending.Store(true)
	t.q.wake()
}

// commands runs the queued commands. Clearing pending before draining
// means a command queued after the drain sets it again.
func (t *txSide) commands() {
	if !t.pending.Load() {
		return
	}
	t.pending.Store(false)
	for {
		select {
		case c := <-t.cmds:
			t.apply(c)
		default:
			return
		}
	}
}

// once is one TX round of the queue's loop: the streams that have packets
// now, each served with one budget. It returns how many streams it served;
// when 0, every stream is armed (fabric.EventQueue.Poll) and the loop may
// sleep on the event queue's descriptor.
func (t *txSide) once() int {
	n, err := t.eq.Poll(t.toks[:])
	if err != nil {
		t.b.log.Error("bridge: TX event queue", "queue", t.q.id, "err", err)
		time.Sleep(10 * time.Millisecond)
		return 0
	}
	t.round(t.toks[:n])
	return n
}

// round serves the streams of one Poll.
func (t *txSide) round(toks []int) {
	out := false
	for _, tok := range toks {
		if tok >= len(t.byTok) || t.byTok[tok] == nil {
			continue
		}
		if t.serve(tok, t.byTok[tok]) {
			out = true
		}
	}
	if out {
		t.port.flush()
	} else {
		t.port.reclaim()
	}
	t.q.addTx(&t.c)
}

// serve takes up to budget packets from one stream. It reports whether
// anything was queued for the wire.
func (t *txSide) serve(tok int, e *streamEntry) bool {
	k := t.port.lend(t.bufs[:t.budget])
	if k == 0 {
		t.port.flush() // reclaims completions
		if k = t.port.lend(t.bufs[:t.budget]); k == 0 {
			return false // no frame free: the stream stays pending
		}
	}
	for i := 0; i < k; i++ {
		t.pkts[i] = t.bufs[i][ethHeader:]
	}
	got, err := e.s.TryRecvMeta(t.pkts[:k], t.meta[:k])
	if err != nil {
		// Broken or closed: nothing more will come from it. The control
		// plane still owns its removal.
		e.dead.Store(true)
		t.eq.Remove(e.s)
		t.byTok[tok] = nil
	}
	own := e.own.Load()
	mtu := min(int(t.b.res.mtu.Load()), t.maxPacket)
	hook := e.capture.Load()
	var now time.Time
	if hook != nil {
		now = time.Now()
	}
	var sc txCounters
	queued := false
	for i := 0; i < got; i++ {
		p := t.pkts[i]
		if t.meta[i]&fabric.MarkNotMine != 0 {
			// Not for the wire: an inbound packet the application
			// gives back.
			if !t.handOn(e, p) {
				sc.rejects[rejSecondChance]++
				t.logReject(e, rejSecondChance, p)
			}
			continue
		}
		r := verify(p, own, mtu)
		if r == rejMTU {
			// Sent before the application heard the MTU went down.
			if r = verify(p, own, len(p)); r == accepted {
				if t.sendFragments(p, mtu, hook, now, &sc) {
					continue
				}
				r = rejMTU
			}
		}
		if r != accepted {
			sc.rejects[r]++
			t.logReject(e, r, p)
			continue
		}
		h, ok := t.l2.lookup(dstAddr(p))
		if ok && h.tag != 0 && (len(p) > int(h.mtu) || vlanHeader+len(p) > len(t.bufs[i])) {
			// A VLAN device's destination: the packet must fit that
			// device's MTU and, with the 4-byte tag, the frame.
			sc.rejects[rejMTU]++
			t.logReject(e, rejMTU, p)
			continue
		}
		if hook != nil {
			hook.fn(Outbound, p, now)
		}
		if !ok {
			t.toKernel(p, &sc)
			continue
		}
		f := t.bufs[i]
		hdr, v4 := ethHeader, p[0]>>4 == 4
		if h.tag != 0 {
			// The tag goes between the addresses and the EtherType, so
			// the packet moves 4 bytes on.
			copy(f[vlanHeader:], p) // p is f[ethHeader:]: from here on read it there
			f[12], f[13], f[14], f[15] = byte(h.tag>>24), byte(h.tag>>16), byte(h.tag>>8), byte(h.tag)
			hdr = vlanHeader
		}
		copy(f[0:6], h.mac[:])
		copy(f[6:12], t.srcMAC[:])
		if v4 {
			f[hdr-2], f[hdr-1] = 0x08, 0x00
		} else {
			f[hdr-2], f[hdr-1] = 0x86, 0xdd
		}
		t.port.send(i, hdr+len(p))
		sc.packets++
		sc.bytes += uint64(len(p))
		queued = true
	}
	for i := range t.pkts[:k] {
		t.pkts[i] = nil
	}
	t.port.settle()
	e.txPackets.Add(sc.packets)
	e.txBytes.Add(sc.bytes)
	if sc.kernel > 0 {
		e.txKernel.Add(sc.kernel)
	}
	for r, n := range sc.rejects {
		if n > 0 {
			e.txRejects[r].Add(n)
		}
	}
	t.c.packets += sc.packets
	t.c.bytes += sc.bytes
	t.c.kernel += sc.kernel
	for r, n := range sc.rejects {
		t.c.rejects[r] += n
	}
	return queued
}

func (t *txSide) apply(c txCmd) {
	switch {
	case c.add != nil:
		tok, err := t.eq.Add(c.add.s)
		if err != nil {
			t.b.log.Error("bridge: add stream to a queue's TX side", "stream", c.add.id, "err", err)
			c.add.dead.Store(true)
			break
		}
		for len(t.byTok) <= tok {
			t.byTok = append(t.byTok, nil)
		}
		t.byTok[tok] = c.add
	case c.remove != nil:
		for tok, e := range t.byTok {
			if e == c.remove {
				t.byTok[tok] = nil
				t.eq.Remove(e.s)
			}
		}
	case c.park:
		close(c.done)
		<-t.resume
		return
	}
	if c.done != nil {
		close(c.done)
	}
}

func (t *txSide) close() {
	t.port.release()
	t.eq.Close()
}

// sendFragments hands the kernel p, a verified packet over the MTU, in
// fragments (see fragment.go), and counts them as sent through the
// kernel. It reports false if p cannot be fragmented.
func (t *txSide) sendFragments(p []byte, mtu int, hook *captureHook, now time.Time, sc *txCounters) bool {
	if t.fragBuf == nil {
		t.fragBuf = make([]byte, t.maxPacket)
	}
	return fragment(p, mtu, t.fragBuf, func(f []byte) {
		if hook != nil {
			hook.fn(Outbound, f, now)
		}
		t.toKernel(f, sc)
	})
}

// toKernel hands p to the kernel's IP layer, which routes it: the way out
// for a destination the bridge has no neighbour entry for, and for
// fragments.
func (t *txSide) toKernel(p []byte, sc *txCounters) {
	if err := t.b.kernel.send(p); err == nil {
		sc.kernel++
	} else {
		t.b.kernelErrs.Add(1)
	}
}
