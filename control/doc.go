// Package control is fabricbridge's control plane: the protocol by which an
// application obtains its fabric stream and claims the tuples the bridge
// steers to it, the client that applications (package userstack) use, and
// the server logic that the daemon (package appliance) runs on top of the
// data plane.
//
// # Transports
//
// Local applications connect to a Unix stream socket; who may connect is
// decided by the socket file's permissions. Applications on other nodes
// connect over TCP and must prove a shared secret (below). Either way the
// control connection is the lease: when it closes, for whatever reason
// (exit, crash, network loss), the server removes every listener and flow
// the application held, detaches its stream from the data plane and closes
// it. Nothing an application holds outlives its connection.
//
// # Framing
//
// Each message is a 4-byte big-endian length followed by that many bytes of
// one JSON object, at most MaxFrame bytes. Requests carry an id chosen by
// the client; each reply carries the id of its request. The server answers
// a connection's requests one at a time, in order; a client may have several
// outstanding. Unknown fields, unknown operations, missing or out-of-range
// values are refused with a "bad_request" error reply and change nothing.
// A frame longer than MaxFrame, or a request before a successful hello,
// gets an error reply and the connection is closed.
//
// # Operations (protocol version 1)
//
//	hello    {version, app, nonce?}        -> {version, nonce?, mac?}
//	auth     {mac}                         -> {}              (TCP only)
//	register {rx_slots?, tx_slots?, geneve?} -> {stream, addrs, mtu, ports, geneve?}
//	listen   {proto, addr?, port}          -> {claim, port}
//	connect  {proto, addr?, remote}        -> {claim, addr, port}
//	release  {claim}                       -> {}
//
// hello must come first. Its version is the highest the client speaks; a
// server that does not speak it replies "version" and closes.
//
// register gives the application its stream, once per connection. Over the
// Unix socket the reply frame carries, as SCM_RIGHTS, one end of a fresh
// socketpair over which the bridge then performs fabric's shm handover
// (fabric.BridgeStream.Handover / fabric.AttachShm); the pair is separate from the
// control connection because the handover's socket belongs to the stream
// afterwards. Over TCP the request names the application's GENEVE endpoint
// (its address must be the control connection's source address, or
// unspecified to mean exactly that), both sides register the stream with
// VNI = stream id, and the reply names the bridge's GENEVE endpoint. The
// reply lists the addresses the application may use as sources, the MTU
// of the path behind the bridge, and the reserved range its ephemeral
// ports come from.
//
// listen claims every packet to addr:port (addr absent: any address of
// either family; 0.0.0.0 or ::: any of one family) for proto "tcp" or
// "udp". Port 0 asks for a free port of the reserved range. Ports inside
// the reserved range cannot be named explicitly: they are the server's to
// hand out. A port that the configuration binds to the application itself
// (a configured listener, see Static) may be claimed too: the claim shares
// the configured entry, which already steers to the application's stream,
// and the application's stack can bind the port; only the part of the claim
// the configured listener does not cover gets an entry of its own.
//
// connect allocates a free port P of the reserved range for an outgoing
// conversation from addr:P to remote, and installs the exact flow
// remote -> addr:P into the classifier before it replies, so the answer to
// the application's first packet (the SYN) is already steered to it. addr
// absent means the first address of the remote's family the application may
// use; the reply says which.
//
// release gives up a claim (a listener or a flow) by the number listen or
// connect returned.
//
// # Errors
//
// An error reply is {"id":N,"error":{"code":C,"message":M}}. The codes and
// the errors the client maps them to: bad_request (ErrBadRequest), version
// (ErrVersion), auth (ErrAuth), not_registered (ErrNotRegistered),
// not_permitted (ErrNotPermitted: address or port outside the application's
// policy), port_in_use (ErrPortInUse: held by another application, or
// already by this one), quota (ErrQuota), no_ports (ErrNoPorts: the reserved
// range is exhausted), unknown_claim (ErrUnknownClaim), bridge_gone
// (ErrBridgeGone: the data plane refused or is closed) and internal. When
// the control connection itself is lost the client reports ErrBridgeGone.
//
// # Authentication of remote applications
//
// Each remote application has a secret shared with the daemon (per
// application name). The handshake is a mutual HMAC-SHA256
// challenge-response: the client's hello carries a 32-byte random nonce Nc;
// the server answers with its own nonce Ns and
// HMAC(secret, "fabricbridge-control-v1 bridge" 0 app 0 Nc Ns), which the
// client checks before going on (so an application does not hand its
// traffic to an impostor); the client then sends auth with
// HMAC(secret, "fabricbridge-control-v1 app" 0 app 0 Nc Ns). The two labels
// keep either MAC from being replayed as the other, and fresh nonces keep
// old exchanges from being replayed at all. An unknown application name is
// answered with a MAC under a random key, so the exchange does not reveal
// which names exist. The secret never crosses the wire. The connection is
// not encrypted afterwards: run it on the cluster's management network, or
// inside a tunnel if the path is not trusted.
package control
