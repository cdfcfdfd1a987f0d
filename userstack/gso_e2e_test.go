package userstack

import (
	"bytes"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/bridge/features"
)

// TestSegmentOffloadFollowsTSO turns the bridge interface's TCP
// segmentation offload off and on under a running bridge: downloads arrive
// whole either way, segments are joined only while the device segments
// them, and no offload send is lost once the bridge has seen the change.
func TestSegmentOffloadFollowsTSO(t *testing.T) {
	e := newE2E(t)
	if p := e.b.Stats().Path; p != bridge.PathNativeCopy.String() && p != bridge.PathGeneric.String() {
		t.Fatalf("path %s: the test needs a copy path", p)
	}
	s := e.open(false)
	l, err := s.Listen("tcp", ":80")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	want := body(2 << 20)
	serveBody(t, l, want)
	download := func(what string) {
		t.Helper()
		for _, host := range []string{e.local4.String(), "[" + e.local6.String() + "]"} {
			got, err := httpGet(testCtx(t, 30*time.Second), e.dialOutside, "http://"+host+"/")
			if err != nil {
				t.Fatalf("%s, %s: %v", what, host, err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%s, %s: %d bytes arrived, not the %d served", what, host, len(got), len(want))
			}
		}
	}
	joined := func() (n, lost uint64) {
		for _, q := range e.b.Stats().Queues {
			n += q.TxJoined
			lost += q.TxOffloadLost
		}
		return n, lost
	}
	var feats *features.Interface
	if err := e.br.Do(func() (err error) { feats, err = features.Open(e.wire.B.Name); return err }); err != nil {
		t.Fatal(err)
	}
	defer feats.Close()
	tso := []string{"tx-tcp-segmentation", "tx-tcp6-segmentation"}
	setTSO := func(on bool) {
		t.Helper()
		if err := feats.Set(tso, on); err != nil {
			t.Fatal(err)
		}
		// The bridge reads the features every second.
		time.Sleep(1500 * time.Millisecond)
	}
	t.Cleanup(func() { feats.Set(tso, true) })

	download("TSO on")
	on, lost := joined()
	if on == 0 || lost != 0 {
		t.Fatalf("TSO on: %d segments joined, %d lost; want some joined, none lost", on, lost)
	}
	setTSO(false)
	download("TSO off")
	off, lost := joined()
	if off != on || lost != 0 {
		t.Fatalf("TSO off: %d more segments joined, %d lost; want none of either", off-on, lost)
	}
	setTSO(true)
	download("TSO on again")
	again, lost := joined()
	if again == off || lost != 0 {
		t.Fatalf("TSO on again: %d more segments joined, %d lost; want some joined, none lost", again-off, lost)
	}
}
