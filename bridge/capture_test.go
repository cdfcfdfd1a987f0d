package bridge

import (
	"bytes"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
	"github.com/fabricbridge/fabricbridge/internal/testing/ippkt"
)

// recorder is a capture hook that keeps copies.
type recorder struct {
	mu   sync.Mutex
	pkts [][]byte
	dirs []Direction
	ts   []time.Time
}

func (c *recorder) hook(dir Direction, pkt []byte, ts time.Time) {
	c.mu.Lock()
	c.pkts = append(c.pkts, append([]byte(nil), pkt...))
	c.dirs = append(c.dirs, dir)
	c.ts = append(c.ts, ts)
	c.mu.Unlock()
}

func (c *recorder) take(dir Direction) (out [][]byte, ts []time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, p := range c.pkts {
		if c.dirs[i] == dir {
			out = append(out, p)
			ts = append(ts, c.ts[i])
		}
	}
	return out, ts
}

// TestCapture: a capture hook on a stream sees exactly the packets the
// application reads (inbound) and the verified packets it wrote (outbound),
// byte for byte, in order, with timestamps of the moment; spoofed packets,
// other streams' packets and anything after the hook's removal are not seen.
func TestCapture(t *testing.T) {
	forEachPath(t, func(t *testing.T, cfg Config) {
		r := newRig(t, cfg)
		r.standardTables()
		app1 := r.stream(1, r.ownership1(), fabric.Config{})
		app2 := r.stream(2, classifier.Ownership{}, fabric.Config{})
		if err := r.b.SetCapture(99, (&recorder{}).hook); err == nil {
			t.Fatal("SetCapture on a missing stream succeeded")
		}
		var rec, rec2 recorder
		r.wantStamping(false, "before any capture")
		if err := r.b.SetCapture(1, rec.hook); err != nil {
			t.Fatal(err)
		}
		r.wantStamping(true, "while a stream is captured")
		before := time.Now()

		c := udpSocket(t, r.out, netip.AddrPortFrom(r.remote4, remotePort))
		sendTo(t, c, netip.AddrPortFrom(r.local4, udpPort1), payloads(30, "in"))
		sendTo(t, c, netip.AddrPortFrom(r.local4, udpPort2), payloads(5, "other stream"))
		got := recvN(t, app1, 30, 3*time.Second)
		if n := len(recvN(t, app2, 5, 3*time.Second)); len(got) != 30 || n != 5 {
			t.Fatalf("streams got %d of 30 and %d of 5", len(got), n)
		}

		to := netip.AddrPortFrom(r.remote4, remotePort)
		from := netip.AddrPortFrom(r.local4, udpPort1)
		var out [][]byte
		for _, p := range payloads(20, "out") {
			out = append(out, ippkt.UDP(from, to, p))
		}
		spoof := ippkt.UDP(netip.AddrPortFrom(r.local4, 9), to, []byte("spoofed"))
		if _, err := app1.Send(append([][]byte{spoof}, out...)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 2048)
		for i := range out {
			c.SetReadDeadline(time.Now().Add(3 * time.Second))
			if _, err := c.Read(buf); err != nil {
				t.Fatalf("outside got %d of %d: %v", i, len(out), err)
			}
		}
		after := time.Now()

		// The hook sees a batch just after the stream got it.
		in, inTS := rec.take(Inbound)
		for deadline := time.Now().Add(2 * time.Second); len(in) < len(got) && time.Now().Before(deadline); in, inTS = rec.take(Inbound) {
			time.Sleep(time.Millisecond)
		}
		if len(in) != len(got) {
			t.Fatalf("captured %d inbound packets, the stream got %d", len(in), len(got))
		}
		for i := range got {
			if !bytes.Equal(in[i], got[i]) {
				t.Fatalf("inbound %d captured as\n%x\nthe stream got\n%x", i, in[i], got[i])
			}
		}
		sent, outTS := rec.take(Outbound)
		if len(sent) != len(out) {
			t.Fatalf("captured %d outbound packets, want the %d verified ones", len(sent), len(out))
		}
		for i := range out {
			if !bytes.Equal(sent[i], out[i]) {
				t.Fatalf("outbound %d captured as\n%x\nwant\n%x", i, sent[i], out[i])
			}
		}
		// The XDP timestamp is converted from the monotonic clock: allow for
		// the offset taken at Open drifting a little from the wall clock.
		slack := 50 * time.Millisecond
		for _, ts := range append(inTS, outTS...) {
			if ts.Before(before.Add(-slack)) || ts.After(after.Add(slack)) {
				t.Fatalf("timestamp %v outside the test's window %v .. %v", ts, before, after)
			}
		}
		for i := 1; i < len(inTS); i++ {
			if inTS[i].Before(inTS[i-1]) {
				t.Fatalf("inbound timestamps go back: %v after %v", inTS[i], inTS[i-1])
			}
		}

		// Replacing the hook: from SetCapture's return on, only the new one
		// runs. Removing it: nobody sees anything.
		if err := r.b.SetCapture(1, rec2.hook); err != nil {
			t.Fatal(err)
		}
		n1 := len(rec.pkts)
		sendTo(t, c, netip.AddrPortFrom(r.local4, udpPort1), payloads(3, "second hook"))
		if n := len(recvN(t, app1, 3, 3*time.Second)); n != 3 {
			t.Fatalf("stream got %d of 3 with the second hook", n)
		}
		if err := r.b.SetCapture(1, nil); err != nil {
			t.Fatal(err)
		}
		r.wantStamping(false, "once the capture is gone")
		sendTo(t, c, netip.AddrPortFrom(r.local4, udpPort1), payloads(3, "no hook"))
		if n := len(recvN(t, app1, 3, 3*time.Second)); n != 3 {
			t.Fatalf("stream got %d of 3 after removing the hook", n)
		}
		rec.mu.Lock()
		rec2.mu.Lock()
		defer rec.mu.Unlock()
		defer rec2.mu.Unlock()
		if len(rec.pkts) != n1 || len(rec2.pkts) != 3 {
			t.Fatalf("after replacing the hook the old one saw %d more, the new one %d (want 0 and 3)", len(rec.pkts)-n1, len(rec2.pkts))
		}
		for _, p := range rec2.pkts {
			if !bytes.Contains(p, []byte("second hook")) {
				t.Fatalf("the second hook saw %q", p)
			}
		}
	})
}

// wantStamping checks that the XDP program stamps steered frames exactly
// while a capture reads the timestamps (nothing to check on AF_PACKET).
func (r *rig) wantStamping(want bool, when string) {
	r.t.Helper()
	if r.b.prog == nil {
		return
	}
	on, err := r.b.prog.StampsSteered()
	if err != nil {
		r.t.Fatal(err)
	}
	if on != want {
		r.t.Errorf("%s: the XDP program stamps steered frames: %v, want %v", when, on, want)
	}
}
