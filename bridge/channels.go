package bridge

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netns"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/bridge/xsk"
)

// Which receive queues to serve.
//
// A device allocates its queues when it is made (NumRxQueues) but receives
// only on those in use: the channels a driver reports to `ethtool -l`, which
// `ethtool -L` changes at run time. A plain veth is born with as many queues
// as there are CPUs and one in use; many NICs allocate for the largest
// channel count and start with fewer. Binding an AF_XDP socket to a queue
// that is allocated but not in use fails, and counting allocated queues
// made "serve all queues" fail on every XDP path and end up on AF_PACKET.
//
// Serving all queues therefore means serving the queues in use, and
// following them: channelPoll re-reads the channels, and the bridge binds
// the queues that come into use. Polling one ioctl a second is chosen over
// the ethtool netlink family's channel notifications because the ioctl works
// on every kernel, in every namespace, with no generic-netlink family to
// resolve, and a second's delay matters little next to `ethtool -L`
// resetting the device.

// channelPoll is how often a bridge that serves all queues re-reads how
// many are in use.
const channelPoll = time.Second

// Where a count of queues in use came from.
const (
	fromChannels  = "ethtool channels"
	fromSysfs     = "sysfs queues"
	fromAllocated = "allocated queues (the driver reports no channels)"
)

// Kinds of queue, as sysfs names them.
const (
	rxKind = "rx"
	txKind = "tx"
)

// queuesInUse counts the queues of kind (rxKind: those that receive frames,
// txKind: those that transmit) of the bridge's interface, and says where
// the count came from. allocated, the interface's NumRxQueues or
// NumTxQueues, is the last resort.
func (b *Bridge) queuesInUse(kind string, allocated int) (int, string) {
	if b.dev != nil {
		if c, err := b.dev.Channels(); err == nil {
			n := c.RxQueues()
			if kind == txKind {
				n = c.TxQueues()
			}
			if n > 0 {
				return n, fromChannels
			}
		}
	}
	if n, ok := sysfsQueues(kind, b.cfg.Interface, b.ifindex, b.mac); ok {
		return n, fromSysfs
	}
	return max(allocated, 1), fromAllocated
}

// txQueuesInUse is how many transmit queues the interface uses.
func (b *Bridge) txQueuesInUse() int {
	n, _ := b.queuesInUse(txKind, b.txAllocated)
	return n
}

// sysfsQueues counts /sys/class/net/NAME/queues/KIND-* (rxKind or txKind): the
// kernel keeps an entry for each queue in use. /sys shows the network
// namespace it was mounted in, which need not be the bridge's; the entry
// counts only if its index and address are the interface's.
func sysfsQueues(kind, name string, ifindex int, mac [6]byte) (int, bool) {
	dir := filepath.Join("/sys/class/net", name)
	idx, err := os.ReadFile(filepath.Join(dir, "ifindex"))
	if err != nil || strings.TrimSpace(string(idx)) != strconv.Itoa(ifindex) {
		return 0, false
	}
	addr, err := os.ReadFile(filepath.Join(dir, "address"))
	if err != nil || !bytes.Equal(bytes.TrimSpace(addr), []byte(macString(mac))) {
		return 0, false
	}
	qs, err := filepath.Glob(filepath.Join(dir, "queues", kind+"-*"))
	if err != nil || len(qs) == 0 {
		return 0, false
	}
	return len(qs), true
}

func macString(mac [6]byte) string {
	return fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", mac[0], mac[1], mac[2], mac[3], mac[4], mac[5])
}

// chooseQueues fills Config.Queues when it is nil (all queues in use) and
// otherwise checks that every queue it names is in use, where the driver
// says: a socket on a queue out of use would fail on every XDP path.
func (b *Bridge) chooseQueues(allocated int) error {
	if dev, err := features.OpenDevice(b.cfg.Interface); err == nil {
		b.dev = dev
	}
	n, from := b.queuesInUse(rxKind, allocated)
	b.inUse = n
	if b.cfg.Queues == nil {
		b.followQueues = true
		for i := range n {
			b.cfg.Queues = append(b.cfg.Queues, i)
		}
		if n < allocated {
			b.log.Info("bridge: serving the receive queues in use", "interface", b.cfg.Interface, "in_use", n, "allocated", allocated, "from", from)
		}
		return nil
	}
	if len(b.cfg.Queues) == 0 {
		return errors.New("bridge: no queues")
	}
	if from == fromAllocated {
		return nil
	}
	for _, q := range b.cfg.Queues {
		if q >= n {
			return fmt.Errorf("bridge: queue %d of %s is not in use: %d receive queues are (%s); serve fewer queues, or add channels (ethtool -L)", q, b.cfg.Interface, n, from)
		}
	}
	return nil
}

// watchQueues follows the queues in use until stop is closed; run when the
// bridge serves all of them. It binds new queues' sockets, which find their
// interface by index in the namespace they are made in, so it runs on a
// thread of its own in the bridge's namespace, never handed back.
func (b *Bridge) watchQueues(stop <-chan struct{}) {
	runtime.LockOSThread()
	if err := netns.Set(b.ns); err != nil {
		b.log.Warn("bridge: cannot follow the receive queues in use", "interface", b.cfg.Interface, "err", err)
		return
	}
	every(stop, channelPoll, func() {
		n, from := b.queuesInUse(rxKind, 0)
		if from == fromAllocated {
			return
		}
		b.mu.Lock()
		if n != b.inUse && !b.closed {
			b.queuesChanged(n, from)
		}
		b.mu.Unlock()
	})
}

// every calls fn every d until stop is closed.
func every(stop <-chan struct{}, d time.Duration, fn func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			fn()
		}
	}
}

// queuesChanged serves the queues that came into use; queues out of use
// keep their loops, idle, so that they serve again if the channels come
// back. On the AF_PACKET path one ring per queue served takes every queue's
// frames anyway (the fanout folds), so nothing changes there. Called with
// b.mu held.
func (b *Bridge) queuesChanged(n int, from string) {
	was := b.inUse
	b.inUse = n
	b.log.Info("bridge: the receive queues in use changed", "interface", b.cfg.Interface, "was", was, "now", n, "from", from)
	if b.prog == nil {
		return
	}
	bind := xskBindFor(b.path)
	qs := b.queues
	for id := range n {
		if slices.ContainsFunc(qs, func(q *queue) bool { return q.id == id }) {
			continue
		}
		q, err := b.openXDPQueue(id, bind)
		if err == nil {
			if len(b.cfg.CPUs) > 0 {
				q.cpu = b.cfg.CPUs[len(qs)%len(b.cfg.CPUs)]
			}
			if err = b.startLoop(q); err != nil {
				b.prog.XSKMap().Delete(uint32(id))
				q.rx.close()
				q.tx.close()
				q.closeFds()
			}
		}
		if err != nil {
			b.queueErrs.Add(1)
			b.log.Warn("bridge: cannot serve a receive queue that came into use: its frames for applications are dropped", "interface", b.cfg.Interface, "queue", id, "path", b.path.String(), "err", err)
			continue
		}
		qs = append(slices.Clip(qs), q)
		b.log.Info("bridge: serving a receive queue that came into use", "interface", b.cfg.Interface, "queue", id, "path", b.path.String())
	}
	b.queues = qs
	b.engineQueuesChanged(n)
}

// engineQueuesChanged gives the offload engine, if one runs, a socket and
// a loop on each queue in use that the bridge serves and the engine does
// not yet; queues it serves already keep their loops, idle or not. Called
// with b.mu held, on the watcher's thread in the bridge's namespace, where
// the engine's sockets find the interface.
func (b *Bridge) engineQueuesChanged(n int) {
	if b.engine == nil {
		return
	}
	for _, q := range b.queues {
		if q.id >= n {
			continue
		}
		if err := b.engine.AddQueue(q.id); err != nil {
			b.queueErrs.Add(1)
			b.log.Warn("bridge: the offload engine cannot serve a receive queue that came into use: its ingest datagrams go to the kernel", "interface", b.cfg.Interface, "queue", q.id, "err", err)
		}
	}
}

// openXDPQueue binds queue id on the attached program's path and registers
// it in the XSKMAP.
func (b *Bridge) openXDPQueue(id int, bind xsk.BindMode) (*queue, error) {
	rx, tx, err := b.openXSK(id, bind)
	if err != nil {
		return nil, err
	}
	q, err := b.newQueue(id, rx, tx)
	if err != nil {
		rx.close()
		return nil, err
	}
	fail := func(err error) (*queue, error) {
		q.rx.close()
		q.tx.close()
		q.closeFds()
		return nil, err
	}
	if err := q.openSleepSet(); err != nil {
		return fail(err)
	}
	if err := b.prog.XSKMap().Put(uint32(id), uint32(rx.sock.FD())); err != nil {
		return fail(fmt.Errorf("queue %d: XSKMAP: %w", id, err))
	}
	return q, nil
}

// queueList is the queues served now. The slice is never changed in
// place, only replaced (under b.mu), so the caller may range over it.
func (b *Bridge) queueList() []*queue {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.queues
}
