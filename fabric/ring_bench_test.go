package fabric

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// BenchmarkRingRate is the bare ring, without streams or wake-ups: one
// producer and one consumer goroutine spinning over 1024 slots of 2048
// bytes in private memory, the consumer taking up to 64 packets at a
// time, for 64-byte, 1500-byte and mixed packets, sent in batches of 64
// and singly. It is the benchmark behind the choice of variable-length
// records (layout version 2) over fixed slots (version 1): the same
// matrix was measured against the version 1 slot ring and a record-ring
// prototype: docs/performance.md#why-records keeps both sets of numbers.
//
//	go test -run '^$' -bench 'RingRate' -benchtime 1000000x ./fabric/
func BenchmarkRingRate(b *testing.B) {
	sizes := []struct {
		name string
		f    func(int) int
	}{
		{"64", func(int) int { return 64 }},
		{"1500", func(int) int { return 1500 }},
		{"mix", mixedSize},
	}
	for _, sz := range sizes {
		for _, batch := range []int{64, 1} {
			b.Run(fmt.Sprintf("size=%s/batch=%d", sz.name, batch), func(b *testing.B) {
				var rates []float64
				for range 5 {
					rates = append(rates, ringRate(b, b.N, batch, sz.f))
				}
				b.ReportMetric(median(rates), "msgs/s")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

// mixedSize cycles a simple Internet mix: seven 64-byte packets, four of
// 576 and one of 1500.
func mixedSize(i int) int {
	switch i % 12 {
	case 7, 8, 9, 10:
		return 576
	case 11:
		return 1500
	}
	return 64
}

// ringRate moves n packets through a ring and returns packets per second.
func ringRate(b *testing.B, n, batch int, size func(int) int) float64 {
	p, c, err := newRingPair(1024, 2048)
	if err != nil {
		b.Fatal(err)
	}
	in := mkBufs(batch, 1500)
	pk := make([][]byte, batch)
	start := time.Now()
	go func() {
		for sent := 0; sent < n; {
			k := min(batch, n-sent)
			for i := 0; i < k; i++ {
				pk[i] = in[i][:size(sent+i)]
			}
			for off := 0; off < k; {
				m, _ := p.Produce(pk[off:k])
				off += m
			}
			sent += k
		}
	}()
	out := mkBufs(64, 2048)
	for got := 0; got < n; {
		k, err := c.Consume(out)
		if err != nil {
			b.Fatal(err)
		}
		got += k
	}
	return float64(n) / time.Since(start).Seconds()
}

func median(x []float64) float64 {
	slices.Sort(x)
	return x[len(x)/2]
}
