package bridge

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/bridge/features"
	"github.com/fabricbridge/fabricbridge/bridge/offload"
	"github.com/fabricbridge/fabricbridge/bridge/xsk"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/nft"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Path is how frames get from the interface to the bridge and back.
type Path int

// Paths, fastest first. Auto fallback walks them in this order.
const (
	// PathAuto, in Config, means: start with the fastest path.
	PathAuto Path = iota
	// PathNativeZeroCopy: XDP in the driver, AF_XDP sockets in zero-copy mode.
	PathNativeZeroCopy
	// PathNativeCopy: XDP in the driver, AF_XDP sockets copying frames.
	PathNativeCopy
	// PathGeneric: XDP on the kernel's skb path, AF_XDP in copy mode.
	PathGeneric
	// PathAFPacket: no XDP; TPACKET_V3 rings and the Go reference
	// classifier.
	PathAFPacket
)

var pathNames = [...]string{"auto", "native-zerocopy", "native-copy", "generic", "afpacket"}

func (p Path) String() string {
	if p >= 0 && int(p) < len(pathNames) {
		return pathNames[p]
	}
	return fmt.Sprintf("path(%d)", int(p))
}

// ParsePath is the inverse of Path.String.
func ParsePath(s string) (Path, error) {
	for i, n := range pathNames {
		if n == s {
			return Path(i), nil
		}
	}
	return 0, fmt.Errorf("bridge: unknown path %q (want one of %v)", s, pathNames[:])
}

// Mode says whether Open may fall back to a slower path.
type Mode int

const (
	// ModeAuto tries Config.Path, then every slower path in turn.
	ModeAuto Mode = iota
	// ModeStrict uses Config.Path (native zero copy if PathAuto) or fails.
	ModeStrict
)

func (m Mode) String() string {
	if m == ModeStrict {
		return "strict"
	}
	return "auto"
}

// Config is what Open needs. Zero fields take defaults.
type Config struct {
	// Interface is the Ethernet interface's name, in the network namespace
	// of the thread that calls Open.
	Interface string
	// Queues are the receive queues to serve; nil serves all those in use
	// (the device's channels, see channels.go), and follows them as they
	// change.
	Queues []int
	Mode   Mode
	Path   Path
	// FrameSize (2048 or 4096) and FrameCount size each queue's UMEM; half
	// the frames receive, half transmit. Defaults 2048 and 4096.
	FrameSize, FrameCount int
	// BusyPoll, if positive, turns on busy polling on the AF_XDP sockets.
	BusyPoll time.Duration
	// TxBudget is how many packets one stream may send per round (fairness);
	// default 32, at most 64.
	TxBudget int
	// Spin is how long an idle loop keeps polling both directions
	// (yielding the CPU between polls) before it sleeps in poll(2); default
	// 20 µs, negative: sleep at once. Waking from poll costs about as much
	// on a VM, so the spin catches steady traffic; on cores shared with the
	// applications, not spinning can be faster.
	Spin time.Duration
	// CPUs, if set, pins the loops: the i-th served queue's loop runs only
	// on CPUs[i%len(CPUs)]. A loop that spins for latency wants a core of
	// its own, near the interrupts of its NIC queue; each CPU must be one
	// this process may run on.
	CPUs []int
	// RouteCache bounds the destinations whose next hop the bridge keeps
	// (shared, and per queue); default DefaultRouteCache. Beyond it, a
	// random entry is evicted.
	RouteCache int
	// FlowCapacity is how many exact flows of each IP family the XDP
	// program's tables hold (ebpf.Options); 0: ebpf.DefaultFlowCapacity.
	FlowCapacity int
	// PinDir, if set, is a directory on a bpf file system (one per
	// interface and daemon) where the XDP program pins its link and
	// tables, so that Handover can leave it steering while no bridge runs
	// and the next Open with the same PinDir takes it over
	// (ebpf.Options.PinDir). It does nothing on the AF_PACKET path.
	PinDir string
	// NoSegmentOffload keeps every frame on the AF_XDP TX ring in copy
	// mode. By default a flush that holds consecutive segments of a TCP
	// connection goes through a packet socket instead, the segments
	// joined into one segmentation-offload packet (gso.go).
	NoSegmentOffload bool
	Logger           *slog.Logger

	// manual (tests): no loops run; tests drive rxOnce and round themselves.
	manual bool
}

// Bridge is the data plane on one interface. Its methods are safe for
// concurrent use.
type Bridge struct {
	cfg     Config
	log     *slog.Logger
	path    Path
	ifindex int
	mtu     int
	mac     [6]byte
	tried   []Fallback // what auto fallback tried before path, and why it failed
	clock   monoClock

	nl     *netlink.Handle
	ns     netns.NsHandle
	res    *resolver
	kernel *kernelPath
	prog   *fbebpf.Program // nil on the AF_PACKET path
	afp    *afpShared      // nil on the XDP paths

	// queues are the queues served, replaced (never changed in place)
	// under mu when queues come into use; see queueList.
	queues []*queue

	// Following the queues in use (channels.go).
	dev          *features.Device // nil if no ethtool socket could be opened
	txAllocated  int              // the interface's NumTxQueues, when no better count is found
	followQueues bool             // Config.Queues was nil: serve all in use
	inUse        int              // receive queues in use when last read, under mu
	queueErrs    atomic.Uint64    // queues that came into use and could not be served
	engine       *offload.Engine  // StartOffload's on the XDP paths, under mu: it follows the queues too
	watchStop    chan struct{}
	watchWG      sync.WaitGroup

	// segUsed: a queue's TX side joins segments (gso.go), only for the
	// families in tso (tsoIPv4, tsoIPv6): those the device segments on its
	// one transmit queue, as watchTSO last read them into tsoDevice, less
	// all of them after an offload send failed.
	segUsed   atomic.Bool
	tso       atomic.Uint32
	tsoDevice atomic.Uint32
	txQueues  atomic.Int32 // transmit queues in use at watchTSO's last reading

	mu         sync.Mutex // serialises control-plane changes
	streams    atomic.Pointer[streamTable]
	tables     atomic.Pointer[classifier.Tables]
	kernelErrs atomic.Uint64
	closed     bool
	captures   int // streams with a capture hook, under mu: the XDP program stamps steered frames while any

	// Receive VLAN stripping (see vlanstrip.go), under mu.
	feats       *features.Interface // nil for a device without ethtool features
	vlanChecked bool                // the tables needed VLAN tags and the device was looked at
	vlanBlind   atomic.Bool         // it strips them and could not be made to stop
	vlanRestore []string            // features turned off, to turn on at Close
	wg          sync.WaitGroup
}

// queue is one receive queue, served by one loop on a locked OS thread:
// RX and TX of the queue, in turn.
type queue struct {
	id      int
	b       *Bridge
	rx      rxPort
	tx      *txSide
	wakefd  int // eventfd: wakes the loop (stop, commands)
	sleepfd int // epoll set of wakefd and the TX event queue: what the loop sleeps on beside its socket
	stop    atomic.Bool
	ep      epoch

	rxPackets, rxBytes, rxRingFull, rxNoStream, rxMalformed, rxTooBig atomic.Uint64
	rxBatches, sleeps                                                 atomic.Uint64
	tid                                                               atomic.Int32 // the loop's thread, for benchmarks' CPU accounting
	cpu                                                               int          // Config.CPUs' choice for the loop, -1: anywhere
	txPackets, txBytes, txKernel                                      atomic.Uint64
	txRejects                                                         [numReasons]atomic.Uint64
}

// rxPort is where a queue's loop takes frames from.
type rxPort interface {
	// poll receives one batch and delivers the steered frames through d
	// (begun by the caller, ended by poll before it recycles the frames).
	// It returns how many frames it took.
	poll(d *dispatcher) int
	// wait sleeps until frames may be there or wakefd is readable. The
	// loop passes its sleep set (an epoll descriptor), which wait may
	// try to read: reading an epoll descriptor fails and changes nothing.
	wait(wakefd int)
	// kernelStats are the kernel's counters for the queue.
	kernelStats() (fillEmpty, dropped uint64)
	close() error
}

// Open starts the data plane on cfg.Interface: it loads and attaches the XDP
// classifier and binds AF_XDP sockets on every queue (or, on the AF_PACKET
// path, opens TPACKET_V3 rings), and starts one loop per queue, which serves
// both directions.
// Call it on a thread in the interface's network namespace; everything it
// opens belongs there. In ModeAuto it falls back path by path, each try on
// fresh UMEMs, and logs each failure; Path reports where it ended.
func Open(cfg Config) (*Bridge, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.FrameSize == 0 {
		cfg.FrameSize = xsk.DefaultFrameSize
	}
	if cfg.FrameCount == 0 {
		cfg.FrameCount = xsk.DefaultFrameCount
	}
	if cfg.TxBudget <= 0 {
		cfg.TxBudget = 32
	}
	cfg.TxBudget = min(cfg.TxBudget, xsk.MaxBatch)
	if cfg.Spin == 0 {
		cfg.Spin = 20 * time.Microsecond
	}
	if cfg.FrameSize != 2048 && cfg.FrameSize != 4096 {
		return nil, fmt.Errorf("bridge: frame size %d, want 2048 or 4096", cfg.FrameSize)
	}
	if err := checkCPUs(cfg.CPUs); err != nil {
		return nil, err
	}
	if cfg.FrameCount < 128 || cfg.FrameCount&(cfg.FrameCount-1) != 0 {
		return nil, fmt.Errorf("bridge: frame count %d, want a power of two of at least 128", cfg.FrameCount)
	}
	if cfg.Path < PathAuto || cfg.Path > PathAFPacket {
		return nil, fmt.Errorf("bridge: unknown path %d", cfg.Path)
	}
	b := &Bridge{cfg: cfg, log: cfg.Logger, clock: newMonoClock()}
	b.streams.Store(&streamTable{})
	if err := b.openCommon(); err != nil {
		b.closeCommon()
		return nil, err
	}
	first := max(cfg.Path, PathNativeZeroCopy)
	last := PathAFPacket
	if cfg.Mode == ModeStrict {
		last = first
	}
	var errs []error
	for p := first; p <= last; p++ {
		var err error
		if p == PathAFPacket {
			err = b.openAFPacket()
		} else {
			err = b.openXDP(p)
		}
		if err == nil {
			b.path = p
			break
		}
		b.tried = append(b.tried, Fallback{From: p, Reason: err.Error()})
		errs = append(errs, fmt.Errorf("%v: %w", p, err))
		b.log.Warn("bridge: path unavailable", "interface", cfg.Interface, "path", p.String(), "err", err)
	}
	if b.path == PathAFPacket && cfg.PinDir != "" {
		// A program a previous bridge left pinned would go on steering
		// (and dropping) beside the packet sockets.
		if detached, err := fbebpf.RemovePins(cfg.PinDir); err != nil {
			b.log.Warn("bridge: removing the XDP program a previous bridge left pinned", "interface", cfg.Interface, "err", err)
		} else if detached {
			b.log.Info("bridge: detached the XDP program a previous bridge left pinned: this one runs on AF_PACKET", "interface", cfg.Interface)
		}
	}
	if b.path == PathAuto {
		if b.prog != nil {
			b.prog.Close()
		}
		b.closeCommon()
		return nil, fmt.Errorf("bridge: no usable path on %s (mode %v): %w", cfg.Interface, cfg.Mode, errors.Join(errs...))
	}
	for _, q := range b.queues {
		if err := q.openSleepSet(); err != nil {
			b.Close()
			return nil, err
		}
	}
	for i, q := range b.queues {
		if len(cfg.CPUs) > 0 {
			q.cpu = cfg.CPUs[i%len(cfg.CPUs)]
		}
	}
	b.log.Info("bridge: running", "interface", cfg.Interface, "path", b.path.String(), "queues", len(b.queues), "cpus", cfg.CPUs)
	if _, mute, txq := b.transmitters(); len(mute) > 0 {
		// txQueueFor keeps streams off them.
		b.log.Warn("bridge: queues that receive but cannot transmit on the copy path: the device transmits on fewer queues (ethtool -l); streams are placed on the others", "interface", cfg.Interface, "queues", mute, "tx_queues", txq)
	}
	var loopErrs []error
	for _, q := range b.queues {
		if err := b.startLoop(q); err != nil {
			loopErrs = append(loopErrs, err)
		}
	}
	if len(loopErrs) > 0 {
		b.Close()
		return nil, errors.Join(loopErrs...)
	}
	if (b.followQueues || b.segUsed.Load()) && !cfg.manual {
		b.watchStop = make(chan struct{})
		if b.followQueues {
			b.watchWG.Add(1)
			go func() { defer b.watchWG.Done(); b.watchQueues(b.watchStop) }()
		}
		if b.segUsed.Load() {
			b.watchWG.Add(1)
			go func() { defer b.watchWG.Done(); b.watchTSO(b.watchStop) }()
		}
	}
	return b, nil
}

// startLoop starts q's loop and waits until it runs where Config.CPUs says.
func (b *Bridge) startLoop(q *queue) error {
	if b.cfg.manual {
		return nil
	}
	started := make(chan error, 1)
	b.wg.Add(1)
	go func() { defer b.wg.Done(); q.loop(started) }()
	return <-started
}

// openCommon resolves the interface and opens what every path needs.
func (b *Bridge) openCommon() error {
	ns, err := netns.Get()
	if err != nil {
		return fmt.Errorf("bridge: current network namespace: %w", err)
	}
	b.ns = ns
	if b.nl, err = netlink.NewHandleAt(ns); err != nil {
		return fmt.Errorf("bridge: netlink: %w", err)
	}
	link, err := b.nl.LinkByName(b.cfg.Interface)
	if err != nil {
		return fmt.Errorf("bridge: interface %q: %w", b.cfg.Interface, err)
	}
	a := link.Attrs()
	if len(a.HardwareAddr) != 6 {
		return fmt.Errorf("bridge: interface %q has no Ethernet address", b.cfg.Interface)
	}
	b.ifindex, b.mtu = a.Index, a.MTU
	// Opened here, in the interface's namespace, for SetTables to use from
	// any thread (see vlanstrip.go).
	if b.feats, err = features.Open(b.cfg.Interface); err != nil {
		b.feats = nil
		b.log.Debug("bridge: no ethtool features", "interface", b.cfg.Interface, "err", err)
	}
	copy(b.mac[:], a.HardwareAddr)
	if b.mtu+ethHeader > b.cfg.FrameSize-xdpHeadroom {
		return fmt.Errorf("bridge: MTU %d of %s does not fit frames of %d bytes", b.mtu, b.cfg.Interface, b.cfg.FrameSize)
	}
	b.txAllocated = a.NumTxQueues
	if err := b.chooseQueues(a.NumRxQueues); err != nil {
		return err
	}
	// A program pinned on the interface means the last bridge ran XDP,
	// which removed any table before it: a restart need not pay for nft.
	if idx, pinned, _ := fbebpf.PinnedLink(b.cfg.PinDir); !pinned || idx != b.ifindex {
		if err := nft.RemoveLeftover(ns, b.cfg.Interface); err != nil {
			b.log.Warn("bridge: removing a leftover nftables table", "interface", b.cfg.Interface, "err", err)
		}
	}
	if b.kernel, err = newKernelPath(); err != nil {
		return err
	}
	if b.res, err = newResolver(b.nl, ns, b.ifindex, b.mtu, b.cfg.RouteCache, b.log); err != nil {
		return err
	}
	return nil
}

func (b *Bridge) closeCommon() {
	if b.res != nil {
		b.res.close()
	}
	if b.kernel != nil {
		b.kernel.close()
	}
	if b.nl != nil {
		b.nl.Close()
	}
	if b.feats != nil {
		b.feats.Close()
	}
	if b.dev != nil {
		b.dev.Close()
	}
	if b.ns.IsOpen() {
		b.ns.Close()
	}
}

func (b *Bridge) newQueue(id int, rx rxPort, tx txPort) (*queue, error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("bridge: eventfd: %w", err)
	}
	q := &queue{id: id, b: b, rx: rx, wakefd: fd, sleepfd: -1, cpu: -1}
	if q.tx, err = newTxSide(b, q, tx); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return q, nil
}

// openSleepSet makes the one descriptor that is readable when the loop has
// something to do besides receiving: a command or stop (wakefd), or a
// packet in an armed stream (the event queue's epoll descriptor). The RX
// ports' wait polls it beside their socket.
func (q *queue) openSleepSet() error {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return fmt.Errorf("bridge: epoll: %w", err)
	}
	q.sleepfd = fd
	for _, wfd := range []int{q.wakefd, q.tx.eq.Fd()} {
		ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wfd)}
		if err := unix.EpollCtl(fd, unix.EPOLL_CTL_ADD, wfd, &ev); err != nil {
			return fmt.Errorf("bridge: epoll: %w", err)
		}
	}
	return nil
}

// closeFds closes the queue's own descriptors (the ports close theirs).
func (q *queue) closeFds() {
	if q.sleepfd >= 0 {
		unix.Close(q.sleepfd)
	}
	unix.Close(q.wakefd)
}

func (q *queue) wake() {
	var one = [8]byte{1}
	unix.Write(q.wakefd, one[:])
}

func schedYield() { unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }

// loop serves one queue until stopped: an RX batch, then a TX round (a
// fair batch from every ready stream, completions reaped), again and again
// while either side finds work. When both are idle it polls for
// Config.Spin, yielding the CPU between polls, then sleeps in one poll(2) on
// the socket and the sleep set. That sleep is safe for TX because the TX
// round that found nothing left every stream armed (fabric.EventQueue.Poll):
// a packet from then on makes the event queue's descriptor readable.
//
// It reports on started whether its thread runs where Config.CPUs says. A
// pinned thread is never handed back to the Go runtime: the loop ends with
// it still locked, so the thread exits instead of serving other goroutines
// on one CPU.
func (q *queue) loop(started chan<- error) {
	runtime.LockOSThread()
	if q.cpu < 0 {
		defer runtime.UnlockOSThread()
	} else if err := pinThread(q.cpu); err != nil {
		started <- fmt.Errorf("bridge: queue %d: %w", q.id, err)
		return
	} else if x, ok := q.tx.port.(*xdpTx); ok {
		x.pinned = true
	}
	q.tid.Store(int32(unix.Gettid()))
	started <- nil
	var (
		d         dispatcher
		idleSince time.Time
		drain     [8]byte
	)
	for !q.stop.Load() {
		q.tx.commands()
		rx := q.rxOnce(&d)
		tx := q.txOnce()
		if rx > 0 || tx > 0 {
			idleSince = time.Time{}
			continue
		}
		if spin := q.b.cfg.Spin; spin > 0 {
			if idleSince.IsZero() {
				idleSince = time.Now()
			}
			if time.Since(idleSince) < spin {
				// Poll again, but first let whatever else waits for this
				// CPU run (the application, the softirq thread): a loop
				// that spins without yielding starves them on a shared
				// core and then finds packets one at a time. Alone on its
				// core, the yield returns at once.
				schedYield()
				continue
			}
		}
		q.sleeps.Add(1)
		q.rx.wait(q.sleepfd)
		unix.Read(q.wakefd, drain[:]) // non-blocking; the event queue's descriptor is read by Poll
		idleSince = time.Time{}
	}
}

// rxOnce is one RX batch of the queue's loop.
func (q *queue) rxOnce(d *dispatcher) int {
	q.ep.enter()
	d.begin(q.b.streams.Load(), q.b.clock)
	n := q.rx.poll(d)
	q.ep.leave()
	if n > 0 {
		q.addRx(&d.c)
	}
	return n
}

// txOnce is one TX round of the queue's loop; see txSide.once.
func (q *queue) txOnce() int { return q.tx.once() }

func (q *queue) addRx(c *rxCounters) {
	q.rxBatches.Add(1)
	q.rxPackets.Add(c.packets)
	q.rxBytes.Add(c.bytes)
	if c.ringFull > 0 {
		q.rxRingFull.Add(c.ringFull)
	}
	if c.noStream > 0 {
		q.rxNoStream.Add(c.noStream)
	}
	if c.malformed > 0 {
		q.rxMalformed.Add(c.malformed)
	}
	if c.tooBig > 0 {
		q.rxTooBig.Add(c.tooBig)
	}
	*c = rxCounters{}
}

func (q *queue) addTx(c *txCounters) {
	if c.packets > 0 {
		q.txPackets.Add(c.packets)
		q.txBytes.Add(c.bytes)
	}
	if c.kernel > 0 {
		q.txKernel.Add(c.kernel)
	}
	for r, n := range c.rejects {
		if n > 0 {
			q.txRejects[r].Add(n)
		}
	}
	*c = txCounters{}
}

// pause parks every loop (for UMEM accounting); resume releases them.
func (b *Bridge) pause() {
	if b.cfg.manual {
		return
	}
	for _, q := range b.queueList() {
		done := make(chan struct{})
		q.tx.command(txCmd{park: true, done: done})
		<-done
	}
}

func (b *Bridge) resume() {
	if b.cfg.manual {
		return
	}
	for _, q := range b.queueList() {
		q.tx.resume <- struct{}{}
	}
}

// Path is the path in use.
func (b *Bridge) Path() Path { return b.path }

// Mode is the name of the path in use ("native-zerocopy", "native-copy",
// "generic" or "afpacket").
func (b *Bridge) Mode() string { return b.path.String() }

// Fallback is one path auto fallback tried and left, and why.
type Fallback struct {
	From   Path
	Reason string // the error that made the path unusable
}

func (f Fallback) String() string { return f.From.String() + ": " + f.Reason }

// Tried lists the paths auto fallback tried before the one in use, and why
// each failed.
func (b *Bridge) Tried() []string {
	s := make([]string, len(b.tried))
	for i, f := range b.tried {
		s[i] = f.String()
	}
	return s
}

// Fallbacks lists the paths auto fallback tried before the one in use, and
// why each failed.
func (b *Bridge) Fallbacks() []Fallback { return slices.Clone(b.tried) }

// umemLocked is the UMEM of one queue on the XDP paths (nil otherwise),
// for the offload engine's sockets, which share the queue with the bridge:
// the kernel allows one UMEM per queue. Called with b.mu held.
func (b *Bridge) umemLocked(queue int) *xsk.Umem {
	for _, q := range b.queues {
		if x, ok := q.rx.(*xdpRx); ok && q.id == queue {
			return x.umem
		}
	}
	return nil
}

// SetTables makes t the classification tables: the XDP program's maps
// (updated without a window) or the AF_PACKET path's reference classifier.
func (b *Bridge) SetTables(t *classifier.Tables) error {
	if t == nil {
		return errors.New("bridge: nil tables")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("bridge: closed")
	}
	if b.prog != nil {
		b.keepVLANTags(t)
		if err := b.prog.Update(t); err != nil {
			return err
		}
	}
	if b.afp != nil {
		if err := b.afp.setTables(t); err != nil {
			return err
		}
	}
	b.tables.Store(t)
	return nil
}

// Tables is the Go tables in force (with the flow deltas since they were
// set); nil before the first SetTables.
func (b *Bridge) Tables() *classifier.Tables { return b.tables.Load() }

// KernelFlows reads the exact flows back from the kernel: the XDP
// program's flow table (xdp true), or on the AF_PACKET path the nftables
// table's set elements by set name, as nft prints them. It is for checks
// and diagnostics: it walks every flow.
func (b *Bridge) KernelFlows() (xdp map[classifier.FlowKey]classifier.Target, nftSets map[string][]string, err error) {
	if b.prog != nil {
		xdp, err = b.prog.InstalledFlows()
	}
	if b.afp != nil && err == nil {
		nftSets, err = b.afp.hide.Installed()
	}
	return xdp, nftSets, err
}

// AddFlows makes flows steer, one entry each in every realisation of the
// tables (the XDP flow map or the AF_PACKET path's nftables set, and the Go
// tables), without compiling anything: the delta of a flow claim. A flow
// of a tuple already steered replaces it. Flow changes must not race a
// SetTables: the caller orders the two (a delta applied to tables being
// replaced is lost with them). On the AF_PACKET path the kernel stops
// seeing a flow before the classifier steers it (as in SetTables).
func (b *Bridge) AddFlows(flows []classifier.Flow) error {
	t, err := b.current()
	if err != nil {
		return err
	}
	if b.afp != nil {
		if err := b.afp.hide.AddFlows(flows); err != nil {
			return fmt.Errorf("bridge: %w", err)
		}
	}
	if b.prog != nil {
		if err := b.prog.AddFlows(flows); err != nil {
			b.undoAdd(flows)
			return err
		}
	}
	for i, f := range flows {
		if err := t.AddFlow(f); err != nil {
			for _, g := range flows[:i] {
				t.RemoveFlow(g)
			}
			b.undoAdd(flows)
			return fmt.Errorf("bridge: %w", err)
		}
	}
	return nil
}

// undoAdd takes back what AddFlows put into the kernel before it failed.
func (b *Bridge) undoAdd(flows []classifier.Flow) {
	if b.prog != nil {
		b.prog.RemoveFlows(flows)
	}
	if b.afp != nil {
		b.afp.hide.RemoveFlows(flows)
	}
}

// RemoveFlows stops flows steering: the Go tables first, then the kernel's
// (on the AF_PACKET path the kernel sees a flow again only once the
// classifier no longer steers it). Flows not steered are no error. Large
// removals go in chunks, so that other callers' flow changes interleave.
func (b *Bridge) RemoveFlows(flows []classifier.Flow) error {
	t, err := b.current()
	if err != nil {
		return err
	}
	for _, f := range flows {
		t.RemoveFlow(f)
	}
	if b.prog != nil {
		if err := b.prog.RemoveFlows(flows); err != nil {
			return err
		}
	}
	if b.afp != nil {
		if err := b.afp.hide.RemoveFlows(flows); err != nil {
			return fmt.Errorf("bridge: %w", err)
		}
	}
	return nil
}

// current is the tables in force, for flow deltas.
func (b *Bridge) current() (*classifier.Tables, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, errors.New("bridge: closed")
	}
	t := b.tables.Load()
	if t == nil {
		return nil, errors.New("bridge: flows before the first SetTables")
	}
	return t, nil
}

// OwnPort adds port p to what stream id may send (own) or takes it away,
// in place: each packet is checked with or without the port, and the rest
// of the ownership does not change. Adding a port owned already, or
// removing one not owned, is no error.
func (b *Bridge) OwnPort(id uint32, p classifier.PortClaim, own bool) error {
	if p.Port == 0 {
		return fmt.Errorf("bridge: ownership: %v port 0", p.Proto)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := (*b.streams.Load())[id]
	if e == nil {
		return fmt.Errorf("bridge: no stream %d", id)
	}
	set, err := e.own.Load().ports(p.Proto)
	if err != nil {
		return fmt.Errorf("bridge: ownership: port %d: %w", p.Port, err)
	}
	if own {
		set.add(p.Port)
	} else {
		set.remove(p.Port)
	}
	return nil
}

// AddStream connects the bridge's end of an application's stream under id,
// the stream id the classifier steers to, with what it may send: a
// *fabric.BridgeStream for an application on this host, the
// *fabric.RemoteBridge of a GENEVE stream for one on another node. Once it
// returns, every frame steered to id reaches the stream: no loop still
// dispatches with a table from before it.
func (b *Bridge) AddStream(id uint32, s fabric.BridgeEnd, own classifier.Ownership) error {
	if s == nil {
		return errors.New("bridge: AddStream needs the bridge's end of a stream")
	}
	o, err := compileOwnership(own)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("bridge: closed")
	}
	old := *b.streams.Load()
	if _, ok := old[id]; ok {
		return fmt.Errorf("bridge: stream %d exists", id)
	}
	e := &streamEntry{id: id, s: s, txQueue: b.txQueueFor(id), maxPayload: s.MaxPayload()}
	e.own.Store(o)
	done := make(chan struct{})
	b.queues[e.txQueue].tx.command(txCmd{add: e, done: done})
	<-done
	next := maps.Clone(old)
	next[id] = e
	b.streams.Store(&next)
	// A loop that loaded the old table before the store would count the
	// frames of its batch steered to id as NoStream and drop them, even
	// frames that arrived after AddStream returned: wait for it to finish
	// that batch (a loaded machine can hold it there for milliseconds).
	b.quiesce()
	return nil
}

// txQueueFor picks the queue whose loop drains stream id's TX ring, spreading
// streams over the queues. On the copy path an AF_XDP socket transmits on
// the device's queue of its own number, so a queue numbered past the
// transmit queues in use (more receive than transmit channels, as
// `ethtool -L rx 2 tx 1` makes) cannot send, and no stream is put there.
// The kernel refuses to take a transmit queue away while a socket is bound
// to its number, so a stream never has to move. Called with b.mu held.
func (b *Bridge) txQueueFor(id uint32) int {
	if able, _, _ := b.transmitters(); len(able) > 0 {
		return able[int(id)%len(able)]
	}
	return int(id) % len(b.queues)
}

// transmitters splits the served queues into able, the indices into
// b.queues of those whose sockets can transmit, and mute, the numbers of
// those that cannot: on the copy path, the ones numbered past the txq
// transmit queues in use.
func (b *Bridge) transmitters() (able, mute []int, txq int) {
	copyPath := b.path == PathNativeCopy || b.path == PathGeneric
	if copyPath {
		txq = b.txQueuesInUse()
	}
	for i, q := range b.queues {
		if copyPath && q.id >= txq {
			mute = append(mute, q.id)
		} else {
			able = append(able, i)
		}
	}
	return able, mute, txq
}

// SetOwnership atomically replaces what stream id may send: each packet is
// checked against the old or the new ownership as a whole.
func (b *Bridge) SetOwnership(id uint32, own classifier.Ownership) error {
	o, err := compileOwnership(own)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := (*b.streams.Load())[id]
	if e == nil {
		return fmt.Errorf("bridge: no stream %d", id)
	}
	e.own.Store(o)
	return nil
}

// RemoveStream disconnects stream id. When it returns no loop touches the
// stream any more, so the caller may close it.
func (b *Bridge) RemoveStream(id uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	old := *b.streams.Load()
	e := old[id]
	if e == nil {
		return fmt.Errorf("bridge: no stream %d", id)
	}
	next := maps.Clone(old)
	delete(next, id)
	b.streams.Store(&next)
	b.quiesce()
	if !b.closed {
		done := make(chan struct{})
		b.queues[e.txQueue].tx.command(txCmd{remove: e, done: done})
		<-done
	}
	if e.capture.Load() != nil {
		if b.captures--; b.captures == 0 && !b.closed {
			b.stampSteered(false)
		}
	}
	return nil
}

// quiesce waits until every loop's RX side has let go of any stream table loaded
// before the call.
func (b *Bridge) quiesce() {
	for _, q := range b.queues {
		c := q.ep.count.Load()
		for q.ep.active.Load() && q.ep.count.Load() == c {
			runtime.Gosched()
		}
	}
}

// Close stops the loops, detaches the program and releases everything.
// Streams stay open: they belong to the caller.
func (b *Bridge) Close() error { return b.close(false) }

// Handover is Close for a restart: with Config.PinDir on an XDP path it
// leaves the program attached through its pinned link, with its tables,
// so that frames of applications' flows keep being steered, and dropped
// while no socket is bound, instead of reaching the kernel, which would
// reset them; the next Open with the same PinDir takes the program over.
// VLAN tag stripping stays off if the rules turned it off. Otherwise it
// is Close.
func (b *Bridge) Handover() error { return b.close(b.cfg.PinDir != "" && b.prog != nil) }

// Adoption is what the XDP program took over from a program pinned in
// Config.PinDir; ok is false on the AF_PACKET path.
func (b *Bridge) Adoption() (a fbebpf.Adoption, ok bool) {
	if b.prog == nil {
		return a, false
	}
	return b.prog.Adoption(), true
}

// ReleaseHeld removes the adopted flows and listeners that no application
// claimed again (ebpf.Program.ReleaseHeld).
func (b *Bridge) ReleaseHeld() (flows, listeners int, err error) {
	if b.prog == nil {
		return 0, 0, nil
	}
	return b.prog.ReleaseHeld()
}

func (b *Bridge) close(keep bool) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	if b.watchStop != nil {
		close(b.watchStop)
		b.watchWG.Wait()
	}
	var errs []error
	if b.prog != nil && !keep {
		// Frames stop arriving before the sockets go.
		errs = append(errs, b.prog.Detach())
		b.mu.Lock()
		errs = append(errs, b.restoreVLANStripping())
		b.mu.Unlock()
	}
	for _, q := range b.queues {
		q.stop.Store(true)
		q.wake()
	}
	b.wg.Wait()
	for _, q := range b.queues {
		errs = append(errs, q.rx.close())
		q.tx.close()
		q.closeFds()
	}
	switch {
	case keep:
		// The sockets are gone, and with them their entries in the
		// program's socket map: it drops what it steers from now on.
		errs = append(errs, b.prog.Leave())
	case b.prog != nil:
		errs = append(errs, b.prog.Close())
	}
	if b.afp != nil {
		errs = append(errs, b.afp.close())
	}
	b.closeCommon()
	return errors.Join(errs...)
}
