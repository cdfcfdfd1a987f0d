package fabric

import (
	"fmt"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ListenRemote opens a UDP socket bound to addr and starts its receive
// loop. The socket belongs to the network namespace of the calling thread.
func ListenRemote(addr netip.AddrPort, cfg RemoteConfig) (*Remote, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Remote{cfg: cfg, done: make(chan struct{}), v6: !addr.Addr().Unmap().Is4()}
	fam := unix.AF_INET
	if r.v6 {
		fam = unix.AF_INET6
	}
	r.fd, err = unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return nil, fmt.Errorf("fabric: udp socket: %w", err)
	}
	fail := func(err error) (*Remote, error) {
		unix.Close(r.fd)
		return nil, err
	}
	unix.SetsockoptInt(r.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	unix.SetsockoptInt(r.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4<<20)
	// Without IP_RECVERR an unconnected UDP socket never hears of ICMP
	// errors; with it they queue on the error queue, with the original
	// destination, which names the peer that has gone.
	if r.v6 {
		err = unix.SetsockoptInt(r.fd, unix.SOL_IPV6, unix.IPV6_RECVERR, 1)
	} else {
		err = unix.SetsockoptInt(r.fd, unix.SOL_IP, unix.IP_RECVERR, 1)
	}
	if err != nil {
		return fail(fmt.Errorf("fabric: IP_RECVERR: %w", err))
	}
	if !cfg.NoGSO {
		_, err := unix.GetsockoptInt(r.fd, unix.SOL_UDP, unix.UDP_SEGMENT)
		r.gso = err == nil
	}
	if !cfg.NoGRO {
		r.gro = unix.SetsockoptInt(r.fd, unix.SOL_UDP, unix.UDP_GRO, 1) == nil
	}
	if err := unix.Bind(r.fd, sockaddrOf(addr)); err != nil {
		return fail(fmt.Errorf("fabric: bind %v: %w", addr, err))
	}
	sa, err := unix.Getsockname(r.fd)
	if err != nil {
		return fail(err)
	}
	r.local = addrPortOf(sa)
	m := map[uint32]*RemoteStream{}
	r.streams.Store(&m)
	bufLen := cfg.SlotSize + geneveHdrLen + 64
	if r.gro {
		bufLen = 1 << 16 // a coalesced run is one datagram of up to 64 KiB
	}
	for i := range r.bufs {
		r.bufs[i] = make([]byte, bufLen)
		r.iovs[i].Base = &r.bufs[i][0]
		r.iovs[i].SetLen(len(r.bufs[i]))
		r.msgs[i].Hdr.Iov = &r.iovs[i]
		r.msgs[i].Hdr.SetIovlen(1)
		r.msgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&r.names[i]))
	}
	go r.loop()
	return r, nil
}

func sockaddrOf(a netip.AddrPort) unix.Sockaddr {
	if a.Addr().Unmap().Is4() {
		return &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().Unmap().As4()}
	}
	return &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
}

func addrPortOf(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// rawName is a peer address in kernel form, built once at registration
// so that sending needs no conversion and no allocation.
type rawName struct {
	sa  unix.RawSockaddrInet6 // large enough for either family
	len uint32
}

func makeRawName(a netip.AddrPort, v6 bool) rawName {
	var n rawName
	p := a.Port()
	if !v6 {
		s4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(&n.sa))
		s4.Family = unix.AF_INET
		s4.Addr = a.Addr().Unmap().As4()
		pb := (*[2]byte)(unsafe.Pointer(&s4.Port))
		pb[0], pb[1] = byte(p>>8), byte(p)
		n.len = unix.SizeofSockaddrInet4
		return n
	}
	n.sa.Family = unix.AF_INET6
	n.sa.Addr = a.Addr().As16()
	pb := (*[2]byte)(unsafe.Pointer(&n.sa.Port))
	pb[0], pb[1] = byte(p>>8), byte(p)
	n.len = unix.SizeofSockaddrInet6
	return n
}

// same compares a received source address with the registered one.
func (n *rawName) same(got *unix.RawSockaddrInet6, gotLen uint32) bool {
	if n.sa.Family != got.Family {
		return false
	}
	if n.sa.Family == unix.AF_INET {
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(&n.sa))
		b := (*unix.RawSockaddrInet4)(unsafe.Pointer(got))
		return a.Port == b.Port && a.Addr == b.Addr
	}
	return gotLen >= unix.SizeofSockaddrInet6 && n.sa.Port == got.Port && n.sa.Addr == got.Addr
}
