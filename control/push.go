package control

import (
	"fmt"
	"sync/atomic"
)

// This file carries what the bridge tells registered applications without
// being asked: a message with id 0, which no request has, and which a
// client that does not know it ignores. So far one field: MTU, the wire's
// new MTU, after the served interface's changed.

// SetMTU tells every registered application the wire's MTU is now mtu,
// and gives it to those that register later. The kernel's own sockets
// follow an interface's MTU; the applications' stacks learn it from this.
func (s *Server) SetMTU(mtu int) error {
	if mtu < 1280 || mtu > 65535 {
		return fmt.Errorf("control: MTU %d outside 1280..65535", mtu)
	}
	if int(s.mtu.Swap(int32(mtu))) == mtu {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for ss := range s.sessions {
		// A client that does not read must not hold the others up.
		go ss.pushMTU(mtu)
	}
	return nil
}

// MTU is the wire's MTU as the server last heard it.
func (s *Server) MTU() int { return int(s.mtu.Load()) }

// pushMTU sends mtu to the session's application if it has registered; one
// that registers later reads the server's current MTU in its reply.
func (ss *session) pushMTU(mtu int) {
	if !ss.pushable.Load() {
		return
	}
	ss.send(Reply{MTU: mtu}, nil)
}

// OnMTU has f called with the wire's MTU each time the bridge says it
// changed, on the client's reading goroutine; at once too if it said so
// already, so that a change between the registration's reply and OnMTU is
// not lost. f may be called twice with one value.
func (c *Client) OnMTU(f func(mtu int)) {
	c.onMTU.f.Store(&f)
	if mtu := c.onMTU.last.Load(); mtu > 0 {
		f(int(mtu))
	}
}

// pushed handles a message with id 0, which answers no request: what the
// bridge pushes.
func (c *Client) pushed(rep Reply) {
	if rep.MTU <= 0 {
		return
	}
	c.onMTU.last.Store(int32(rep.MTU))
	if f := c.onMTU.f.Load(); f != nil {
		(*f)(rep.MTU)
	}
}

// mtuHook is the client's MTU callback and the last MTU pushed.
type mtuHook struct {
	f    atomic.Pointer[func(int)]
	last atomic.Int32
}
