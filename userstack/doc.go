// Package userstack runs an application's own TCP/IP stack (gVisor's
// netstack) over its fabric stream and offers it through the standard
// library's interfaces: Listen returns a net.Listener, Dial a net.Conn,
// ListenPacket a net.PacketConn, so http.Serve, TLS and everything else
// written against package net work unchanged.
//
//	s, err := userstack.Open(ctx, userstack.Options{App: "web", Control: "/run/fabricbridge/control.sock"})
//	l, err := s.Listen("tcp", ":80")
//	http.Serve(l, handler)
//
// # Claims
//
// The bridge steers to a stream only the tuples its application claimed,
// and lets out only packets from them (package control). Listen and
// ListenPacket claim the local address and port before the stack binds;
// Dial gets its source port from the bridge's reserved range, and the
// bridge has installed the exact flow before the stack sends the SYN, so
// the answer cannot go astray. Closing a listener, packet conn or UDP conn
// gives its claim back at once; a TCP connection keeps its flow until its
// closing handshake is done (plus one second of TIME-WAIT; at most 30 s),
// and a listener's port stays claimed while connections it accepted are
// open, as with kernel sockets.
// The control connection is the lease: Close, or the process dying,
// releases everything.
//
// # Data path
//
// LinkEndpoint is the stack's link: layer 3, no Ethernet (the bridge adds
// it from the kernel's neighbour table), batches of up to 64 packets per
// ring operation, TCP segmentation offload done in the endpoint, TCP
// receive coalescing (GRO) before the stack, and no allocation per packet
// on either side. The MTU is the smallest of the bridge's wire MTU, the
// stream's slot payload and Options.MTU.
//
// One goroutine receives: it takes a batch from the stream, checks and
// delivers it, then yields its P so that the TCP processor and the
// application goroutines it woke run at once, instead of waiting behind a
// loop that sleeps in poll(2) holding the P. By default it sleeps as soon
// as the stream is empty (Options.Spin). Transmit runs inline on whichever
// goroutine the stack sends from, straight into the stream.
//
// # Checksums
//
// Verified exactly once, on the application's side: the bridge and the XDP
// classifier never look at L4 checksums (the bridge is shared by all
// applications and copies each packet once; checking here spreads the cost
// over the applications' own cores and covers the stream copy too). The
// link endpoint's receive loop checks every packet right after the ring
// copy — IPv4 header, TCP, UDP, ICMP and ICMPv6 — drops and counts a bad one
// (LinkStats.RxBadChecksum) and tells gVisor the rest are checked (receive
// checksum offload), so gVisor does not check them again and GRO may
// coalesce them. What the loop cannot judge alone (IP fragments, whose L4
// checksum covers the reassembled datagram; IPv6 extension headers; other
// protocols) goes up with the offload switched off for that one packet, and
// gVisor checks it. On transmit the stack computes checksums and the bridge
// sends them as they are; a peer behind a veth must not leave them to
// offload (tests turn tx checksumming off on the outside end, as a real NIC
// would have computed them).
//
// # Defaults
//
// SACK on, CUBIC, no Nagle delay, 1 MB send and receive buffers growing to
// 8 MB by receive-buffer moderation, except that a receive window never
// exceeds what the stream's RX ring holds (the bridge drops what does not
// fit), and reuse of TIME-WAIT ports when safe.
//
// # ICMP errors
//
// ICMP is the kernel's: the stack generates none. The bridge's classifier
// steers an ICMP or ICMPv6 error to the stream of the flow or listener
// whose packet it quotes, and the stack acts on it as a kernel would:
// fragmentation needed and packet too big lower the connection's segment
// size (path MTU discovery; the stack sets DF), a port unreachable fails a
// TCP dial and the next read or write of a connected UDP socket, a host
// unreachable or administratively prohibited (IPv4) fails a TCP dial. A
// read already waiting on a UDP socket wakes with the error, as on Linux
// (gVisor alone would leave it asleep). Every ICMPv6 destination
// unreachable fails an IPv6 TCP dial at once with Linux's errno
// (ENETUNREACH, EACCES for administratively prohibited and the policy
// codes, EHOSTUNREACH, ECONNREFUSED, EPROTO), and a connected UDP socket,
// IPv4 or IPv6, reports the codes Linux reports with Linux's errno
// (administratively prohibited: EHOSTUNREACH over IPv4, EACCES over IPv6)
// and ignores the others as Linux does: gVisor acts on fewer codes, so the
// receive loop hands it the others as one it acts on and notes the real
// errno for the flow (unreach6.go).
//
// # Errors
//
// Errors that a peer or the network caused are the kernel's errnos inside
// the usual *net.OpError, so errors.Is(err, syscall.ECONNREFUSED) (and
// ECONNRESET, EHOSTUNREACH, ENETUNREACH, ETIMEDOUT, ...) holds as for
// kernel sockets: "dial tcp 198.18.0.1:9: connect: connection refused".
// gonet, gVisor's adapter underneath, passes on only gVisor's text
// ("connection was refused"); the translation is in errors.go.
package userstack
