package bridge

import (
	"slices"

	"github.com/fabricbridge/fabricbridge/bridge/xsk"
)

// Stats is a snapshot of the bridge's counters.
type Stats struct {
	// Path is the path in use; Tried says which faster paths failed and why.
	Path  string
	Tried []string
	// Queues and Streams are sorted by queue number and stream id.
	Queues  []QueueStats
	Streams []StreamStats
	// KernelSendErrors counts packets the kernel refused on the hand-off
	// path (unknown neighbour).
	KernelSendErrors uint64
	// VLANRulesBlind: the tables have rules on VLAN ids, but the interface
	// strips VLAN tags before XDP and could not be made to stop, so those
	// rules cannot match (see docs/bridge.md, VLANs).
	VLANRulesBlind bool
	// Routes are the route cache's counters.
	Routes RouteCacheStats
	// QueueErrors counts receive queues that came into use while the
	// bridge served all queues and could not be bound: their steered
	// frames are dropped. A queue the offload engine could not bind
	// counts too: its ingest datagrams go to the kernel.
	QueueErrors uint64
}

// RxDrops counts received frames that reached no stream, by reason.
type RxDrops struct {
	RingFull  uint64 // the stream's RX ring was full: the newest packets were dropped
	NoStream  uint64 // no stream with the classified id, or it is gone
	Malformed uint64 // metadata or IP length unusable
	TooBig    uint64 // longer than the stream's slots (a merged frame, or a slot smaller than the MTU)
}

// QueueStats are one receive queue's counters.
type QueueStats struct {
	Queue              int
	RxPackets, RxBytes uint64 // delivered into streams
	RxDrops            RxDrops
	TxPackets, TxBytes uint64 // sent to the wire
	TxViaKernel        uint64 // handed to the kernel: neighbour not known yet, or fragments of a packet over a lowered MTU
	TxRejects          Rejects
	// TxJoined counts the packets sent joined with others of their TCP
	// connection into one segmentation-offload packet (AF_XDP copy mode,
	// Config.NoSegmentOffload), TxOffloadLost those such a send lost.
	// TxPacketSocket counts the packets sent through the packet socket
	// that carries such sends, joined or not: on a device that transmits
	// on several queues, a pinned loop sends all its packets that way.
	TxJoined, TxOffloadLost, TxPacketSocket uint64
	// FillRingEmpty counts the times the kernel found the fill ring empty
	// (AF_XDP); KernelRxDrops the frames the kernel dropped for want of
	// room (AF_XDP: RX ring full or other; AF_PACKET: ring drops).
	FillRingEmpty uint64
	KernelRxDrops uint64
	// RxBatches counts the loop's non-empty RX batches (RxPackets/RxBatches
	// is the mean batch), RxSleeps the times the loop found nothing to do
	// in either direction for Config.Spin and slept in poll.
	RxBatches, RxSleeps uint64
	// CPU is where the queue's loop is pinned (Config.CPUs); -1: anywhere.
	CPU int
}

// StreamStats are one stream's counters.
type StreamStats struct {
	ID                 uint32
	RxPackets, RxBytes uint64
	RxRingFull         uint64
	RxTooBig           uint64 // longer than the stream's slots
	TxPackets, TxBytes uint64
	TxViaKernel        uint64
	TxRejects          Rejects
	// TxHandedOn counts packets the stream handed back (fabric.MarkNotMine)
	// that went to the other owner of their Spread slot; the receiving
	// stream counts them in RxPackets.
	TxHandedOn uint64
	// Broken: the TX side found the stream broken or closed and stopped
	// draining it; the control plane should remove it.
	Broken bool
}

// Stats reads every counter; cheap enough to call once a second.
func (b *Bridge) Stats() Stats {
	s := Stats{Path: b.path.String(), Tried: b.Tried(), KernelSendErrors: b.kernelErrs.Load(), VLANRulesBlind: b.vlanBlind.Load(), QueueErrors: b.queueErrs.Load()}
	if b.res != nil {
		s.Routes = b.res.stats()
	}
	for _, q := range b.queueList() {
		qs := QueueStats{
			Queue:     q.id,
			RxPackets: q.rxPackets.Load(), RxBytes: q.rxBytes.Load(),
			RxDrops:   RxDrops{RingFull: q.rxRingFull.Load(), NoStream: q.rxNoStream.Load(), Malformed: q.rxMalformed.Load(), TooBig: q.rxTooBig.Load()},
			TxPackets: q.txPackets.Load(), TxBytes: q.txBytes.Load(), TxViaKernel: q.txKernel.Load(),
			RxBatches: q.rxBatches.Load(), RxSleeps: q.sleeps.Load(), CPU: q.cpu,
		}
		var rej [numReasons]uint64
		for r := range rej {
			rej[r] = q.txRejects[r].Load()
		}
		qs.TxRejects = rejectsFrom(&rej)
		qs.FillRingEmpty, qs.KernelRxDrops = q.rx.kernelStats()
		oc := q.tx.port.offloadStats()
		qs.TxJoined, qs.TxOffloadLost, qs.TxPacketSocket = oc.joined, oc.lost, oc.sent
		s.Queues = append(s.Queues, qs)
	}
	slices.SortFunc(s.Queues, func(a, b QueueStats) int { return a.Queue - b.Queue })
	for _, e := range *b.streams.Load() {
		ss := StreamStats{
			ID:        e.id,
			RxPackets: e.rxPackets.Load(), RxBytes: e.rxBytes.Load(), RxRingFull: e.rxRingFull.Load(), RxTooBig: e.rxTooBig.Load(),
			TxPackets: e.txPackets.Load(), TxBytes: e.txBytes.Load(), TxViaKernel: e.txKernel.Load(),
			TxHandedOn: e.txHandedOn.Load(), Broken: e.dead.Load(),
		}
		var rej [numReasons]uint64
		for r := range rej {
			rej[r] = e.txRejects[r].Load()
		}
		ss.TxRejects = rejectsFrom(&rej)
		s.Streams = append(s.Streams, ss)
	}
	slices.SortFunc(s.Streams, func(a, b StreamStats) int { return int(a.ID) - int(b.ID) })
	return s
}

// accountUMEM parks every loop and accounts for every frame of every
// queue's UMEM (XDP paths; nil on AF_PACKET). Tests use it.
func (b *Bridge) accountUMEM() []xsk.Accounting {
	b.pause()
	defer b.resume()
	var out []xsk.Accounting
	for _, q := range b.queueList() {
		if x, ok := q.tx.port.(*xdpTx); ok {
			var queued []uint64
			for _, d := range x.descs {
				queued = append(queued, d.Addr)
			}
			out = append(out, x.umem.Account(x.free, q.rx.(*xdpRx).fill.Pending, queued))
		}
	}
	return out
}
