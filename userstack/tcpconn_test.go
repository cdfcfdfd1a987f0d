package userstack

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// quietPair is two stacks joined by a wire that allocates nothing, so
// that testing.AllocsPerRun sees only what the stacks and their
// connections allocate (wiredPair's wire parses every packet).
func quietPair(t *testing.T) (a, b *Stack) {
	t.Helper()
	mk := func(addrs []netip.Addr) (*Stack, *fabric.BridgeStream) {
		br, app, err := fabric.NewPair(fabric.Config{RxSlots: 1024, TxSlots: 1024})
		if err != nil {
			t.Fatal(err)
		}
		s, err := newStack(app, LinkConfig{MTU: 1500, MaxPacket: app.MaxPayload()}, addrs, &grantAll{}, app.Close)
		if err != nil {
			t.Fatal(err)
		}
		return s, br
	}
	a, brA := mk(addrA)
	b, brB := mk(addrB)
	var wg sync.WaitGroup
	forward := func(from, to *fabric.BridgeStream) {
		defer wg.Done()
		bufs := make([][]byte, 64)
		for i := range bufs {
			bufs[i] = make([]byte, 2048)
		}
		for {
			for i := range bufs {
				bufs[i] = bufs[i][:cap(bufs[i])]
			}
			n, err := from.Recv(bufs)
			to.Send(bufs[:n])
			if err != nil {
				return
			}
		}
	}
	wg.Add(2)
	go forward(brA, brB)
	go forward(brB, brA)
	t.Cleanup(func() {
		a.Close()
		b.Close()
		brA.Close()
		brB.Close()
		wg.Wait()
	})
	return a, b
}

// connBetween is a connection from a to b: the client dialled from a and
// the server b accepted.
func connBetween(t *testing.T, a, b *Stack) (client, server net.Conn) {
	t.Helper()
	l, err := b.Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	client, err = a.Dial(testCtx(t, 10*time.Second), "tcp", "198.18.0.2:80")
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() {
		client.Close()
		server.Close()
	})
	return client, server
}

// backgroundReader reads one byte from c whenever start is signalled and
// hands back the error, as net/http's server does between a request and
// the next from a long-lived goroutine, so that starting it allocates
// nothing.
type backgroundReader struct {
	start chan struct{}
	done  chan error
}

func newBackgroundReader(t *testing.T, c net.Conn) *backgroundReader {
	r := &backgroundReader{start: make(chan struct{}), done: make(chan error)}
	go func() {
		var one [1]byte
		for range r.start {
			_, err := c.Read(one[:])
			r.done <- err
		}
	}()
	t.Cleanup(func() { close(r.start) })
	return r
}

// isDeadline reports whether err is a deadline's, as a kernel socket
// reports it (without errors.As, which would allocate).
func isDeadline(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout() && errors.Is(err, os.ErrDeadlineExceeded)
}

// TestTCPConnAllocs checks that the server's side of a steady stream of
// requests and responses allocates nothing, with the deadlines net/http
// sets and clears around each request and the background Read it aborts
// by a deadline in the past. gonet's conn allocated about a dozen objects
// per round here (a timer and a channel per deadline, a waiter channel
// per wait, a fresh error with two fresh addresses per timeout).
func TestTCPConnAllocs(t *testing.T) {
	a, b := quietPair(t)
	client, server := connBetween(t, a, b)
	req, resp := make([]byte, 100), make([]byte, 300)
	sbuf, cbuf := make([]byte, 1000), make([]byte, 1000)
	bg := newBackgroundReader(t, server)
	var failure error
	fail := func(err error) {
		if failure == nil {
			failure = err
		}
	}
	round := func() {
		server.SetReadDeadline(time.Now().Add(time.Minute))
		bg.start <- struct{}{} // the request's Read, blocked until it comes
		if _, err := client.Write(req); err != nil {
			fail(err)
		}
		if err := <-bg.done; err != nil {
			fail(err)
		}
		if n, err := server.Read(sbuf[:len(req)-1]); n != len(req)-1 || err != nil {
			fail(fmt.Errorf("server read %d bytes, %v", n, err))
		}
		server.SetReadDeadline(time.Time{})
		server.SetWriteDeadline(time.Now().Add(time.Minute))
		if _, err := server.Write(resp); err != nil {
			fail(err)
		}
		server.SetWriteDeadline(time.Time{})
		for n := 0; n < len(resp); {
			m, err := client.Read(cbuf)
			if err != nil {
				fail(err)
				return
			}
			n += m
		}
		// Between requests: a background Read, aborted.
		bg.start <- struct{}{}
		server.SetReadDeadline(time.Unix(1, 0))
		if err := <-bg.done; !isDeadline(err) {
			fail(fmt.Errorf("background read: %v", err))
		}
		server.SetReadDeadline(time.Time{})
		_, _ = server.LocalAddr(), server.RemoteAddr()
	}
	for range 20 {
		round()
	}
	const runs = 500
	before := a.LinkStats().TxPackets + b.LinkStats().TxPackets
	allocs := testing.AllocsPerRun(runs, round)
	sent := float64(a.LinkStats().TxPackets+b.LinkStats().TxPackets-before) / (runs + 1)
	if failure != nil {
		t.Fatal(failure)
	}
	// gVisor allocates a packet list for every packet it sends on its
	// own (delegatingQueueingDiscipline.WritePacket): those are not the
	// conn's.
	t.Logf("%.0f allocations and %.1f packets sent per round", allocs, sent)
	if allocs > sent {
		t.Errorf("%.0f allocations per round, beyond the %.1f of the packets sent", allocs, sent)
	}

	// Without traffic, nothing at all.
	idle := func() {
		server.SetDeadline(time.Now().Add(time.Minute))
		bg.start <- struct{}{}
		server.SetReadDeadline(time.Unix(1, 0))
		if err := <-bg.done; !isDeadline(err) {
			fail(fmt.Errorf("background read: %v", err))
		}
		server.SetDeadline(time.Time{})
	}
	if allocs := testing.AllocsPerRun(runs, idle); allocs != 0 || failure != nil {
		t.Errorf("%.0f allocations per interrupted Read and its deadlines (%v)", allocs, failure)
	}
}
