package ingest

import (
	"encoding/binary"
	"fmt"
)

// The trigger payload the reference consumer understands, a stand-in for a
// read-out board's format: a 4-byte big-endian sender sequence number (the
// board's event or packet counter), then 16-bit big-endian hit energies.
const TriggerSeqLen = 4

// PutTriggerPayload writes a trigger payload with sequence seq and the
// given energies into b, which must hold 4+2*len(energies) bytes; it
// returns the bytes used.
func PutTriggerPayload(b []byte, seq uint32, energies []uint16) int {
	binary.BigEndian.PutUint32(b, seq)
	for i, e := range energies {
		binary.BigEndian.PutUint16(b[TriggerSeqLen+2*i:], e)
	}
	return TriggerSeqLen + 2*len(energies)
}

// Reference is the CPU reference consumer: what a GPU trigger kernel would
// do with each buffer, in plain Go. Per source it counts records and
// bytes and checks two sequences: the ring's own per-source sequence (a
// gap is datagrams this box dropped) and the sender's sequence in the
// payload (a gap is datagrams lost before they reached this box, or never
// sent). Per window — a run of buffers ending with one not flagged
// BufContinued — it sums all hit energies, a calorimeter-style L0
// reduction, and counts a trigger when the sum reaches Threshold.
type Reference struct {
	// Threshold is the summed energy that makes a window trigger.
	Threshold uint64
	// Sources is indexed by the ring's source index.
	Sources []SourceCounts
	// Windows and Triggers count closed windows and those that triggered;
	// Energies holds the sum of every closed window in order, if
	// KeepEnergies.
	Windows, Triggers uint64
	KeepEnergies      bool
	Energies          []uint64
	// Gaps lists the first MaxGaps gaps seen, for reports.
	Gaps []Gap

	energy uint64
}

// MaxGaps bounds Reference.Gaps.
const MaxGaps = 64

// SourceCounts are the reference consumer's per-source results.
type SourceCounts struct {
	Records uint64
	Bytes   uint64
	// DroppedHere is the sum of gaps in the ring's per-source sequence:
	// datagrams the producer counted but could not store.
	DroppedHere uint64
	// SenderGaps is the sum of gaps in the sender's sequence numbers;
	// SenderBackwards counts numbers lower than expected (duplicates or
	// reordering before this box).
	SenderGaps, SenderBackwards uint64
	// Short counts payloads too short to hold a sender sequence number.
	Short uint64
	// Reassigned counts the times the entry went to another source: both
	// sequences start afresh then, and the counts above add up.
	Reassigned uint64

	gen                 uint32
	haveSeq             bool
	nextRing, nextSeq   uint32
	FirstSeq, LastSeq   uint32 // sender sequence numbers, first and last seen
	FirstRxNs, LastRxNs uint64
}

// Gap is one discontinuity in a source's sequence.
type Gap struct {
	Source    uint16
	Sender    bool   // in the sender's sequence (else the ring's: dropped here)
	Want, Got uint32 // the expected and the received sequence number
}

func (g Gap) String() string {
	kind := "dropped here"
	if g.Sender {
		kind = "sender"
	}
	return fmt.Sprintf("source %d: %s gap, want %d, got %d", g.Source, kind, g.Want, g.Got)
}

// Process consumes one buffer (the caller still releases it).
func (r *Reference) Process(b *Buffer) error {
	it := b.Iter()
	for it.Next() {
		rec := it.Record()
		for int(rec.Source) >= len(r.Sources) {
			r.Sources = append(r.Sources, SourceCounts{})
		}
		s := &r.Sources[rec.Source]
		fresh := s.Records == 0
		if !fresh && rec.SourceGen != s.gen {
			s.Reassigned++
			s.haveSeq, fresh = false, true
		}
		s.gen = rec.SourceGen
		s.Records++
		s.Bytes += uint64(len(rec.Payload))
		if fresh {
			s.FirstRxNs = rec.RxNs
		} else if rec.Seq != s.nextRing {
			r.gap(rec.Source, false, s.nextRing, rec.Seq)
			s.DroppedHere += uint64(rec.Seq - s.nextRing)
		}
		s.nextRing = rec.Seq + 1
		s.LastRxNs = rec.RxNs
		if len(rec.Payload) < TriggerSeqLen {
			s.Short++
			continue
		}
		seq := binary.BigEndian.Uint32(rec.Payload)
		switch d := int32(seq - s.nextSeq); {
		case !s.haveSeq:
			s.FirstSeq, s.haveSeq, s.nextSeq = seq, true, seq+1
		case d == 0:
			s.nextSeq++
		case d > 0:
			r.gap(rec.Source, true, s.nextSeq, seq)
			s.SenderGaps += uint64(d)
			s.nextSeq = seq + 1
		default:
			s.SenderBackwards++
		}
		s.LastSeq = seq
		for e := rec.Payload[TriggerSeqLen:]; len(e) >= 2; e = e[2:] {
			r.energy += uint64(binary.BigEndian.Uint16(e))
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	if b.Flags&BufContinued == 0 {
		r.Windows++
		if r.energy >= r.Threshold {
			r.Triggers++
		}
		if r.KeepEnergies {
			r.Energies = append(r.Energies, r.energy)
		}
		r.energy = 0
	}
	return nil
}

func (r *Reference) gap(src uint16, sender bool, want, got uint32) {
	if len(r.Gaps) < MaxGaps {
		r.Gaps = append(r.Gaps, Gap{Source: src, Sender: sender, Want: want, Got: got})
	}
}
