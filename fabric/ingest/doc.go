// Package ingest is the ring of persistent buffers that fabricbridge's UDP
// offload path fills and a trigger consumer (CPU or GPU) reads: NaNet's
// circular list of persistent buffers in shared memory.
//
// The producer, the bridge's offload engine, appends each stripped datagram
// as a record (payload, source, RX timestamp, per-source sequence) to the
// open buffer, and publishes the buffer when it is full or its time window
// closes. A consumer attaches by the ring's name, takes buffers in order,
// and releases each when done; a buffer it holds is never overwritten, and
// a datagram that finds no free buffer is dropped and counted (a gap in its
// source's sequence).
//
//	c, err := ingest.Open("trigger", ingest.ConsumerOptions{})
//	if err != nil {
//		return err
//	}
//	defer c.Close()
//	for {
//		buf, err := c.Next(-1) // wait for the next published buffer
//		if err != nil {
//			return err // ErrClosed once the producer has gone
//		}
//		for it := buf.Iter(); it.Next(); {
//			process(it.Record()) // the payload lies in the shared buffer
//		}
//		c.Release(&buf)
//	}
//
// A plain name is a socket in Dir(); a name with a slash is the socket's
// path. Create makes a ring (the engine's side); Reference.Process is what
// a GPU trigger kernel would do with each buffer, in plain Go, checking
// every source's sequences on the way. The consumer checks everything it
// reads, so a broken producer ends the walk with ErrCorruption, never a
// read outside the region. Each buffer's wire-to-consumer latency goes into
// ConsumerStats; to keep its tail short on a shared machine, run the
// consumer on a real-time thread (LockRealtime, ConsumerOptions.NoYield).
//
// The byte layout is documented beside its constants (layout.go) and in
// fb_ingest.h for C and CUDA; the protocol, and how a CUDA kernel reads the
// region in place, are in docs/ingest.md.
package ingest
