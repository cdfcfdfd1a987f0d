package ingest

import (
	"math/bits"
	"sync/atomic"
)

// Histogram counts latencies in log-linear buckets: four per power of two
// from 256 ns up (each bucket at most 25 % wider than its lower bound) to
// about 17 s, then one overflow bucket. Observe is lock-free and never
// allocates; Snapshot may run concurrently from a metrics goroutine.
type Histogram struct {
	counts [histBuckets]atomic.Uint64
	sum    atomic.Uint64
	n      atomic.Uint64
}

const (
	histSub     = 4 // buckets per power of two
	histMinExp  = 8 // the first bucket holds [0, 256 ns)
	histMaxExp  = 34
	histBuckets = 1 + (histMaxExp-histMinExp)*histSub + 1
)

func histIndex(ns uint64) int {
	if ns < 1<<histMinExp {
		return 0
	}
	e := bits.Len64(ns) - 1
	if e >= histMaxExp {
		return histBuckets - 1
	}
	sub := int(ns>>(e-2)) & (histSub - 1)
	return 1 + (e-histMinExp)*histSub + sub
}

// histUpper is the exclusive upper bound of bucket i, in ns; the last
// bucket has none (0).
func histUpper(i int) uint64 {
	if i == 0 {
		return 1 << histMinExp
	}
	if i == histBuckets-1 {
		return 0
	}
	i--
	e, sub := histMinExp+i/histSub, uint64(i%histSub)
	return (histSub + sub + 1) << (e - 2)
}

// Observe adds one latency in nanoseconds.
func (h *Histogram) Observe(ns uint64) {
	h.counts[histIndex(ns)].Add(1)
	h.sum.Add(ns)
	h.n.Add(1)
}

// HistogramSnapshot is a histogram's state at one moment, ready to export:
// Counts[i] latencies fell below Upper[i] (and at or above Upper[i-1]);
// the last bucket, with Upper 0, holds everything longer.
type HistogramSnapshot struct {
	Upper  []uint64
	Counts []uint64
	Count  uint64
	SumNs  uint64
}

// Snapshot copies the counts.
func (h *Histogram) Snapshot() HistogramSnapshot {
	s := HistogramSnapshot{Upper: make([]uint64, histBuckets), Counts: make([]uint64, histBuckets)}
	for i := range h.counts {
		s.Upper[i] = histUpper(i)
		s.Counts[i] = h.counts[i].Load()
		s.Count += s.Counts[i]
	}
	s.SumNs = h.sum.Load()
	return s
}

// Quantile is the upper bound of the bucket holding the q-th quantile
// (0 < q <= 1), so it overstates by at most a bucket's width; 0 when empty.
// Beyond the last bound it reports the last finite bound.
func (s HistogramSnapshot) Quantile(q float64) uint64 {
	if s.Count == 0 {
		return 0
	}
	rank := uint64(q*float64(s.Count) + 0.5)
	rank = max(rank, 1)
	var seen uint64
	for i, c := range s.Counts {
		seen += c
		if seen >= rank {
			if s.Upper[i] == 0 {
				return s.Upper[i-1]
			}
			return s.Upper[i]
		}
	}
	return s.Upper[len(s.Upper)-2]
}
