// Package bridge is fabricbridge's data plane in user space: it moves the
// frames the XDP classifier steered into the fabric streams of the
// applications that own them, and sends what those applications write back
// out to the wire once it has checked that they may send it.
//
//	b, err := bridge.Open(bridge.Config{Interface: "eth1"})
//	if err != nil {
//		return err
//	}
//	defer b.Close()
//	log.Printf("serving on %v (%s); tried: %v", b.Path(), b.Mode(), b.Tried())
//	err = b.AddStream(7, stream, bridge.Ownership{ // stream: the bridge's end, fabric.NewShm
//		Addrs: []netip.Addr{netip.MustParseAddr("198.18.0.1")},
//		Ports: []bridge.PortClaim{{Proto: classifier.ProtoTCP, Port: 80}},
//	})
//	err = b.SetTables(tables) // classifier.Compile: which tuples go to stream 7
//
// Open takes the fastest path the interface allows and says which (Path,
// Mode, Stats): native XDP with zero-copy AF_XDP sockets, then copying
// sockets, generic XDP, and last AF_PACKET with the Go reference classifier
// and an nftables table that hides steered frames from the kernel. An
// application cannot tell the paths apart. Each receive queue is served by
// one loop on a locked OS thread, receive and transmit in turn; Config.Spin
// and Config.CPUs trade cores for wake-ups.
//
// On receive, the stream id comes from the XDP metadata, and a full stream
// drops the newest packets and counts them against that stream only. On
// transmit every packet is verified (lengths, MTU, source address, protocol
// and source port against the stream's Ownership) and framed from the
// kernel's neighbour and route tables; a packet whose neighbour is unknown
// goes through the kernel. Rejects are counted by reason (Stats).
// SetCapture hands one stream's packets to a function, for
// `fabricbridge capture`.
//
// The paths, threads, AF_PACKET's nftables mirror, transmit checks and
// VLAN handling in detail: docs/bridge.md.
package bridge
