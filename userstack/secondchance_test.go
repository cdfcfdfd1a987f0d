package userstack

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// bridgeSide drives a stack's stream from the bridge's end, words and all.
type bridgeSide struct {
	t  *testing.T
	br *fabric.BridgeStream
}

func (b bridgeSide) send(pkt []byte, word uint32) {
	b.t.Helper()
	if n, err := b.br.SendMeta([][]byte{pkt}, []uint32{word}); n != 1 || err != nil {
		b.t.Fatalf("deliver: %d, %v", n, err)
	}
}

// next is the next packet the stack sends, with its word; nil after wait.
func (b bridgeSide) next(wait time.Duration) ([]byte, uint32) {
	b.t.Helper()
	bufs, meta := [][]byte{make([]byte, 2048)}, make([]uint32, 1)
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		n, err := b.br.TryRecvMeta(bufs, meta)
		if err != nil {
			b.t.Fatal(err)
		}
		if n == 1 {
			return bufs[0], meta[0]
		}
	}
	return nil, 0
}

// stackOnPair is a stack with addrA over a shm stream whose bridge end the
// test drives.
func stackOnPair(t *testing.T) (*Stack, *fabric.BridgeStream) {
	t.Helper()
	br, app, err := fabric.NewPair(fabric.Config{RxSlots: 64, TxSlots: 64})
	if err != nil {
		t.Fatal(err)
	}
	s, err := newStack(app, LinkConfig{MTU: 1500, MaxPacket: app.MaxPayload()}, addrA, &grantAll{}, app.Close)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(); br.Close() })
	return s, br
}

// acceptRead accepts l's next connection and reads want from it; the
// connection closes with the test.
func acceptRead(t *testing.T, l net.Listener, want string) net.Conn {
	t.Helper()
	conn, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(2 * time.Second))
	got := make([]byte, len(want))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != want {
		t.Fatalf("the connection read %q, %v; want %q", got, err, want)
	}
	return conn
}

// listenerOnPair is stackOnPair with a listener on 198.18.0.1:80, and the
// bridge's end to drive it.
func listenerOnPair(t *testing.T) (*Stack, net.Listener, bridgeSide) {
	t.Helper()
	s, br := stackOnPair(t)
	l, err := s.Listen("tcp", "198.18.0.1:80")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return s, l, bridgeSide{t, br}
}

func tcpOf(t *testing.T, pkt []byte) *layers.TCP {
	t.Helper()
	first := layers.LayerTypeIPv4
	if pkt[0]>>4 == 6 {
		first = layers.LayerTypeIPv6
	}
	tcp, ok := gopacket.NewPacket(pkt, first, gopacket.Default).Layer(layers.LayerTypeTCP).(*layers.TCP)
	if !ok {
		t.Fatalf("not TCP: %x", pkt)
	}
	return tcp
}

// A segment marked MarkMayReturn that belongs to no connection of the
// stack, and opens none, goes back to the bridge unchanged with
// MarkNotMine; unmarked, the stack resets it as before. A marked SYN, and
// the marked segments of a connection the stack has, go up as usual.
func TestMarkedStrangersGoBack(t *testing.T) {
	s, l, b := listenerOnPair(t)
	remote4 := netip.MustParseAddr("198.18.9.9")
	remote6 := netip.MustParseAddr("2001:db8::9")
	local4, local6 := netip.AddrPortFrom(addrA[0], 80), netip.AddrPortFrom(addrA[1], 80)

	for _, stray := range [][]byte{
		ippkt.TCP(netip.AddrPortFrom(remote4, 40000), local4, 5000, 7000, false, true, false, []byte("stray")),
		ippkt.TCP(netip.AddrPortFrom(remote6, 40000), local6, 5000, 7000, false, true, false, []byte("stray")),
	} {
		b.send(stray, fabric.MarkMayReturn|2)
		got, word := b.next(2 * time.Second)
		if !bytes.Equal(got, stray) || word != fabric.MarkNotMine {
			t.Fatalf("a marked stray came back as %x with word %#x; want it unchanged with MarkNotMine", got, word)
		}
		b.send(stray, 2)
		got, word = b.next(2 * time.Second)
		if got == nil || !tcpOf(t, got).RST || word != 0 {
			t.Fatalf("an unmarked stray: answered by %x, word %#x; want a reset", got, word)
		}
	}

	from := netip.AddrPortFrom(remote4, 40001)
	b.send(ippkt.TCP(from, local4, 100, 0, true, false, false, nil), fabric.MarkMayReturn)
	synAck, word := b.next(2 * time.Second)
	if synAck == nil || word != 0 || !tcpOf(t, synAck).SYN || !tcpOf(t, synAck).ACK {
		t.Fatalf("a marked SYN: answered by %x, word %#x; want a SYN-ACK", synAck, word)
	}
	isn := tcpOf(t, synAck).Seq
	b.send(ippkt.TCP(from, local4, 101, isn+1, false, true, false, nil), fabric.MarkMayReturn)
	b.send(ippkt.TCP(from, local4, 101, isn+1, false, true, false, []byte("hello")), fabric.MarkMayReturn)
	acceptRead(t, l, "hello")
	for pkt, word := b.next(200 * time.Millisecond); pkt != nil; pkt, word = b.next(200 * time.Millisecond) {
		if word != 0 || tcpOf(t, pkt).RST {
			t.Fatalf("the connection's marked segments were answered by %x, word %#x", pkt, word)
		}
	}
	if st := s.LinkStats(); st.RxMayReturn != 5 || st.TxNotMine != 2 {
		t.Fatalf("stats: %d marked received, %d handed back; want 5 and 2", st.RxMayReturn, st.TxNotMine)
	}
}

// markedReplay is a replayLink whose packets all carry word, and which
// counts what comes back.
type markedReplay struct {
	replayLink
	word uint32
	back int
}

func (l *markedReplay) RecvMeta(bufs [][]byte, meta []uint32) (int, error) {
	n, err := l.Recv(bufs)
	for i := range n {
		meta[i] = l.word
	}
	return n, err
}

func (l *markedReplay) SendMeta(pkts [][]byte, meta []uint32) (int, error) {
	for _, w := range meta[:len(pkts)] {
		if w == fabric.MarkNotMine {
			l.back++
		}
	}
	return len(pkts), nil
}

// Handing strays back allocates nothing.
func TestHandingBackAllocatesNothing(t *testing.T) {
	s, _ := stackOnPair(t)
	var strays [][]byte
	for i := range 32 {
		strays = append(strays, ippkt.TCP(netip.AddrPortFrom(netip.MustParseAddr("198.18.9.9"), uint16(40000+i)), netip.AddrPortFrom(addrA[0], 80), 1, 1, false, true, false, pattern(100)))
	}
	link := &markedReplay{replayLink: replayLink{pkts: strays}, word: fabric.MarkMayReturn}
	ep, _ := NewLinkEndpoint(link, LinkConfig{MTU: 1500, MaxPacket: 2040})
	ep.conns = s.ns
	ep.dispatcher = &countingDispatcher{}
	r := newReceiver(ep)
	if err := r.once(); err != nil || link.back != len(strays) {
		t.Fatalf("%d of %d strays handed back (%v)", link.back, len(strays), err)
	}
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector")
	}
	if allocs := testing.AllocsPerRun(100, func() { r.once() }); allocs != 0 {
		t.Fatalf("%.1f allocations per batch of strays", allocs)
	}
}
