// Package classifier defines what fabricbridge's rules mean and holds a
// pure-Go reference classifier with exactly the semantics of the XDP program
// in package ebpf. The reference drives the AF_PACKET fallback, and tests run
// both on the same frames to prove them equal.
//
// A RuleSet is plain data: exact flows (established connections), listeners
// (an address and port, like a listening socket) and ordered rules that
// steer, ingest, pass or drop. Compile checks it and builds the Tables that
// both realisations look up; a Classifier classifies Ethernet frames
// against them.
//
//	tables, err := classifier.Compile(&classifier.RuleSet{
//		Listeners: []classifier.Listener{{
//			ID: 1, Protocol: classifier.ProtoTCP,
//			Addr: netip.MustParseAddr("198.18.0.1"), Port: 80, Stream: 7,
//		}},
//	})
//	if err != nil {
//		return err // every problem of the set at once
//	}
//	c := classifier.New(tables, classifier.DefaultFragmentCapacity)
//	m := c.Classify(frame) // m.Verdict, m.StreamID, m.RuleID, offsets
//
// The first hit decides, in this order: the exact flow, a listener on the
// destination address and port, a wildcard listener on the port, the rules
// by priority; anything else passes to the kernel, as do ARP, ICMP that is
// not an error about a claimed tuple, and every other protocol. Malformed
// frames are counted and passed, never steered. Meta is also the layout of
// the XDP metadata in front of every steered frame, so user space never
// parses a frame twice; Ingest strips an ingest rule's datagram as the XDP
// program does.
//
// Use one Classifier per receive queue: its fragment table is its own.
// The semantics in full (VLANs, IPv6 extension headers, ICMP errors,
// fragments, malformed frames, ingest): docs/classifier.md.
package classifier
