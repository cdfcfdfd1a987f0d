// Package classifier defines what fabricbridge's rules mean and holds a pure-Go
// reference classifier with exactly the semantics of the XDP program in package
// ebpf. The reference drives the AF_PACKET fallback, and tests run both on the
// same frames to prove them equal.
//
// # What is classified
//
// A frame is Ethernet II with at most two VLAN tags (802.1Q, TPID 0x8100, or
// 802.1ad, TPID 0x88a8, in either order). The VLAN id a rule sees is the
// innermost tag's (the one next to the IP header); an untagged or
// priority-tagged frame has VLAN 0. A frame with a third tag, or any EtherType
// other than IPv4 and IPv6 (ARP among them), is not classified: [VerdictPass].
//
// IPv4 headers may carry options. IPv6 headers may carry a chain of up to
// [MaxExtHeaders] extension headers: hop-by-hop options (0), routing (43),
// fragment (44), authentication (51) and destination options (60). A longer
// chain is not classified ([VerdictPass]). Only TCP and UDP are classified,
// and ICMP errors about them (see ICMP errors below); every other protocol,
// and all other ICMP (ESP, echo, neighbour discovery, router adverts, ...),
// is [VerdictPass]: the kernel stays the control plane.
//
// # Precedence
//
// A TCP or UDP packet is looked up in this order; the first hit decides:
//
//  1. the exact flow table (protocol, remote address and port, local address
//     and port) — established connections;
//  2. a listener on the packet's destination address and port;
//  3. a listener on the wildcard address of the packet's family and the
//     destination port;
//  4. the rules, in ascending [Rule.Priority], ties broken by ascending
//     [Rule.ID];
//  5. the default: [VerdictPass] with rule id 0.
//
// Flows and listeners always steer to their stream. Rules steer, ingest (UDP
// only), pass or drop.
//
// # ICMP errors
//
// An application's own stack must hear of the errors its packets cause (port
// unreachable, fragmentation needed, packet too big), so an ICMP error that
// quotes a packet the application sent is steered to the application's
// stream. An ICMP error is: in IPv4, ICMP (protocol 1) of type 3 (destination
// unreachable, any code, including 4, fragmentation needed), 11 (time
// exceeded) or 12 (parameter problem); in IPv6, ICMPv6 (next header 58, after
// any extension headers the parser follows) of type 1 (destination
// unreachable), 2 (packet too big), 3 (time exceeded) or 4 (parameter
// problem). The packet carrying it must not be a fragment. Its quote starts
// after the 8-byte ICMP header and must hold, inside the outer IP packet:
//
//   - for ICMP, an IPv4 header (version 4, IHL at least 5, options allowed)
//     that is not a later fragment (offset 0), then 8 bytes of TCP or UDP;
//   - for ICMPv6, a 40-byte IPv6 header (version 6) whose next header is TCP
//     or UDP, then 8 bytes of it. A quote with extension headers is not
//     followed: routers quote what the sender sent, and applications send
//     none.
//
// The quoted length, checksum and payload fields are not checked: quotes are
// cut short by design. The quoted packet went from the local side (its
// source) to the remote (its destination), so it is looked up reversed, as
// the remote's reply would be: the exact flow (remote = quoted destination,
// local = quoted source), then a listener on the quoted source address and
// port, then a wildcard listener on that port; the first hit steers, with
// its stream and rule id, and the frame is counted under that id. The rules
// do not apply: they match traffic by its headers, and an ICMP error's
// headers are those of whoever reports it, so a steer, ingest, pass or drop
// rule never decides an ICMP error. The metadata is that of any steered
// frame: the L3 and L4 offsets are the outer IP header's and the ICMP
// header's, the VLAN the outer frame's.
//
// Every other ICMP packet, and an ICMP error that is too short, quotes a
// malformed or unfit header, quotes another family or protocol, or quotes a
// tuple no flow or listener holds, is [VerdictPass] with rule id 0, exactly
// as any unclaimed packet.
//
// # Fragments
//
// The first fragment of a datagram (offset 0, more-fragments set) carries the
// L4 header and is classified as above; when a table or rule matched it (rule
// id not 0), its result is remembered in the fragment table under (family,
// source, destination, identification, protocol). For IPv6 the protocol is the
// fragment header's next-header field. A later fragment (offset not 0) takes
// the remembered result; when there is none it is [VerdictFragMiss] and goes
// to the kernel. An IPv6 fragment header with offset 0 and no more fragments
// (an atomic fragment) is not a fragment. Fragments that arrive before their
// first fragment therefore reach the kernel: a known limit, as in most
// stateless steering designs.
//
// # Malformed frames
//
// A frame truncated anywhere the parser must read, an IPv4 header with a
// version other than 4, an IHL under 5 or beyond the frame, a total length
// shorter than the header or longer than the frame, an IPv6 payload length
// beyond the frame, an extension header or L4 header that does not fit inside
// the IP packet, a second fragment header, a TCP data offset under 5 or beyond
// the packet, or a UDP length under 8 or (unfragmented) beyond the packet is
// [VerdictMalformed]: counted, passed to the kernel, never steered. Trailing
// bytes after the IP packet (Ethernet padding) are allowed. Checksums are not
// verified here; the consumer of a stream does that.
//
// # Ingest
//
// An ingest rule offloads whole UDP datagrams only. A packet it matches that
// is a fragment (first or later), or whose UDP length is not exactly the IP
// payload after any extension headers, is [VerdictMalformed] with the rule's
// id and stream 0: counted under the rule and as malformed, passed to the
// kernel, never put into a buffer. (A first fragment so refused is
// remembered as refused, so its later fragments are refused too.)
//
// An accepted datagram is stripped: the XDP program removes everything up to
// the end of the UDP header and writes an [IngestMeta] (source address and
// port, destination port, payload length, RX timestamp, buffer and rule id)
// in front of the payload; [Ingest] computes the same bytes and strip length
// in Go. When no ingest socket is bound on the receive queue, the frame goes
// to the kernel unchanged, as a failed redirect.
package classifier
