// Package userstack gives an application its own TCP/IP stack (gVisor's
// netstack) on the fabric stream that the bridge steers its traffic into,
// behind the standard library's interfaces: Listen returns a net.Listener,
// Dial a net.Conn, ListenPacket a net.PacketConn. http.Serve, crypto/tls
// and everything else written against package net work unchanged.
//
//	s, err := userstack.Open(ctx, userstack.Options{
//		App:     "web",                            // the name in the daemon's configuration
//		Control: "/run/fabricbridge/control.sock", // or Remote, from another node
//	})
//	if err != nil {
//		return err
//	}
//	defer s.Close()
//	l, err := s.Listen("tcp", ":80")
//	if err != nil {
//		return err
//	}
//	return http.Serve(l, handler)
//
// The bridge steers to a stack only the tuples its application claimed,
// and lets out only packets from them. Listen and ListenPacket claim their
// address and port before the stack binds; Dial takes its source port from
// the bridge's reserved range and the bridge installs the flow before the
// SYN leaves. Closing a listener or connection gives its claim back (a TCP
// connection after its closing handshake), and closing the Stack, or the
// process dying, releases everything.
//
// Errors a peer or the network caused are the kernel's errnos inside the
// usual *net.OpError, so errors.Is(err, syscall.ECONNREFUSED) holds as for
// kernel sockets; ICMP errors the bridge steers to the stack act as they
// would on Linux. Checksums are verified once, here, on the application's
// cores. Options.Spin trades a core for wake-ups where the application has
// cores of its own.
//
// An instance of an application behind several bridge boxes (a scale-out
// group behind ECMP) lists them in Options.Bridges: one stack, registered
// with every box, so that a connection is served whichever box its packets
// reach (docs/userstack.md#several-bridges-one-instance-every-box).
//
// Claims, the data path, checksums, defaults and ICMP handling in detail:
// docs/userstack.md.
package userstack
