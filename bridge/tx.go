package bridge

import (
	"runtime"
	"sync/atomic"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// ethHeader is the Ethernet header the bridge writes in front of packets.
const ethHeader = 14

// txPort is where a TX loop puts frames: an AF_XDP TX ring or an AF_PACKET
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
}

// txCounters are a TX loop's counts, added to the queue's atomics per round.
type txCounters struct {
	packets, bytes, kernel uint64
	rejects                [numReasons]uint64
}

// txLoop drains the TX rings of the streams assigned to one queue, fairly:
// each ready stream gives at most budget packets per round, and the event
// queue hands back streams that still have packets in the next round.
type txLoop struct {
	b      *Bridge
	q      *queue
	port   txPort
	eq     *fabric.EventQueue
	byTok  []*streamEntry
	toks   [64]int
	bufs   [64][]byte
	pkts   [64][]byte
	budget int
	l2     *l2cache
	srcMAC [6]byte
	// maxPacket is the longest IP packet a TX frame holds; the MTU in force
	// is the smaller of it and the interface's current MTU.
	maxPacket int
	c         txCounters

	// Commands from the control plane arrive on cmds; the bell (a stream
	// of its own in the event queue) wakes the loop for them.
	cmds    chan txCmd
	bell    *fabric.Stream
	bellApp *fabric.Stream
	bellTok int
	rung    atomic.Bool
	bellBuf [1][]byte
	one     [1][]byte
}

type txCmd struct {
	add, remove *streamEntry
	park        bool // wait on q.resume until released
	done        chan struct{}
}

func newTxLoop(b *Bridge, q *queue, port txPort) (*txLoop, error) {
	eq, err := fabric.NewEventQueue()
	if err != nil {
		return nil, err
	}
	bell, bellApp, err := fabric.NewPair(fabric.Config{RxSlots: 2, TxSlots: 2, SlotSize: 64})
	if err != nil {
		eq.Close()
		return nil, err
	}
	tok, err := eq.Add(bell)
	if err != nil {
		eq.Close()
		bell.Close()
		bellApp.Close()
		return nil, err
	}
	t := &txLoop{
		b: b, q: q, port: port, eq: eq,
		budget: b.cfg.TxBudget, l2: newL2cache(b.res), srcMAC: b.mac, maxPacket: port.maxFrame() - ethHeader,
		cmds: make(chan txCmd, 16), bell: bell, bellApp: bellApp, bellTok: tok,
	}
	t.bellBuf[0] = make([]byte, 64)
	t.one[0] = []byte{1}
	t.byTok = make([]*streamEntry, tok+1)
	return t, nil
}

// command queues c and wakes the loop.
func (t *txLoop) command(c txCmd) {
	if t.b.cfg.manual {
		t.apply(c)
		return
	}
	t.cmds <- c
	if t.rung.CompareAndSwap(false, true) {
		t.bellApp.Send(t.one[:])
	}
}

func (t *txLoop) run() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for !t.q.stop.Load() {
		n, err := t.eq.Wait(t.toks[:], -1)
		if err != nil {
			t.b.log.Error("bridge: TX event queue", "queue", t.q.id, "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		t.round(t.toks[:n])
	}
}

// round serves the streams of one Wait.
func (t *txLoop) round(toks []int) {
	out := false
	for _, tok := range toks {
		if tok == t.bellTok {
			t.serveBell()
			continue
		}
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
func (t *txLoop) serve(tok int, e *streamEntry) bool {
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
	got, err := e.s.TryRecv(t.pkts[:k])
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
		if r := verify(p, own, mtu); r != accepted {
			sc.rejects[r]++
			continue
		}
		if hook != nil {
			hook.fn(Outbound, p, now)
		}
		mac, ok := t.l2.lookup(dstAddr(p))
		if !ok {
			if err := t.b.kernel.send(p); err == nil {
				sc.kernel++
			} else {
				t.b.kernelErrs.Add(1)
			}
			continue
		}
		f := t.bufs[i]
		copy(f[0:6], mac[:])
		copy(f[6:12], t.srcMAC[:])
		if p[0]>>4 == 4 {
			f[12], f[13] = 0x08, 0x00
		} else {
			f[12], f[13] = 0x86, 0xdd
		}
		t.port.send(i, ethHeader+len(p))
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

// serveBell drains the bell, then runs the queued commands. Draining before
// clearing rung means a command queued after the drain finds rung clear and
// rings again, or, queued before the clear, is in the channel already.
func (t *txLoop) serveBell() {
	for {
		n, _ := t.bell.TryRecv(t.bellBuf[:])
		t.bellBuf[0] = t.bellBuf[0][:cap(t.bellBuf[0])]
		if n == 0 {
			break
		}
	}
	t.rung.Store(false)
	for {
		select {
		case c := <-t.cmds:
			t.apply(c)
		default:
			return
		}
	}
}

func (t *txLoop) apply(c txCmd) {
	switch {
	case c.add != nil:
		tok, err := t.eq.Add(c.add.s)
		if err != nil {
			t.b.log.Error("bridge: add stream to TX loop", "stream", c.add.id, "err", err)
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
		<-t.q.resume
		return
	}
	if c.done != nil {
		close(c.done)
	}
}

func (t *txLoop) close() {
	t.port.release()
	t.eq.Close()
	t.bell.Close()
	t.bellApp.Close()
}
