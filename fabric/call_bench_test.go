package fabric

import (
	"testing"
)

// BenchmarkCall is the per-call cost of a stream on one core, without
// cache traffic between cores: one goroutine sends one 64-byte packet
// (application side, TX ring) and takes it back out on the bridge side,
// b.N times. "ring" is the same on the bare version 2 ring (Produce and
// Consume), so the difference is the stream's own work per call: Close
// safety, serialisation of concurrent callers, state checks, counters.
//
//	go test -run '^$' -bench 'Call' -count 5 ./fabric/
func BenchmarkCall(b *testing.B) {
	b.Run("stream", func(b *testing.B) {
		br, app, err := NewPair(Config{RxSlots: 2, TxSlots: 1024})
		if err != nil {
			b.Fatal(err)
		}
		defer br.Close()
		defer app.Close()
		pk, out := mkBufs(1, 64), mkBufs(1, 2048)
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if _, err := app.Send(pk); err != nil {
				b.Fatal(err)
			}
			if n, err := br.TryRecv(out); n != 1 || err != nil {
				b.Fatal(n, err)
			}
		}
	})
	b.Run("ring", func(b *testing.B) {
		p, c, err := NewRingPair(1024, 2048)
		if err != nil {
			b.Fatal(err)
		}
		pk, out := mkBufs(1, 64), mkBufs(1, 2048)
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if _, err := p.Produce(pk); err != nil {
				b.Fatal(err)
			}
			if n, err := c.Consume(out); n != 1 || err != nil {
				b.Fatal(n, err)
			}
		}
	})
}
