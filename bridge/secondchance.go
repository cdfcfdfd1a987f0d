package bridge

import (
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// deliveryWord is the metadata word a steered packet carries into its
// stream: the rule id, and MarkMayReturn where the packet's Spread slot has
// a previous owner that may know its connection.
func deliveryWord(m *classifier.Meta) uint32 {
	if m.Flags&classifier.FlagSecondChance != 0 {
		return m.RuleID | fabric.MarkMayReturn
	}
	return m.RuleID
}

// handOn delivers p, a packet stream e handed back with fabric.MarkNotMine,
// to the stream that gets its second chance, and reports whether it went.
// The slot of the tables in force decides, never the application: from the
// slot's current owner the packet goes to its previous owner (which may
// hand it back once more), from the previous owner back to the current one
// unmarked (which must then answer it). So an instance can only pass on
// packets of its own slots, to the one other instance that shares them,
// and a packet goes round at most once. The rule id is not known here and
// the word carries none.
//
// The lookup runs inside the loop's RX epoch: a stream that RemoveStream
// took out is not delivered into once it has returned.
func (t *txSide) handOn(e *streamEntry, p []byte) bool {
	tables := t.b.tables.Load()
	if tables == nil {
		return false
	}
	slot, ok := tables.SecondChance(p)
	if !ok || slot.Previous == 0 || slot.Previous == slot.Current {
		return false
	}
	var to, word uint32
	switch e.id {
	case slot.Current:
		to, word = slot.Previous, fabric.MarkMayReturn
	case slot.Previous:
		to = slot.Current
	default:
		return false
	}
	t.q.ep.enter()
	defer t.q.ep.leave()
	target := (*t.b.streams.Load())[to]
	if target == nil || target.dead.Load() || len(p) > target.maxPayload {
		return false
	}
	hook := target.capture.Load()
	t.handed[0], t.handedMeta[0] = p, word
	n, err := target.s.SendMeta(t.handed[:], t.handedMeta[:])
	t.handed[0] = nil
	if n != 1 || err != nil {
		if err == nil {
			target.rxRingFull.Add(1)
		}
		return false
	}
	if hook != nil {
		hook.fn(Inbound, p, time.Now())
	}
	target.rxPackets.Add(1)
	target.rxBytes.Add(uint64(len(p)))
	e.txHandedOn.Add(1)
	return true
}
