package bridge

import (
	"errors"

	"github.com/fabricbridge/fabricbridge/bridge/offload"
	"github.com/fabricbridge/fabricbridge/classifier"
)

// SetIngest makes the AF_PACKET path feed ingest datagrams to e, an engine
// made by offload.StartFed: each loop classifies an ingest frame, strips it
// as the XDP program would (classifier.Ingest, stamped with the packet
// socket's RX time on the XDP program's clock) and hands it to its own
// Feeder, so the rings e fills look the same as on the XDP paths; frames
// the classifier judges malformed are counted as e's Stats.Refused. A nil e
// stops feeding. While an engine is fed, the nftables table hides the
// ingest rules' frames from the kernel (see hide.go). On the XDP paths it is an error: there the engine reads
// its own AF_XDP sockets (offload.Start with Program and Umem).
//
// A loop may finish the block it is in with the previous engine after
// SetIngest returns; closing that engine is safe at any time (it shuts its
// rings to late feeders first).
func (b *Bridge) SetIngest(e *offload.Engine) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.afp == nil {
		return errors.New("bridge: SetIngest is for the AF_PACKET path; on " + b.path.String() + " the ingest engine reads its own sockets")
	}
	fs := make([]*offload.Feeder, len(b.afp.rxs))
	if e != nil {
		for i, ar := range b.afp.rxs {
			var err error
			if fs[i], err = e.NewFeeder(ar.queue); err != nil {
				return err
			}
		}
	}
	t := b.tables.Load()
	if t == nil {
		var err error
		if t, err = classifier.Compile(&classifier.RuleSet{}); err != nil {
			return err
		}
	}
	// Feed first, then hide: in between, an ingest frame reaches both the
	// engine and the kernel, rather than neither.
	for i, ar := range b.afp.rxs {
		ar.feed.Store(fs[i])
	}
	return b.afp.hide.updateFed(t, e != nil)
}
