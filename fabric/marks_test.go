package fabric

import (
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// A marked data packet carries its marks in a non-critical option, the rule
// id left behind; an unmarked one has no option at all, as before marks.
func TestGeneveMarksOption(t *testing.T) {
	b := make([]byte, geneveHdrLen+marksOptLen+20)
	putGeneve(b, 9, protoIPv4, marksOptLen/4, false)
	putMarks(b, MarkNotMine)
	b[geneveHdrLen+marksOptLen] = 0x45
	m, err := parseGeneve(b)
	if err != nil || m.marks != MarkNotMine || len(m.payload) != 20 || m.control {
		t.Fatalf("marked: %+v %v", m, err)
	}
	if b[1]&flagCritical != 0 || b[geneveHdrLen+2]&0x80 != 0 {
		t.Fatal("the marks option is critical: a receiver without it would drop the packet")
	}
	plain := make([]byte, geneveHdrLen+20)
	putGeneve(plain, 9, protoIPv4, 0, false)
	plain[geneveHdrLen] = 0x45
	if m, err := parseGeneve(plain); err != nil || m.marks != 0 {
		t.Fatalf("plain: %+v %v", m, err)
	}
}

// Marks cross the GENEVE transport both ways between the bridge's end and
// the application's, in batches that mix marked and plain packets of one
// length (which GSO would otherwise send as one run); the rule id in the
// low bits stays on the bridge.
func TestRemoteCarriesMarks(t *testing.T) {
	testenv.RequirePrivileged(t)
	x := newRemotes(t, false, RemoteConfig{}, RemoteConfig{})
	sa, sb := x.pair(t, 11)
	br := sa.Bridge()
	q := queueOf(t, br)
	const n = 64
	pkts := make([][]byte, n)
	meta := make([]uint32, n)
	marksOf := func(i int, mark uint32) uint32 {
		if i%3 == 1 {
			return mark
		}
		return 0
	}
	for i := range pkts {
		pkts[i] = ipPkt(make([]byte, 1000), false, uint32(i), 1000)
		meta[i] = 0x1234 | marksOf(i, MarkMayReturn)
	}
	if err := offerAllMeta(br, pkts, meta); err != nil {
		t.Fatal(err)
	}
	out := mkBufs(n, 2048)
	got := make([]uint32, n)
	for k := 0; k < n; {
		m, err := sb.recvTimeoutMeta(out[k:], got[k:], 5*time.Second)
		if err != nil {
			t.Fatalf("after %d packets: %v (counters %+v)", k, err, x.rb.Counters())
		}
		k += m
	}
	for i := range n {
		if string(out[i]) != string(pkts[i]) || got[i] != marksOf(i, MarkMayReturn) {
			t.Fatalf("to the application, packet %d: meta %#x, %d bytes; want %#x", i, got[i], len(out[i]), marksOf(i, MarkMayReturn))
		}
	}

	for i := range meta {
		meta[i] = marksOf(i, MarkNotMine)
	}
	if k, err := sb.SendMeta(pkts, meta); k != n || err != nil {
		t.Fatalf("SendMeta: %d, %v", k, err)
	}
	toks := make([]int, 4)
	clear(got)
	deadline := time.Now().Add(5 * time.Second)
	for k := 0; k < n; {
		if time.Now().After(deadline) {
			t.Fatalf("the bridge's end got %d of %d packets", k, n)
		}
		w, err := q.Wait(toks, 100*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if w > 0 {
			m, err := br.TryRecvMeta(out[k:], got[k:])
			if err != nil {
				t.Fatal(err)
			}
			k += m
		}
	}
	for i := range n {
		if string(out[i]) != string(pkts[i]) || got[i] != marksOf(i, MarkNotMine) {
			t.Fatalf("to the bridge, packet %d: meta %#x; want %#x", i, got[i], marksOf(i, MarkNotMine))
		}
	}
}
