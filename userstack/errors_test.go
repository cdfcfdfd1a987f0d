package userstack

import (
	"errors"
	"net"
	"syscall"
	"testing"

	"gvisor.dev/gvisor/pkg/tcpip"
)

// TestErrorsAreKernelErrnos checks the translation of gVisor's errors, as
// gonet passes them on (text only), into the errnos kernel sockets report.
func TestErrorsAreKernelErrnos(t *testing.T) {
	for _, c := range []struct {
		e    tcpip.Error
		want syscall.Errno
	}{
		{&tcpip.ErrConnectionRefused{}, syscall.ECONNREFUSED},
		{&tcpip.ErrConnectionReset{}, syscall.ECONNRESET},
		{&tcpip.ErrHostUnreachable{}, syscall.EHOSTUNREACH},
		{&tcpip.ErrNetworkUnreachable{}, syscall.ENETUNREACH},
		{&tcpip.ErrTimeout{}, syscall.ETIMEDOUT},
	} {
		gonetErr := &net.OpError{Op: "read", Net: "udp", Err: errors.New(c.e.String())}
		got := connErr(gonetErr)
		if !errors.Is(got, c.want) {
			t.Errorf("read error %q became %v, want %v", c.e, got, c.want)
		}
		if oe, ok := got.(*net.OpError); !ok || oe.Op != "read" || oe.Net != "udp" {
			t.Errorf("%v lost its net.OpError", got)
		}
		if err := sysErr("connect", c.e); !errors.Is(err, c.want) || err.Error() != "connect: "+c.want.Error() {
			t.Errorf("dial error %q became %v, want connect: %v", c.e, err, c.want)
		}
	}
	// Anything else passes unchanged.
	other := &net.OpError{Op: "read", Err: errors.New((&tcpip.ErrBadBuffer{}).String())}
	if got := connErr(other); got != other {
		t.Errorf("%v rewritten to %v", other, got)
	}
	if connErr(nil) != nil {
		t.Error("nil became an error")
	}
	if _, ok := sysErr("connect", &tcpip.ErrPortInUse{}).(tcpipErr); !ok {
		t.Error("a local error lost its gVisor type (Dial retries on ErrPortInUse)")
	}
}
