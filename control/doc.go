// Package control is fabricbridge's control plane: the protocol by which an
// application obtains its fabric stream and claims the tuples the bridge
// steers to it, the Client that applications use (package userstack wraps
// it), and the Server that the daemon runs on top of the data plane.
//
// An application on the bridge's host dials the daemon's Unix socket; one
// on another node dials TCP and proves a shared secret. Then it registers
// once for its stream and claims what it serves and where it connects:
//
//	c, err := control.DialLocal(ctx, "/run/fabricbridge/control.sock", "web")
//	if err != nil {
//		return err
//	}
//	defer c.Close() // the lease: everything the application holds goes with it
//	reg, stream, err := c.RegisterLocal(ctx, 0, 0) // addresses, MTU, ports; the stream
//	if err != nil {
//		return err
//	}
//	claim, err := c.Listen(ctx, "tcp", netip.Addr{}, 80) // any address, port 80
//
// The control connection is the lease: when it closes, for whatever reason,
// the server removes every listener and flow the application held and
// detaches its stream. Connect allocates a source port from the reserved
// range and has the exact flow installed before it replies, so the answer
// to the first packet is already steered to the application. Refusals come
// back as the package's errors (ErrPortInUse, ErrNotPermitted, ...), and a
// lost connection as ErrBridgeGone.
//
// The server side: NewServer with a Config whose Dataplane is the bridge
// (tests use a fake), then ServeLocal and ServeRemote. It calls the
// Dataplane in an order that keeps tables and streams consistent: a stream
// exists before any entry points at it, and a tuple is owned before it is
// steered.
//
// The wire protocol (framing, operations, error codes, the HMAC handshake
// of remote applications) is in docs/control.md.
package control
