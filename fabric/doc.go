// Package fabric carries IP packets between the bridge and an application
// over a stream: two single-producer/single-consumer rings in memory that
// both processes map, RX (bridge to application) and TX (application to
// bridge), with wake-ups only for a side that sleeps.
//
// The bridge makes a stream with NewShm and hands its memfd and eventfds to
// the application over a Unix socket with Handover; the application maps it
// with AttachShm. NewPair makes both ends in one process, for tests.
//
//	s, err := fabric.AttachShm(conn) // conn: the Unix socket from the bridge
//	if err != nil {
//		return err
//	}
//	defer s.Close()
//	n, err := s.Send([][]byte{pkt}) // blocks while the TX ring is full
//	bufs := make([][]byte, 64)
//	for i := range bufs {
//		bufs[i] = make([]byte, s.MaxPayload())
//	}
//	n, err = s.Recv(bufs) // waits for at least one packet
//
// Send, Recv and their variants may be called from several goroutines at
// once, and Close at any time. The bridge's side never blocks: a full RX
// ring drops the newest packets and counts them (Stats). Each side checks
// everything it reads from the shared memory, so a hostile or crashed peer
// breaks its own stream (ErrCorruption, ErrPeerGone), never the reader.
//
// EventQueue gathers the wake-ups of many streams into one descriptor for
// the bridge's loops. Remote carries the same packets over UDP in GENEVE,
// with credit-based flow control, for applications on other nodes; both
// transports give the application a Link.
//
// The region's byte layout is documented beside its constants (layout.go);
// the ring protocol, for a peer written in another language, is in
// docs/fabric.md.
package fabric
