package userstack

import (
	"net/netip"
	"regexp"
	"testing"
)

// sendCounter is a Link that counts the packets sent through it.
type sendCounter struct{ sent int }

func (l *sendCounter) Send(pkts [][]byte) (int, error) { l.sent += len(pkts); return len(pkts), nil }
func (l *sendCounter) Recv([][]byte) (int, error)      { select {} }

// TestTxPathSendsThroughTheFirstAttached: packets leave through the first
// bridge whose stream is attached, the next one while it is away, the
// first again once it is back, and nowhere (dropped, reported sent) while
// none is attached.
func TestTxPathSendsThroughTheFirstAttached(t *testing.T) {
	l0, l1 := &sendCounter{}, &sendCounter{}
	var tx txPath
	tx.init(2)
	tx.links[0], tx.links[1] = newRelink(l0, nil), newRelink(l1, nil)
	pkt := [][]byte{{0x45}}
	step := func(what string, want0, want1, sending int) {
		t.Helper()
		if n, err := tx.Send(pkt); n != 1 || err != nil {
			t.Fatalf("%s: Send: %d, %v", what, n, err)
		}
		if l0.sent != want0 || l1.sent != want1 || tx.sending() != sending {
			t.Fatalf("%s: sent %d and %d, sending %d; want %d, %d, %d", what, l0.sent, l1.sent, tx.sending(), want0, want1, sending)
		}
	}
	step("both attached", 1, 0, 0)
	tx.links[0].set(nil)
	step("the first away", 1, 1, 1)
	tx.links[1].set(nil)
	step("none attached", 1, 1, -1)
	tx.links[1].set(l1)
	tx.links[0].set(l0)
	step("the first back", 2, 1, 0)
	if tx.sent[0].Load() != 2 || tx.sent[1].Load() != 1 {
		t.Errorf("counted %d and %d sent", tx.sent[0].Load(), tx.sent[1].Load())
	}
}

func TestSameAddrsIgnoresOrder(t *testing.T) {
	a, b := netip.MustParseAddr("198.18.200.1"), netip.MustParseAddr("2001:db8::1")
	if !sameAddrs([]netip.Addr{a, b}, []netip.Addr{b, a}) || sameAddrs([]netip.Addr{a}, []netip.Addr{a, b}) {
		t.Fatal("sameAddrs")
	}
}

// TestDefaultInstanceIsAValidName: the default instance name passes the
// control plane's rule for names, whatever the host is called.
func TestDefaultInstanceIsAValidName(t *testing.T) {
	if n := defaultInstance(); !regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`).MatchString(n) {
		t.Fatalf("%q", n)
	}
}
