package userstack

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
	"gvisor.dev/gvisor/pkg/waiter"

	"github.com/fabricbridge/fabricbridge/control"
)

// listenBacklog matches Linux's default somaxconn. gVisor also keeps at
// most listenBacklog-1 handshakes of a listener in progress, each a whole
// endpoint (about 3 KB) for up to about 127 s (SYN-ACKs at 1, 2, ... 64 s),
// and answers SYNs beyond with cookies: a SYN flood costs a listener about
// 13 MB for two minutes, however long it lasts (TestSynFloodMemoryPlateau,
// TestRepeatedSynFloodsPlateau; docs/userstack.md).
const listenBacklog = 4096

// bindRetries is how often Dial asks the bridge for another port when the
// one it got is still taken in the stack (a connection of ours on it is in
// TIME-WAIT with the same peer).
const bindRetries = 3

// lingerMax bounds how long a closed TCP connection keeps its flow while
// its closing handshake completes; after that the tuple goes back even if
// the peer never answered.
const lingerMax = 30 * time.Second

// timeWaitHold is how long a connection stays in TIME-WAIT, and keeps its
// flow: a few retransmission timeouts, enough to answer a peer's FIN sent
// again, far less than the kernel's minute, so that ports of the reserved
// range come back quickly. gVisor ends TIME-WAIT then too (newNetstack): a
// gVisor endpoint is kept whole through it, 8–12 KB each, and a server
// that closes its connections first (HTTP/1.0, ab) at thousands a second
// held hundreds of MB of them for the minute, long after the bridge had
// stopped steering their tuples here.
const timeWaitHold = time.Second

// Listen announces on the local address: "tcp", "tcp4" or "tcp6", and
// "host:port" where host is empty (every address of the stack) or one of
// the stack's addresses, and port 0 asks the bridge for a free one.
func (s *Stack) Listen(network, address string) (net.Listener, error) {
	k, claimAddr, np, port, err := s.resolve(network, address, "tcp")
	if err != nil {
		return nil, err
	}
	// A fixed port listens in the stack before the bridge steers to it: an
	// instance that joins a shared listener gets its first connections
	// the moment the bridge grants the claim, and must not refuse them.
	var wq waiter.Queue
	var ep tcpip.Endpoint
	if port != 0 {
		if ep, err = s.listenEndpoint(k, np, claimAddr, port, &wq); err != nil {
			return nil, err
		}
	}
	cl, l, err := s.claim(k, "tcp", claimAddr, port)
	if err != nil {
		if ep != nil {
			ep.Close()
		}
		return nil, err
	}
	if ep == nil {
		if ep, err = s.listenEndpoint(k, np, claimAddr, cl.Port, &wq); err != nil {
			l.drop()
			return nil, err
		}
	}
	return &tcpListener{ep: ep, wq: &wq, lease: l, addr: tcpAddr(claimAddr, cl.Port), done: make(chan struct{})}, nil
}

// listenEndpoint is a TCP endpoint listening on addr:port in the stack.
func (s *Stack) listenEndpoint(k netKind, np tcpip.NetworkProtocolNumber, addr netip.Addr, port uint16, wq *waiter.Queue) (tcpip.Endpoint, error) {
	ep, terr := s.ns.NewEndpoint(tcp.ProtocolNumber, np, wq)
	if terr == nil {
		if terr = ep.Bind(fullAddr(addr, port)); terr == nil {
			terr = ep.Listen(listenBacklog)
		}
		if terr != nil {
			ep.Close()
		}
	}
	if terr != nil {
		return nil, opError("listen", k, tcpAddr(addr, port), tcpipErr{terr})
	}
	return ep, nil
}

// announce is the common first half of Listen and ListenPacket: it checks
// the network and address, and claims the local address and port (port 0:
// any free one) with the bridge. The errors are ready to return.
func (s *Stack) announce(network, address, proto string) (k netKind, claimAddr netip.Addr, np tcpip.NetworkProtocolNumber, cl control.Claim, l *lease, err error) {
	var port uint16
	if k, claimAddr, np, port, err = s.resolve(network, address, proto); err != nil {
		return k, claimAddr, np, cl, nil, err
	}
	cl, l, err = s.claim(k, proto, claimAddr, port)
	return k, claimAddr, np, cl, l, err
}

// resolve checks network and address and finds the local address to claim.
func (s *Stack) resolve(network, address, proto string) (k netKind, claimAddr netip.Addr, np tcpip.NetworkProtocolNumber, port uint16, err error) {
	k, err = parseNetwork(network)
	if err == nil && k.proto != proto {
		err = net.UnknownNetworkError(network)
	}
	if err != nil {
		return k, claimAddr, np, 0, opError("listen", netKind{proto: network}, nil, err)
	}
	a, port, err := parseAddr(address)
	if err != nil {
		return k, claimAddr, np, 0, opError("listen", k, nil, err)
	}
	if err = s.checkOpen(); err != nil {
		return k, claimAddr, np, 0, opError("listen", k, nil, err)
	}
	if claimAddr, np, err = s.localFor(k, a); err != nil {
		return k, claimAddr, np, 0, opError("listen", k, nil, err)
	}
	return k, claimAddr, np, port, nil
}

// claim claims proto claimAddr:port (0: any free one) with the bridge.
func (s *Stack) claim(k netKind, proto string, claimAddr netip.Addr, port uint16) (control.Claim, *lease, error) {
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	cl, err := s.claims.Listen(ctx, proto, claimAddr, port)
	if err != nil {
		addr := net.Addr(tcpAddr(claimAddr, port))
		if proto == "udp" {
			addr = udpAddr(claimAddr, port)
		}
		return cl, nil, opError("listen", k, addr, err)
	}
	return cl, s.newLease(cl.ID), nil
}

// tcpListener is a listening endpoint; it and each connection it accepted
// hold the bridge's claim on the port.
type tcpListener struct {
	ep    tcpip.Endpoint
	wq    *waiter.Queue
	lease *lease
	addr  *net.TCPAddr
	once  sync.Once
	done  chan struct{}
}

// Accept implements net.Listener.
func (l *tcpListener) Accept() (net.Conn, error) {
	entry, ready := waiter.NewChannelEntry(waiter.ReadableEvents)
	l.wq.EventRegister(&entry)
	defer l.wq.EventUnregister(&entry)
	for {
		select {
		case <-l.done:
			return nil, opError("accept", netKind{proto: "tcp"}, l.addr, net.ErrClosed)
		default:
		}
		n, wq, err := l.ep.Accept(nil)
		if _, wait := err.(*tcpip.ErrWouldBlock); wait {
			select {
			case <-ready:
			case <-l.done:
			}
			continue
		}
		if err != nil {
			return nil, opError("accept", netKind{proto: "tcp"}, l.addr, tcpipErr{err})
		}
		l.lease.hold()
		if hopTrace.Load() != nil {
			e := waiter.NewFunctionEntry(waiter.ReadableEvents, func(waiter.EventMask) { traceHop(hopReadable) })
			wq.EventRegister(&e)
		}
		return newTCPConn(wq, n, l.lease), nil
	}
}

// Close implements net.Listener. Accepted connections go on.
func (l *tcpListener) Close() error {
	l.once.Do(func() {
		close(l.done)
		l.ep.Close()
		l.lease.drop()
	})
	return nil
}

// Addr implements net.Listener.
func (l *tcpListener) Addr() net.Addr { return l.addr }

// lingerThenDrop keeps the claim while the closing handshake runs, so the
// peer's FIN and ACK still reach the stack instead of the kernel (which
// would answer them with a reset).
//
// TIME-WAIT keeps the claim a little longer (timeWaitHold): after a
// simultaneous close the peer may still be waiting for the ACK of its FIN
// and retransmit it, and only this stack can answer that.
//
// One goroutine per stack watches every closing connection, and exists
// only while some are: a goroutine per connection, each polling its own,
// cost a server of short connections a dozen wake-ups per connection.
func (s *Stack) lingerThenDrop(ep tcpip.Endpoint, l *lease) {
	s.linger.mu.Lock()
	defer s.linger.mu.Unlock()
	s.linger.arrived = append(s.linger.arrived, lingering{ep: ep, l: l, since: time.Now()})
	if !s.linger.running {
		s.linger.running = true
		go s.lingerLoop()
	}
}

// lingerTick is how often lingerLoop looks at the closing connections: a
// claim goes back at most this late.
const lingerTick = 5 * time.Millisecond

// lingerer holds the closing connections' claims.
type lingerer struct {
	mu      sync.Mutex
	arrived []lingering // closed since lingerLoop last looked
	running bool        // a lingerLoop runs

	// lingerLoop's own: the connections still closing, looked at every
	// tick, and those in TIME-WAIT, in the order they entered it, which
	// is the order their holds end in: only the first is looked at.
	closing  []lingering
	timeWait []lingering
}

// lingering is one closed connection whose claim is held.
type lingering struct {
	ep    tcpip.Endpoint
	l     *lease
	since time.Time // when it was closed, or seen in TIME-WAIT
}

// lingerLoop drops each watched connection's hold on its claim once the
// connection has finished closing, lingerMax after its Close, or
// timeWaitHold after it was seen in TIME-WAIT. It ends when none is left,
// and drops them all when the stack closes.
func (s *Stack) lingerLoop() {
	lg := &s.linger
	for {
		time.Sleep(lingerTick)
		lg.mu.Lock()
		lg.closing = append(lg.closing, lg.arrived...)
		clear(lg.arrived)
		lg.arrived = lg.arrived[:0]
		lg.mu.Unlock()

		now := time.Now()
		closed := s.closed.Load()
		// A claim must not go back while the link still holds a delayed
		// ACK of its connection (delack.go): the bridge would refuse it.
		// Holds last a millisecond; this sends them now, before any drop.
		flushed := false
		flush := func() {
			if !flushed {
				flushed = true
				for _, ep := range s.linkEndpoints() {
					ep.sendHeldAcks()
				}
			}
		}
		keep := lg.closing[:0]
		for _, c := range lg.closing {
			switch tcp.EndpointState(c.ep.State()) {
			case tcp.StateClose, tcp.StateError, tcp.StateInitial, tcp.StateBound:
				flush()
				c.drop()
			case tcp.StateTimeWait:
				c.since = now
				lg.timeWait = append(lg.timeWait, c)
			default:
				if closed || now.Sub(c.since) >= lingerMax {
					flush()
					c.drop()
				} else {
					keep = append(keep, c)
				}
			}
		}
		clear(lg.closing[len(keep):])
		lg.closing = keep
		done := 0
		for _, c := range lg.timeWait {
			if !closed && now.Sub(c.since) < timeWaitHold {
				break
			}
			flush()
			c.drop()
			done++
		}
		clear(lg.timeWait[:done])
		lg.timeWait = lg.timeWait[done:]

		lg.mu.Lock()
		if len(lg.arrived)+len(lg.closing)+len(lg.timeWait) == 0 {
			lg.running = false
			lg.timeWait = nil // its array's front is spent
			lg.mu.Unlock()
			return
		}
		lg.mu.Unlock()
	}
}

// drop lets go of c's hold on its claim.
func (c *lingering) drop() {
	if c.l.refs.Load() == 1 {
		go c.l.drop() // the last hold: it asks the bridge, which may be slow
		return
	}
	c.l.drop()
}

// Dial connects to address ("ip:port"; names are not resolved) over "tcp",
// "tcp4", "tcp6", "udp", "udp4" or "udp6". The bridge gives the source port
// and steers the conversation's packets here before the first one leaves.
func (s *Stack) Dial(ctx context.Context, network, address string) (net.Conn, error) {
	k, err := parseNetwork(network)
	if err != nil {
		return nil, opError("dial", netKind{proto: network}, nil, err)
	}
	a, port, err := parseAddr(address)
	if err != nil {
		return nil, opError("dial", k, nil, err)
	}
	raddr := netip.AddrPortFrom(a, port)
	var na net.Addr = net.TCPAddrFromAddrPort(raddr)
	if k.proto == "udp" {
		na = net.UDPAddrFromAddrPort(raddr)
	}
	switch {
	case !a.IsValid() || a.IsUnspecified() || port == 0:
		return nil, opError("dial", k, na, errors.New("need a remote address and port"))
	case (k.family == 4 && !a.Is4()) || (k.family == 6 && a.Is4()):
		return nil, opError("dial", k, na, errors.New("address of the wrong family"))
	}
	if err := s.checkOpen(); err != nil {
		return nil, opError("dial", k, na, err)
	}
	for attempt := 0; ; attempt++ {
		cl, err := s.claims.Connect(ctx, k.proto, netip.Addr{}, raddr)
		if err != nil {
			return nil, opError("dial", k, na, err)
		}
		flow := flowKey{proto: uint8(tcp.ProtocolNumber), localPort: cl.Port, remote: netip.AddrPortFrom(raddr.Addr().Unmap(), raddr.Port())}
		if k.proto == "udp" {
			flow.proto = uint8(udp.ProtocolNumber)
		}
		s.takeUnreach(flow) // a note left from an earlier use of the tuple
		l := s.newLease(cl.ID)
		c, terr := s.connect(ctx, k, cl, raddr, l)
		if terr == nil {
			return c, nil
		}
		l.drop()
		var te tcpipErr
		if errors.As(terr, &te) && attempt < bindRetries {
			if _, inUse := te.e.(*tcpip.ErrPortInUse); inUse {
				continue
			}
		}
		if errors.Is(terr, context.Canceled) || errors.Is(terr, context.DeadlineExceeded) {
			return nil, opError("dial", k, na, ctx.Err())
		}
		if errors.As(terr, &te) {
			terr = sysErr("connect", te.e)
			if k.proto == "tcp" {
				// An ICMPv6 error gVisor would have ignored, rewritten to
				// no route (unreach6.go): Linux's errno instead.
				terr = s.withNoted(terr, syscall.ENETUNREACH, flow)
			}
		}
		return nil, opError("dial", k, na, terr)
	}
}

// connect binds an endpoint to the claimed source and connects it. Errors
// are tcpipErr, or the context's.
func (s *Stack) connect(ctx context.Context, k netKind, cl control.Claim, raddr netip.AddrPort, l *lease) (net.Conn, error) {
	var wq waiter.Queue
	proto := tcp.ProtocolNumber
	if k.proto == "udp" {
		proto = udp.ProtocolNumber
	}
	ep, terr := s.ns.NewEndpoint(proto, protoOf(raddr.Addr()), &wq)
	if terr != nil {
		return nil, tcpipErr{terr}
	}
	entry, ready := waiter.NewChannelEntry(waiter.WritableEvents)
	wq.EventRegister(&entry)
	defer wq.EventUnregister(&entry)
	// The control plane may give a port this application's other
	// connections hold, towards other remotes (the whole tuple tells them
	// apart), as Linux shares a port between SO_REUSEADDR sockets.
	ep.SocketOptions().SetReuseAddress(true)
	if terr := ep.Bind(fullAddr(cl.Addr, cl.Port)); terr != nil {
		ep.Close()
		return nil, tcpipErr{terr}
	}
	terr = ep.Connect(fullAddr(raddr.Addr(), raddr.Port()))
	if _, started := terr.(*tcpip.ErrConnectStarted); started {
		select {
		case <-ready:
			terr = ep.LastError()
		case <-ctx.Done():
			ep.Close()
			return nil, ctx.Err()
		}
	}
	if terr != nil {
		ep.Close()
		return nil, tcpipErr{terr}
	}
	if k.proto == "udp" {
		return s.newUDPConn(&wq, ep, l), nil
	}
	return newTCPConn(&wq, ep, l), nil
}

// ListenPacket announces a UDP endpoint: "udp", "udp4" or "udp6", and
// "host:port" as for Listen (port 0: a free port from the bridge).
func (s *Stack) ListenPacket(network, address string) (net.PacketConn, error) {
	k, claimAddr, np, cl, l, err := s.announce(network, address, "udp")
	if err != nil {
		return nil, err
	}
	var wq waiter.Queue
	ep, terr := s.ns.NewEndpoint(udp.ProtocolNumber, np, &wq)
	if terr == nil {
		if terr = ep.Bind(fullAddr(claimAddr, cl.Port)); terr != nil {
			ep.Close()
		}
	}
	if terr != nil {
		l.drop()
		return nil, opError("listen", k, udpAddr(claimAddr, cl.Port), tcpipErr{terr})
	}
	return s.newUDPConn(&wq, ep, l), nil
}

// udpConn is a UDP endpoint (connected or not); closing it gives its
// claim back at once.
type udpConn struct {
	*gonet.UDPConn
	s     *Stack
	wq    *waiter.Queue
	lease *lease
	once  sync.Once
}

func (s *Stack) newUDPConn(wq *waiter.Queue, ep tcpip.Endpoint, l *lease) *udpConn {
	// gVisor's default (want path MTU discovery) sets DF and leaves the
	// IPv4 identification 0, even on the fragments of a datagram over the
	// MTU, so that two such datagrams to one peer can reassemble into
	// one. Without DF every datagram gets its own identification, and one
	// over the MTU leaves in fragments, as from a kernel socket.
	ep.SetSockOptInt(tcpip.MTUDiscoverOption, int(tcpip.PMTUDiscoveryDont))
	s.addDatagramQueue(wq)
	return &udpConn{UDPConn: gonet.NewUDPConn(wq, ep), s: s, wq: wq, lease: l}
}

// Read implements net.Conn; errors the peer or the network caused (an
// ICMP port unreachable: ECONNREFUSED) are the kernel's errnos.
func (c *udpConn) Read(b []byte) (int, error) {
	n, err := c.UDPConn.Read(b)
	return n, c.err(err)
}

// ReadFrom implements net.PacketConn, with errors as for Read.
func (c *udpConn) ReadFrom(b []byte) (int, net.Addr, error) {
	n, from, err := c.UDPConn.ReadFrom(b)
	return n, from, c.err(err)
}

// Write implements net.Conn, with errors as for Read.
func (c *udpConn) Write(b []byte) (int, error) {
	n, err := c.UDPConn.Write(b)
	return n, c.err(err)
}

// WriteTo implements net.PacketConn, with errors as for Read.
func (c *udpConn) WriteTo(b []byte, to net.Addr) (int, error) {
	n, err := c.UDPConn.WriteTo(b, to)
	return n, c.err(err)
}

// err is connErr, and for a connected socket's connection refused the
// errno of the ICMPv6 error that gVisor was handed as a port unreachable
// (unreach6.go), if that is what happened.
func (c *udpConn) err(err error) error {
	err = connErr(err)
	if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
		return err
	}
	local, lok := c.UDPConn.LocalAddr().(*net.UDPAddr)
	remote, rok := c.UDPConn.RemoteAddr().(*net.UDPAddr)
	if !lok || !rok || local == nil || remote == nil {
		return err
	}
	l, r := local.AddrPort(), remote.AddrPort()
	k := flowKey{proto: uint8(udp.ProtocolNumber), localPort: l.Port(), remote: netip.AddrPortFrom(r.Addr().Unmap(), r.Port())}
	return c.s.withNoted(err, syscall.ECONNREFUSED, k)
}

// Close implements net.Conn and net.PacketConn.
func (c *udpConn) Close() error {
	err := c.UDPConn.Close()
	c.once.Do(func() {
		c.s.removeDatagramQueue(c.wq)
		c.lease.drop()
	})
	return err
}
