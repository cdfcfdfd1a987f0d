// Package bridge is fabricbridge's data plane in user space: it moves
// frames the XDP classifier steered into the fabric streams of the
// applications that own them, and packets those applications write back out
// to the wire, after checking that they may send them.
//
// # Paths
//
// Open tries, in ModeAuto, from Config.Path (fastest first) down:
// native XDP with zero-copy AF_XDP sockets, native XDP with copying sockets,
// generic (skb) XDP, and finally AF_PACKET (TPACKET_V3 rings, classified by
// the Go reference classifier). Each AF_XDP try starts on fresh UMEMs. Every
// failure is logged and kept (Tried, Stats.Tried) and the path in use is
// reported (Path, Mode, Stats.Path): users must know when they run slow.
// ModeStrict refuses to fall back. An application cannot tell which path is
// in use: it sees the same IP packets either way.
//
// # Threads
//
// Each receive queue is served by one loop on a locked OS thread, both
// directions in turn: an RX batch, then a TX round, then again, while
// either finds work. RX owns the RX and fill rings, TX the TX and
// completion rings of the queue's socket. When both sides are idle the loop
// polls for Config.Spin, yielding the CPU between polls (on a shared core a
// loop that spins without yielding starves the application and finds
// packets one at a time), then sleeps in one poll(2) on the socket and on a
// sleep set (an epoll descriptor) holding the loop's eventfd (stop,
// control-plane commands) and the descriptor of the fabric.EventQueue of
// its streams. The TX round that found nothing (EventQueue.Poll returning
// 0) left every stream armed, so a packet written after it wakes the loop.
//
// Config.CPUs pins the loops, for a machine with cores to give them: a
// loop alone on its core, spinning long enough to cover the gaps between
// packets, never pays for a wake-up. A pinned loop's thread ends with the
// loop, so that the Go runtime never runs anything else on it.
//
// # RX
//
// The stream id comes from the XDP metadata in front of the frame
// (classifier.UnmarshalMeta), not from a second parse. Ethernet, VLAN tags
// and padding are cut off, consecutive packets of one stream are copied into
// its RX ring with one SendMeta (with the classifier's rule id as the slot's
// metadata word), and the frames go back to the fill ring at once, that is
// after the batch is copied and never before: a batch points into the frames
// until then. (On the AF_PACKET path the same holds for the ring's block,
// which afpacket.Rx hands back only on Release.) A full
// stream ring drops the newest packets and counts them against that stream
// only; a packet longer than the stream's slots is dropped and counted as
// too big.
//
// # The AF_PACKET path
//
// A packet socket is a tap: the kernel would get every frame too, answer
// steered TCP with resets and steered UDP with ICMP errors, and receive what
// drop rules drop. So Open installs an nftables table (netdev family, ingress
// hook on the interface, which runs after the taps) that mirrors the
// classification tables — sets of exact flows and listeners, and the rules
// in order — and drops what the classifier steers or drops; SetTables
// updates it in one nft transaction (sets by difference), Close removes it,
// and every Open removes a table a crashed run left, on any path. It needs
// the nft binary (Debian package nftables); without it the AF_PACKET path
// does not open. The table and the classifier part ways only where nftables
// cannot follow: later fragments always reach the kernel (which discards
// them, having never seen their first fragment), frames with two VLAN tags
// reach it too (it has no device for them unless one was made), and IPv6
// packets with an authentication header or more extension headers than the
// classifier walks may go either way (TestNftMirrorsClassifier checks the
// rest frame by frame). The path also turns off the receive offloads that
// merge frames before taps see them (GRO, hardware GRO, LRO, GRO lists; see
// afpacket.MergingOffloads) and turns them back on at Close. It runs a loop
// per queue of Config.Queues, their RX rings in a fanout group by receive
// queue (afpacket.FanoutByQueue); a packet socket sees the whole interface,
// so with fewer queues named than the interface has, queues fold onto loops.
// Ingest rules work here too: SetIngest gives the loops an ingest engine
// (bridge/ingest.StartFed) to feed, each loop strips ingest datagrams with
// classifier.Ingest, and while an engine is fed the table hides them from the
// kernel. The classifier's counters, per verdict and per rule, are kept by
// the loops (ClassifierCounters), as the XDP program keeps them in its maps.
//
// # TX
//
// Streams are assigned to queues' loops by id. Each round takes at most
// Config.TxBudget packets from every ready stream, straight into free frames
// of the TX ring (one copy), so a busy application cannot starve the rest.
// Every packet is verified before it leaves: IP version, header lengths, IP
// length equal to the packet's, within the MTU (the interface's current one,
// followed through netlink link notifications, and never more than a TX
// frame holds), source address among the
// stream's, protocol TCP or UDP with the source port owned by the stream
// (Ownership, replaced atomically by SetOwnership). Rejects are counted by
// reason, per stream and per queue. The Ethernet header comes from the
// kernel's route and neighbour tables, read over netlink and refreshed by
// netlink notifications; each loop keeps a private cache that a change
// invalidates. A packet whose neighbour is not known yet is handed to the
// kernel through a raw IP socket (counted as TxViaKernel): the kernel
// resolves the neighbour, sends the packet, and the new neighbour entry
// reaches the bridge as a notification. The next hops are kept per
// destination, at most Config.RouteCache of them (a random one makes room),
// and new destinations are looked up in the kernel at a bounded rate: a
// flood of new peer addresses (the spoofed sources of a SYN flood, whose
// SYN-ACKs go back to them) costs bounded memory and system calls, and the
// packets it cannot look up yet go through the kernel (RouteCacheStats).
//
// # Capture
//
// SetCapture hands every packet of one stream, both directions, to a
// function (for `fabricbridge capture`): inbound packets as they are copied
// into the stream, outbound ones after verification. The function sees the
// bridge's buffer and must copy; without a hook the cost is one atomic load
// per batch.
//
// # Sharing a queue
//
// The kernel allows one UMEM per queue. A second consumer on a queue the
// bridge serves (the ingest engine) opens its AF_XDP socket on Umem(queue);
// it then shares that queue's fill ring (see package xsk). Program returns
// the XDP program for its IngestXSKMap.
//
// # VLANs
//
// Frames that arrive tagged are classified by their inner headers and
// steered like any other, their tags cut off with the Ethernet header. On
// transmit, a destination the kernel routes through a VLAN device stacked
// directly on the served interface (netlink link type vlan, parent the
// served interface; 802.1Q or 802.1ad) is framed by the bridge with that
// device's tag, to the neighbour the kernel knows on that device; the
// packet must fit the VLAN device's MTU as well as the interface's, and
// the tagged frame a TX frame (rejected as MTU otherwise). VLAN devices are
// followed through link notifications like the MTU. A destination routed
// through any other device (another link, a VLAN device on a VLAN device)
// goes through the kernel (TxViaKernel).
//
// Many NICs take the VLAN tag off a received frame and pass it in the
// receive descriptor (`ethtool -k` calls it rx-vlan-offload; the kernel's
// features are rx-vlan-hw-parse and, for 802.1ad, rx-vlan-stag-hw-parse).
// XDP sees the frame as the NIC left it, so a classifier rule on a VLAN id
// could never match. When the XDP path is in use and the tables hold such a
// rule, SetTables turns the stripping off, as `ethtool -K IF rxvlan off
// rx-vlan-stag-hw-parse off` would, logs it, and Close turns back on what it
// turned off (a daemon killed outright leaves it off: harmless, the kernel
// then untags in software for its own VLAN devices). A device that cannot
// stop stripping is logged and reported in Stats.VLANRulesBlind. The
// AF_PACKET path needs none of this: the packet socket hands the tag over
// beside the frame, and the bridge puts it back before classifying.
package bridge
