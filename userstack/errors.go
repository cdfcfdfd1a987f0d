package userstack

import (
	"errors"
	"net"
	"os"
	"syscall"

	"gvisor.dev/gvisor/pkg/tcpip"
)

// errnoOf maps the gVisor errors that a peer or the network causes (a
// reset, an ICMP error, a timeout) to the errno a kernel socket reports for
// the same event, keyed by the error's text: gonet (under UDP sockets)
// hands its errors on as errors.New(err.String()), so the text is all that
// is left of the type by the time a Read or Write returns. The keys come
// from gVisor's own String methods, so they follow the pinned version.
// Local errors (a bad address, a port in use) are not here: they have no
// kernel twin worth pretending.
var errnoOf = func() map[string]syscall.Errno {
	m := make(map[string]syscall.Errno)
	for _, p := range []struct {
		e     tcpip.Error
		errno syscall.Errno
	}{
		{&tcpip.ErrConnectionRefused{}, syscall.ECONNREFUSED}, // port unreachable, or a RST to a SYN
		{&tcpip.ErrConnectionReset{}, syscall.ECONNRESET},
		{&tcpip.ErrConnectionAborted{}, syscall.ECONNABORTED},
		{&tcpip.ErrHostUnreachable{}, syscall.EHOSTUNREACH}, // host unreachable or prohibited
		{&tcpip.ErrNetworkUnreachable{}, syscall.ENETUNREACH},
		{&tcpip.ErrHostDown{}, syscall.EHOSTDOWN},
		{&tcpip.ErrNoNet{}, syscall.ENONET},
		{&tcpip.ErrTimeout{}, syscall.ETIMEDOUT},
		{&tcpip.ErrMessageTooLong{}, syscall.EMSGSIZE},
	} {
		m[p.e.String()] = p.errno
	}
	return m
}()

// sysErr is e as the net package would report it for the system call
// call ("connect", "read", "write"), when it is one of errnoOf's: then
// errors.Is(err, syscall.ECONNREFUSED) and friends hold, as they do for
// kernel sockets. Other errors stay gVisor's (tcpipErr).
func sysErr(call string, e tcpip.Error) error {
	if errno, ok := errnoOf[e.String()]; ok {
		return os.NewSyscallError(call, errno)
	}
	return tcpipErr{e}
}

// connErr rewrites an error from gonet's Read or Write (UDP) in the same
// way: gonet returns a *net.OpError whose Err is gVisor's text only.
func connErr(err error) error {
	oe, ok := err.(*net.OpError)
	if !ok || oe.Err == nil {
		return err
	}
	errno, ok := errnoOf[oe.Err.Error()]
	if !ok {
		return err
	}
	out := *oe
	out.Err = os.NewSyscallError(oe.Op, errno)
	return &out
}

// withNoted gives err (from sysErr or connErr) the errno noted for flow k
// when err carries standIn, the errno gVisor reported for an ICMPv6 error
// that the receive loop rewrote (unreach6.go). The note is taken, as a
// kernel socket's pending error is.
func (s *Stack) withNoted(err error, standIn syscall.Errno, k flowKey) error {
	if err == nil || !errors.Is(err, standIn) {
		return err
	}
	errno, ok := s.takeUnreach(k)
	if !ok {
		return err
	}
	return replaceErrno(err, errno)
}

// replaceErrno rebuilds err, a *net.OpError or *os.SyscallError around an
// errno, around errno instead.
func replaceErrno(err error, errno syscall.Errno) error {
	switch e := err.(type) {
	case *net.OpError:
		out := *e
		out.Err = replaceErrno(e.Err, errno)
		return &out
	case *os.SyscallError:
		return os.NewSyscallError(e.Syscall, errno)
	case syscall.Errno:
		return errno
	}
	return err
}
