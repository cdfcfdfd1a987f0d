// Package xdpgen is a traffic generator for tests and benchmarks: it sends
// prepared Ethernet frames out of an interface through an AF_XDP socket's TX
// ring. The kernel then builds one skb per frame (copy mode) and hands it to
// the driver directly, skipping the socket layer, the routing and the qdisc,
// so one core drives a veth pair harder than any socket API would, leaving
// the other core to the receiver under test.
package xdpgen

import (
	"errors"
	"fmt"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge/xsk"
)

// Gen sends frames from one (interface, queue). Not safe for concurrent use.
type Gen struct {
	umem   *xsk.Umem
	sock   *xsk.Socket
	free   []uint64
	descs  []xsk.Desc
	reaped []uint64
	frames [][]byte
}

// New opens a generator on ifindex, queue 0, that cycles through frames.
// Call it on a thread inside the interface's network namespace.
func New(ifindex int, frames [][]byte) (*Gen, error) {
	if len(frames) == 0 {
		return nil, errors.New("xdpgen: no frames")
	}
	const count = 4096
	u, err := xsk.NewUmem(xsk.UmemConfig{FrameCount: count})
	if err != nil {
		return nil, err
	}
	s, err := u.Open(xsk.SocketConfig{Ifindex: ifindex, Queue: 0, RxSize: -1, TxSize: count, FillSize: 64, CompletionSize: count, Bind: xsk.BindAny})
	if err != nil {
		u.Close()
		return nil, err
	}
	g := &Gen{umem: u, sock: s, free: make([]uint64, count), descs: make([]xsk.Desc, xsk.MaxBatch), reaped: make([]uint64, xsk.MaxBatch), frames: frames}
	u.Alloc(g.free)
	// Every UMEM frame holds one of the frames for good: sending is then
	// only descriptors.
	for _, a := range g.free {
		f := g.frame(a)
		if len(f) > u.FrameSize() {
			u.Close()
			return nil, fmt.Errorf("xdpgen: frame of %d bytes", len(f))
		}
		copy(u.Frame(a), f)
	}
	return g, nil
}

// Send transmits n frames as fast as the kernel takes them, or until d
// passes, and returns how many went out.
func (g *Gen) Send(n int, d time.Duration) int {
	deadline := time.Now().Add(d)
	sent := 0
	for sent < n {
		k := 0
		for k < len(g.descs) && k < n-sent && len(g.free) > 0 {
			a := g.free[len(g.free)-1]
			g.free = g.free[:len(g.free)-1]
			g.descs[k] = xsk.Desc{Addr: a, Len: uint32(len(g.frame(a)))}
			k++
		}
		if k > 0 {
			m := g.sock.TX.Send(g.descs[:k])
			sent += m
			for _, d := range g.descs[m:k] { // the ring looked full: keep them
				g.free = append(g.free, d.Addr)
			}
		}
		g.sock.Kick()
		for {
			m := g.sock.Completion.Reap(g.reaped)
			if m == 0 {
				break
			}
			g.free = append(g.free, g.reaped[:m]...)
		}
		if time.Now().After(deadline) {
			break
		}
	}
	// Let the kernel finish what is queued.
	for i := 0; i < 1000 && g.sock.TX.Pending() > 0; i++ {
		g.sock.Kick()
	}
	return sent
}

// frame is the frame that UMEM frame a holds.
func (g *Gen) frame(a uint64) []byte {
	return g.frames[int(a/uint64(g.umem.FrameSize()))%len(g.frames)]
}

// Close releases the socket and UMEM.
func (g *Gen) Close() error { return g.umem.Close() }
