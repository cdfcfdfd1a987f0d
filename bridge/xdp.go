package bridge

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge/xsk"
	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
)

// xdpHeadroom is what the kernel leaves in front of a received frame in its
// UMEM frame (XDP_PACKET_HEADROOM); the metadata lives there.
const xdpHeadroom = unix.XDP_PACKET_HEADROOM

// openXDP sets up path p: the classifier attached in native or generic mode,
// and on every queue a fresh UMEM with one socket in zero-copy or copy mode,
// registered in the program's XSKMAP.
func (b *Bridge) openXDP(p Path) (err error) {
	if b.prog == nil {
		// Frames of applications with no socket bound (a queue not served,
		// a restart) are dropped: the kernel could only reset them.
		if b.prog, err = fbebpf.LoadWith(fbebpf.Options{FlowCapacity: b.cfg.FlowCapacity, DropUnbound: true, PinDir: b.cfg.PinDir}); err != nil {
			return err
		}
	}
	mode := fbebpf.ModeNative
	if p == PathGeneric {
		mode = fbebpf.ModeGeneric
	}
	if cur, ok := b.prog.Mode(); ok && cur != mode {
		if err := b.prog.Detach(); err != nil {
			return err
		}
	}
	if _, ok := b.prog.Mode(); !ok {
		if _, err := b.prog.Attach(b.ifindex, mode); err != nil {
			return err
		}
	}
	bind := xskBindFor(p)
	var qs []*queue
	defer func() {
		if err != nil {
			for _, q := range qs {
				q.rx.close()
				q.tx.close()
				q.closeFds()
			}
		}
	}()
	for _, id := range b.cfg.Queues {
		rx, tx, err := b.openXSK(id, bind)
		if err != nil {
			return err
		}
		q, err := b.newQueue(id, rx, tx)
		if err != nil {
			rx.close()
			return err
		}
		qs = append(qs, q)
	}
	for _, q := range qs {
		if err := b.prog.XSKMap().Put(uint32(q.id), uint32(q.rx.(*xdpRx).sock.FD())); err != nil {
			return fmt.Errorf("queue %d: XSKMAP: %w", q.id, err)
		}
	}
	b.queues = qs
	return nil
}

// xskBindFor is how sockets bind on XDP path p.
func xskBindFor(p Path) xsk.BindMode {
	if p == PathNativeZeroCopy {
		return xsk.BindZeroCopy
	}
	return xsk.BindCopy
}

// openXSK makes one queue's UMEM and socket: half the frames go to the fill
// ring, half to the TX side's free list. The fill and TX rings have room for
// twice the frames they carry: the kernel publishes how far it consumed them
// only when it has used up what it saw (see package xsk), so a ring sized
// exactly would look full while the kernel has in fact taken frames.
func (b *Bridge) openXSK(id int, bind xsk.BindMode) (*xdpRx, *xdpTx, error) {
	umem, err := xsk.NewUmem(xsk.UmemConfig{FrameSize: b.cfg.FrameSize, FrameCount: b.cfg.FrameCount})
	if err != nil {
		return nil, nil, err
	}
	half := b.cfg.FrameCount / 2
	sock, err := umem.Open(xsk.SocketConfig{
		Ifindex: b.ifindex, Queue: id, Bind: bind,
		RxSize: half, TxSize: 2 * half, FillSize: 2 * half, CompletionSize: half,
		BusyPoll: b.cfg.BusyPoll,
	})
	if err != nil {
		umem.Close()
		return nil, nil, fmt.Errorf("queue %d: %w", id, err)
	}
	rx := &xdpRx{umem: umem, sock: sock, busyPoll: b.cfg.BusyPoll > 0, fill: xsk.Refiller{Ring: sock.Fill, Pending: make([]uint64, 0, half)}}
	rx.pfd = [2]unix.PollFd{{Fd: int32(sock.FD()), Events: unix.POLLIN}, {Events: unix.POLLIN}}
	fill := make([]uint64, half)
	if umem.Alloc(fill) != half || sock.Fill.Fill(fill) != half {
		umem.Close()
		return nil, nil, errors.New("fill ring refused the initial frames")
	}
	tx := &xdpTx{umem: umem, sock: sock, free: make([]uint64, half), descs: make([]xsk.Desc, 0, half), copyMode: !sock.ZeroCopy()}
	umem.Alloc(tx.free)
	if tx.copyMode && !b.cfg.NoSegmentOffload {
		// Without it every frame still leaves, one skb each.
		if b.feats == nil {
			b.log.Warn("bridge: TX without segmentation offload: the device's features cannot be read", "interface", b.cfg.Interface)
		} else if tx.seg, err = newSegOffload(b.ifindex, half); err != nil {
			b.log.Warn("bridge: TX without segmentation offload", "queue", id, "err", err)
		} else if !b.segUsed.Swap(true) {
			b.readTSO()
		}
		tx.tso, tx.txQueues = &b.tso, &b.txQueues
	}
	return rx, tx, nil
}

// xdpRx is the RX side of one AF_XDP queue.
type xdpRx struct {
	umem     *xsk.Umem
	sock     *xsk.Socket
	busyPoll bool
	descs    [xsk.MaxBatch]xsk.Desc
	addrs    [xsk.MaxBatch]uint64
	pfd      [2]unix.PollFd
	fill     xsk.Refiller
}

func (x *xdpRx) poll(d *dispatcher) int {
	if len(x.fill.Pending) > 0 {
		x.fill.Refill(nil)
	}
	n := x.sock.RX.Receive(x.descs[:])
	if n == 0 {
		if x.busyPoll || x.sock.Fill.NeedWakeup() {
			x.sock.WakeRX()
		}
		return 0
	}
	for i := range n {
		desc := &x.descs[i]
		x.addrs[i] = desc.Addr
		mb := x.umem.Meta(desc.Addr, classifier.MetaSize)
		if mb == nil {
			d.c.malformed++
			continue
		}
		m := classifier.UnmarshalMeta(mb)
		d.frame(x.umem.Bytes(desc.Addr, int(desc.Len)), &m)
	}
	d.end() // the packets are copied into their streams: recycle the frames
	x.fill.Refill(x.addrs[:n])
	if x.sock.Fill.NeedWakeup() {
		x.sock.WakeRX()
	}
	return n
}

func (x *xdpRx) wait(wakefd int) {
	x.pfd[1].Fd = int32(wakefd)
	x.pfd[0].Revents, x.pfd[1].Revents = 0, 0
	unix.Poll(x.pfd[:], -1) // EINTR: the loop looks again
}

func (x *xdpRx) kernelStats() (fillEmpty, dropped uint64) {
	st, err := x.sock.Statistics()
	if err != nil {
		return 0, 0
	}
	return st.RxFillRingEmpty, st.RxDropped + st.RxRingFull
}

func (x *xdpRx) close() error { return x.umem.Close() }

// xdpTx is the TX side of one AF_XDP queue: a private stack of free frames,
// refilled from the completion ring.
type xdpTx struct {
	umem     *xsk.Umem
	sock     *xsk.Socket
	free     []uint64
	lent     [xsk.MaxBatch]uint64
	sent     [xsk.MaxBatch]bool
	nlent    int
	descs    []xsk.Desc
	reaped   [xsk.MaxBatch]uint64
	copyMode bool
	// seg, in copy mode unless turned off, sends flushes that hold
	// consecutive segments of a TCP connection through a packet socket
	// with segmentation offload (gso.go).
	seg      *segOffload
	tso      *atomic.Uint32 // the device's TCP segmentation offloads (Bridge.tso)
	txQueues *atomic.Int32  // the queues the device transmits on (Bridge.txQueues)
	pinned   bool           // the loop runs on one CPU (set before it serves)
}

func (x *xdpTx) lend(bufs [][]byte) int {
	if len(x.free) < len(bufs) {
		x.reclaim()
	}
	k := min(len(bufs), len(x.free))
	top := len(x.free) - 1
	for i := range k {
		a := x.free[top-i]
		x.lent[i] = a
		x.sent[i] = false
		bufs[i] = x.umem.Frame(a)
	}
	x.free = x.free[:len(x.free)-k]
	x.nlent = k
	return k
}

func (x *xdpTx) send(i, n int) {
	x.descs = append(x.descs, xsk.Desc{Addr: x.lent[i], Len: uint32(n)})
	x.sent[i] = true
}

func (x *xdpTx) settle() {
	for i := range x.nlent {
		if !x.sent[i] {
			x.free = append(x.free, x.lent[i])
		}
	}
	x.nlent = 0
}

func (x *xdpTx) flush() {
	if x.seg != nil && len(x.descs) > 0 && x.sock.TX.Pending() == 0 {
		// Frames the kernel has not taken from the ring yet would be
		// overtaken: those flushes stay on the ring.
		x.offload()
	}
	if len(x.descs) > 0 {
		// The TX ring has room for twice the TX frames, so everything
		// fits; whatever did not would be sent by the next flush.
		k := x.sock.TX.Send(x.descs)
		x.descs = append(x.descs[:0], x.descs[k:]...)
	}
	if x.copyMode || x.sock.TX.NeedWakeup() {
		// In copy mode the kernel transmits inside sendto, a budget at a
		// time; kick until the ring is drained or it stops making progress.
		for try := 0; try < 64 && x.sock.TX.Pending() > 0; try++ {
			x.sock.Kick()
		}
	}
	x.reclaim()
}

// offload sends the queued frames through the packet socket when two of
// them join into one offload packet, and every flush while the device
// transmits on more than one queue and the loop is pinned (see readTSO).
// The kernel copies them inside sendmmsg, as it does in copy mode's
// sendto, so their frames are free once it returns. Frames queued before
// are on the wire already (flush calls it only when the ring is empty),
// so the connection's order holds.
func (x *xdpTx) offload() {
	every := x.txQueues.Load() > 1
	if !every && len(x.descs) < 2 {
		return
	}
	tso := x.tso.Load()
	if every && (!x.pinned || tso&(tsoIPv4|tsoIPv6) == 0) {
		return
	}
	frames := x.seg.frames[:len(x.descs)]
	for i, d := range x.descs {
		frames[i] = x.umem.Frame(d.Addr)[:d.Len]
	}
	if x.seg.plan(frames, tso) || every {
		if x.seg.send(frames) < len(frames) {
			// A device that stopped segmenting drops every offload
			// packet, the retransmissions' too: stop joining until the
			// next reading of its features says it segments.
			x.tso.Store(0)
		}
		for _, d := range x.descs {
			x.free = append(x.free, d.Addr)
		}
		x.descs = x.descs[:0]
	}
	clear(frames)
}

func (x *xdpTx) maxFrame() int { return x.umem.FrameSize() }

func (x *xdpTx) release() {
	if x.seg != nil {
		x.seg.close()
	}
}

func (x *xdpTx) offloadStats() offloadCounts {
	if x.seg == nil {
		return offloadCounts{}
	}
	return offloadCounts{joined: x.seg.joined.Load(), lost: x.seg.lost.Load(), sent: x.seg.sent.Load()}
}

func (x *xdpTx) reclaim() {
	for {
		n := x.sock.Completion.Reap(x.reaped[:])
		if n == 0 {
			return
		}
		for _, a := range x.reaped[:n] {
			x.free = append(x.free, x.umem.Base(a))
		}
	}
}

// readTSO reads which families the device segments TCP for. Segments of
// the others are never joined: with qdisc bypass the kernel drops an
// offload packet it would have to cut in software.
//
// It also reads how many queues the device transmits on. On one, the
// packet socket and the AF_XDP socket feed the same driver queue, so a
// flush may take either way. On more, the packet socket's queue is the
// kernel's pick (the driver's, XPS for the sending CPU, or the CPU's
// number modulo the queues) and the AF_XDP socket's is its own, so a
// connection whose consecutive flushes took the two ways could have its
// segments reordered between the queues. A loop pinned to one CPU then
// sends every flush through the packet socket: from one CPU, the kernel
// picks the same queue for every packet of a flow, as it does for its own
// TCP's. An unpinned loop moves between CPUs, so it joins nothing and
// keeps to its AF_XDP ring.
func (b *Bridge) readTSO() {
	tso := tsoOf(b.feats)
	txq := b.txQueuesInUse()
	tso |= tsoRead
	b.tso.Store(tso)
	old := b.tsoDevice.Swap(tso)
	oldTxq := b.txQueues.Swap(int32(txq))
	if old != tso || (oldTxq > 1) != (txq > 1) {
		b.log.Info("bridge: TCP segmentation offload of the device", "interface", b.cfg.Interface, "ipv4", tso&tsoIPv4 != 0, "ipv6", tso&tsoIPv6 != 0, "tx_queues", txq)
		if txq > 1 && tso&(tsoIPv4|tsoIPv6) != 0 && len(b.cfg.CPUs) == 0 {
			b.log.Warn("bridge: segments are not joined: the device transmits on more than one queue and the loops are not pinned to CPUs (cpus)", "interface", b.cfg.Interface, "tx_queues", txq)
		}
	}
}

// watchTSO follows the device's segmentation offloads (ethtool -K) until
// stop is closed. A change takes up to segPoll to be seen; the first
// offload send the device refuses in that window stops joining until the
// next reading (its packets are counted in QueueStats.TxOffloadLost, and
// TCP sends them again).
func (b *Bridge) watchTSO(stop <-chan struct{}) { every(stop, segPoll, b.readTSO) }

// segPoll is how often watchTSO reads the device's features.
const segPoll = time.Second
