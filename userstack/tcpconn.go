package userstack

import (
	"bytes"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/waiter"
)

// tcpConn is a connection whose tuple the bridge steers here; the claim
// goes back once the connection has finished closing.
//
// It is a net.Conn over the endpoint that allocates nothing per Read,
// Write or deadline change once it has waited and timed out in each
// direction: net/http sets and clears deadlines on every request and
// aborts a background Read with a deadline in the past, so a per-call
// timer, channel or error multiplies into the server's garbage.
type tcpConn struct {
	ep    tcpip.Endpoint
	wq    *waiter.Queue
	lease *lease
	// The endpoint's addresses do not change once it is connected.
	local, remote net.Addr

	rd, wr direction

	// readMu serialises Reads; readDst is their destination while ep.Read
	// fills it, kept here so that handing it to ep.Read costs nothing.
	readMu  sync.Mutex
	readDst tcpip.SliceWriter
	// writeMu serialises Writes, as the kernel socket's write lock does:
	// one Write's bytes are not interleaved with another's.
	writeMu  sync.Mutex
	writeSrc bytes.Reader

	once sync.Once
}

// newTCPConn wraps a connected endpoint.
func newTCPConn(wq *waiter.Queue, ep tcpip.Endpoint, l *lease) *tcpConn {
	c := &tcpConn{ep: ep, wq: wq, lease: l, local: endpointAddr(ep.GetLocalAddress()), remote: endpointAddr(ep.GetRemoteAddress())}
	// A hang-up or an error wakes either side too: the retried call then
	// reports it.
	c.rd.init(c, "read", waiter.ReadableEvents|waiter.EventHUp|waiter.EventErr)
	c.wr.init(c, "write", waiter.WritableEvents|waiter.EventHUp|waiter.EventErr)
	return c
}

// endpointAddr is a as net.Conn reports it: nil (untyped) if the endpoint
// has none.
func endpointAddr(a tcpip.FullAddress, err tcpip.Error) net.Addr {
	if err != nil {
		return nil
	}
	return &net.TCPAddr{IP: net.IP(a.Addr.AsSlice()), Port: int(a.Port)}
}

// clockBase anchors deadlines as monotonic durations, which fit an atomic
// int64 where a time.Time does not.
var clockBase = time.Now()

// direction is one half of a conn's waiting: its deadline, the channel
// that wakes its blocked call, and the timer that enforces the deadline.
type direction struct {
	conn *tcpConn
	op   string

	// deadline is when calls start failing, as time since clockBase;
	// 0: never. Only the waiting call compares it with the clock, so a
	// timer that fires for a deadline since moved just wakes it in vain.
	deadline atomic.Int64
	// wake is signalled by the endpoint (through entry, registered while
	// a call waits), by the timer and by a deadline set in the past.
	wake  chan struct{}
	entry waiter.Entry

	timerMu sync.Mutex
	timer   *time.Timer // made by the first future deadline, then reused

	// timeout is the error of every expiry, made by the first one: a
	// timeout that is os.ErrDeadlineExceeded, as from a kernel socket.
	// The call's mutex (readMu or writeMu) guards it.
	timeout *net.OpError
}

func (d *direction) init(c *tcpConn, op string, events waiter.EventMask) {
	d.conn, d.op = c, op
	d.wake = make(chan struct{}, 1)
	d.entry.Init(waiter.ChannelNotifier(d.wake), events)
}

// notify wakes the call waiting in this direction, if any; a wake-up
// nobody takes stays until the next wait drops it.
func (d *direction) notify() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

func (d *direction) setDeadline(t time.Time) {
	d.timerMu.Lock()
	defer d.timerMu.Unlock()
	if t.IsZero() {
		d.deadline.Store(0)
		if d.timer != nil {
			d.timer.Stop()
		}
		return
	}
	left := time.Until(t)
	now := time.Since(clockBase)
	// Saturate: a deadline centuries away (time.Until's cap) must not
	// wrap around into the past.
	d.deadline.Store(max(int64(now)+min(int64(left), math.MaxInt64-int64(now)), 1))
	if left <= 0 {
		if d.timer != nil {
			d.timer.Stop()
		}
		d.notify() // interrupt a call blocked now (net/http's background Read)
		return
	}
	if d.timer == nil {
		d.timer = time.AfterFunc(left, d.notify)
	} else {
		d.timer.Reset(left)
	}
}

// stop stops the deadline's timer, which would only keep the conn alive,
// and wakes the blocked call, which finds the endpoint closed.
func (d *direction) stop() {
	d.timerMu.Lock()
	if d.timer != nil {
		d.timer.Stop()
	}
	d.timerMu.Unlock()
	d.notify()
}

func (d *direction) expired() bool {
	dl := d.deadline.Load()
	return dl != 0 && int64(time.Since(clockBase)) >= dl
}

// retry runs attempt until it stops reporting ErrWouldBlock, waiting for
// the direction's events in between, or until the deadline passes.
func (d *direction) retry(attempt func() tcpip.Error) (terr tcpip.Error, timedOut bool) {
	registered := false
	defer func() {
		if registered {
			d.conn.wq.EventUnregister(&d.entry)
		}
	}()
	for {
		if d.expired() {
			return nil, true
		}
		terr = attempt()
		if _, block := terr.(*tcpip.ErrWouldBlock); !block {
			return terr, false
		}
		if !registered {
			// Try again once registered, so that no event falls between
			// the attempt and the wait. A stale wake-up (a timer or
			// deadline of before) goes now: the loop checks both afresh.
			d.conn.wq.EventRegister(&d.entry)
			registered = true
			select {
			case <-d.wake:
			default:
			}
			continue
		}
		<-d.wake
	}
}

// err is the error of a call in this direction that ended with terr or
// timed out.
func (d *direction) err(terr tcpip.Error, timedOut bool) error {
	switch {
	case timedOut:
		if d.timeout == nil {
			d.timeout = d.conn.opErr(d.op, os.ErrDeadlineExceeded)
		}
		return d.timeout
	case terr != nil:
		return d.conn.opErr(d.op, sysErr(d.op, terr))
	}
	return nil
}

func (c *tcpConn) opErr(op string, err error) *net.OpError {
	return &net.OpError{Op: op, Net: "tcp", Source: c.local, Addr: c.remote, Err: err}
}

// Read implements net.Conn; errors the peer or the network caused are
// the kernel's errnos (see sysErr), and the peer's FIN is io.EOF.
func (c *tcpConn) Read(b []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	var n int
	terr, timedOut := c.rd.retry(func() tcpip.Error {
		c.readDst = b
		res, terr := c.ep.Read(&c.readDst, tcpip.ReadOptions{})
		c.readDst = nil
		n = res.Count
		return terr
	})
	if _, eof := terr.(*tcpip.ErrClosedForReceive); eof {
		return 0, io.EOF
	}
	if n != 0 {
		c.ep.ModerateRecvBuf(n)
	}
	return n, c.rd.err(terr, timedOut)
}

// Write implements net.Conn, with errors as for Read. It returns once all
// of b is in the send buffer, or with how much is.
func (c *tcpConn) Write(b []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	var n int
	terr, timedOut := c.wr.retry(func() tcpip.Error {
		for n < len(b) {
			c.writeSrc.Reset(b[n:])
			m, terr := c.ep.Write(&c.writeSrc, tcpip.WriteOptions{})
			n += int(m)
			if terr != nil {
				return terr
			}
		}
		return nil
	})
	c.writeSrc.Reset(nil)
	return n, c.wr.err(terr, timedOut)
}

// CloseRead shuts the receiving half down, as (*net.TCPConn).CloseRead.
func (c *tcpConn) CloseRead() error {
	if terr := c.ep.Shutdown(tcpip.ShutdownRead); terr != nil {
		return c.opErr("close", tcpipErr{terr})
	}
	return nil
}

// CloseWrite sends a FIN after what was written, as
// (*net.TCPConn).CloseWrite.
func (c *tcpConn) CloseWrite() error {
	if terr := c.ep.Shutdown(tcpip.ShutdownWrite); terr != nil {
		return c.opErr("close", tcpipErr{terr})
	}
	return nil
}

// Close implements net.Conn.
func (c *tcpConn) Close() error {
	c.ep.Close()
	c.once.Do(func() {
		c.rd.stop()
		c.wr.stop()
		c.lease.s.lingerThenDrop(c.ep, c.lease)
	})
	return nil
}

// LocalAddr implements net.Conn.
func (c *tcpConn) LocalAddr() net.Addr { return c.local }

// RemoteAddr implements net.Conn.
func (c *tcpConn) RemoteAddr() net.Addr { return c.remote }

// SetDeadline implements net.Conn.
func (c *tcpConn) SetDeadline(t time.Time) error {
	c.rd.setDeadline(t)
	c.wr.setDeadline(t)
	return nil
}

// SetReadDeadline implements net.Conn.
func (c *tcpConn) SetReadDeadline(t time.Time) error {
	c.rd.setDeadline(t)
	return nil
}

// SetWriteDeadline implements net.Conn.
func (c *tcpConn) SetWriteDeadline(t time.Time) error {
	c.wr.setDeadline(t)
	return nil
}
