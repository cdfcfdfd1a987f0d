package ingest_test

import (
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// A consumer opens a ring by the name its producer serves it under, takes
// each published buffer with Next, walks its records and releases it. In
// production the producer is the bridge's offload engine and the name comes
// from the daemon's configuration (a plain name is a socket in Dir()); here
// the example plays the producer itself, in the same process.
func ExampleOpen() {
	dir, err := os.MkdirTemp("", "ingest-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	// The producer's side: what the offload engine does with every
	// datagram an ingest rule strips.
	ring, err := ingest.Create(ingest.Config{
		Name:        filepath.Join(dir, "trigger.sock"),
		Buffers:     4,
		BufferSize:  4096,
		Window:      time.Hour, // publish on Flush only, so the output is fixed
		NoHugepages: true,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer ring.Close()

	// The consumer's side.
	c, err := ingest.Open(ring.Name(), ingest.ConsumerOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	for !ring.Stats().Attached { // the producer takes the consumer on in the background
		time.Sleep(time.Millisecond)
	}

	board := ingest.SourceOf(netip.MustParseAddr("198.18.0.2"), 5001, 9000)
	for _, payload := range []string{"hit 1", "hit 2", "hit 3"} {
		ring.Append(board, ingest.Now(), []byte(payload))
	}
	ring.Flush()

	buf, err := c.Next(time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("buffer %d: %d records\n", buf.Seq, buf.Records)
	for it := buf.Iter(); it.Next(); {
		r := it.Record()
		src, _ := c.Source(r.Source)
		fmt.Printf("%v seq %d: %s\n", src.AddrPort(), r.Seq, r.Payload)
	}
	// Payloads point into the shared buffer: copy what must outlive it.
	if err := c.Release(&buf); err != nil {
		log.Fatal(err)
	}
	// Output:
	// buffer 0: 3 records
	// 198.18.0.2:5001 seq 0: hit 1
	// 198.18.0.2:5001 seq 1: hit 2
	// 198.18.0.2:5001 seq 2: hit 3
}
