package bridge

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge/afpacket"
	"github.com/fabricbridge/fabricbridge/bridge/offload"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/classifier/nft"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// afpShared is the AF_PACKET path's classifiers (one per queue: each keeps
// its own fragment table) and the nftables table that hides steered frames
// from the kernel; SetTables feeds them all.
type afpShared struct {
	cls  []*classifier.Classifier
	rxs  []*afpRx // per queue, for setIngest
	hide *nft.Table
	offl *afpacket.Offloads // merging offloads turned off, restored on close
}

// setTables updates the kernel's table first: in the moment between the
// two, a newly steered frame is lost rather than answered by the kernel
// (a lost SYN is sent again; a reset ends the connection).
func (a *afpShared) setTables(t *classifier.Tables) error {
	if err := a.hide.Update(t); err != nil {
		return fmt.Errorf("bridge: %w", err)
	}
	for _, c := range a.cls {
		c.SetTables(t)
	}
	return nil
}

func (a *afpShared) close() error { return errors.Join(a.hide.Close(), a.offl.Restore()) }

// openAFPacket sets up the fallback: per queue of Config.Queues a TPACKET_V3
// RX ring classified by the Go reference classifier and a TX ring. The RX
// rings form a fanout group by receive queue, so each loop gets the frames
// of its queue (of every queue modulo the ring count when Config.Queues
// names fewer than the interface has: a tap sees the whole interface). The
// kernel would receive every frame too; the nftables table hides the
// steered ones from it.
func (b *Bridge) openAFPacket() (err error) {
	if b.prog != nil {
		b.prog.Close()
		b.prog = nil
	}
	empty, err := classifier.Compile(&classifier.RuleSet{})
	if err != nil {
		return err
	}
	if t := b.tables.Load(); t != nil {
		empty = t
	}
	// A tap sees frames after GRO/LRO merged them: turn those off, so that
	// every frame fits a slot and is what was on the wire.
	offl, err := afpacket.DisableMerging(b.cfg.Interface)
	if err != nil {
		return err
	}
	if ch := offl.Changed(); len(ch) > 0 {
		b.log.Info("bridge: receive offloads turned off for the AF_PACKET path (restored on close)", "interface", b.cfg.Interface, "features", ch)
	}
	hide, err := nft.Open(b.ns, b.cfg.Interface, empty)
	if err != nil {
		offl.Restore()
		return fmt.Errorf("bridge: %w", err)
	}
	var (
		qs  []*queue
		rxs []*afpacket.Rx
		ars []*afpRx
		cls []*classifier.Classifier
	)
	defer func() {
		if err != nil {
			for _, q := range qs {
				q.rx.close()
				q.tx.close()
				q.closeFds()
			}
			hide.Close()
			offl.Restore()
		}
	}()
	for _, id := range b.cfg.Queues {
		rx, err := afpacket.NewRx(afpacket.RxConfig{Ifindex: b.ifindex})
		if err != nil {
			return err
		}
		tx, err := afpacket.NewTx(afpacket.TxConfig{Ifindex: b.ifindex, FrameSize: 2048, FrameCount: b.cfg.FrameCount / 2})
		if err != nil {
			rx.Close()
			return err
		}
		if tx.MaxFrame() < b.mtu+ethHeader {
			rx.Close()
			tx.Close()
			return errors.New("MTU too large for the AF_PACKET TX ring")
		}
		ar := &afpRx{rx: rx, cls: classifier.New(empty, 0), queue: id}
		ar.onFrame = ar.frame
		q, err := b.newQueue(id, ar, &afpTx{tx: tx})
		if err != nil {
			rx.Close()
			tx.Close()
			return err
		}
		qs = append(qs, q)
		rxs = append(rxs, rx)
		ars = append(ars, ar)
		cls = append(cls, ar.cls)
	}
	if err := afpacket.FanoutByQueue(rxs); err != nil {
		return err
	}
	b.queues = qs
	b.afp = &afpShared{cls: cls, rxs: ars, hide: hide, offl: offl}
	return nil
}

// afpRx classifies each frame of the RX ring with the reference classifier
// and delivers the steered ones, and ingest datagrams to the ingest
// engine's feeder if setIngest gave one.
type afpRx struct {
	rx      *afpacket.Rx
	cls     *classifier.Classifier
	queue   int
	d       *dispatcher
	onFrame func([]byte, bool, int64) // frame, bound once: no allocation per poll
	counts  afpCounters

	feed    atomic.Pointer[offload.Feeder]
	fd      *offload.Feeder // feed, loaded for one poll
	clockOK bool            // realToMono is set for this poll
	// realToMono turns the packet socket's CLOCK_REALTIME stamps into the
	// CLOCK_MONOTONIC ones of ingest records (as the XDP program stamps).
	realToMono int64
}

func (a *afpRx) frame(f []byte, rebuilt bool, rxNs int64) {
	m := a.cls.Classify(f)
	a.counts.count(&m, len(f))
	switch m.Verdict {
	case classifier.VerdictSteer:
		a.d.frame(f, &m)
		if rebuilt {
			a.d.end() // the scratch buffer is reused by the next rebuilt frame
		}
	case classifier.VerdictIngest:
		if a.fd != nil {
			a.ingest(f, &m, rxNs)
		}
	case classifier.VerdictMalformed:
		if a.fd != nil {
			a.fd.Refused()
		}
	}
	// Anything else the kernel has already.
}

// ingest strips the frame as the XDP program would and hands it to the
// feeder, which copies the payload at once (a rebuilt frame's scratch
// buffer may be reused after this).
func (a *afpRx) ingest(f []byte, m *classifier.Meta, rxNs int64) {
	im, strip, ok := classifier.Ingest(f, m)
	if !ok {
		a.fd.Refused()
		return
	}
	if !a.clockOK {
		a.realToMono = time.Now().UnixNano() - int64(ingest.Now())
		a.clockOK = true
	}
	im.RxTimestampNs = uint64(rxNs - a.realToMono)
	a.fd.Add(&im, f[strip:])
}

// poll delivers one block. The dispatcher batches frames and copies them
// into streams at d.end, so the block goes back to the kernel only after
// that (as the XDP path refills only after d.end); the ingest feeder
// copies as it goes, and its batch ends before the block goes back too.
func (a *afpRx) poll(d *dispatcher) int {
	a.d = d
	a.fd = a.feed.Load()
	n := a.rx.Poll(a.onFrame)
	d.end()
	if a.fd != nil {
		a.fd.End()
		a.fd, a.clockOK = nil, false
	}
	a.rx.Release()
	a.d = nil
	return n
}

func (a *afpRx) wait(wakefd int) { a.rx.Wait(wakefd) }

func (a *afpRx) kernelStats() (fillEmpty, dropped uint64) { return 0, a.rx.Drops() }

func (a *afpRx) close() error { return a.rx.Close() }

// afpTx lends TX ring slots. The kernel sends slots in ring order and stops
// at the first unmarked one, so a packet that is sent after a rejected one
// moves down into the rejected one's slot.
type afpTx struct {
	tx    *afpacket.Tx
	k     int
	nsent int
}

func (a *afpTx) lend(bufs [][]byte) int {
	a.k = a.tx.Free(len(bufs))
	a.nsent = 0
	for i := range a.k {
		bufs[i] = a.tx.Buf(i)[:a.tx.MaxFrame()]
	}
	return a.k
}

func (a *afpTx) send(i, n int) {
	// The cursor sits at the first lent slot plus what was sent.
	if rel := i - a.nsent; rel != 0 {
		copy(a.tx.Buf(0), a.tx.Buf(rel)[:n])
	}
	a.tx.Queue(n)
	a.nsent++
}

func (a *afpTx) settle()       { a.k = 0 }
func (a *afpTx) flush()        { a.tx.Flush() }
func (a *afpTx) reclaim()      {}
func (a *afpTx) maxFrame() int { return a.tx.MaxFrame() }
func (a *afpTx) release()      { a.tx.Close() }

func (a *afpTx) offloadStats() offloadCounts { return offloadCounts{} }
