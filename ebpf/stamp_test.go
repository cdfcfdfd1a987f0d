package ebpf

import (
	"encoding/binary"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/internal/testing/framegen"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// steeredMeta runs frame, which p steers, and returns the RX timestamp in
// front of it and the metadata behind the timestamp.
func steeredMeta(t *testing.T, p *Program, frame []byte) (ts uint64, rest []byte) {
	t.Helper()
	var ctxOut xdpMD
	opts := ebpf.RunOptions{
		Data: frame, DataOut: make([]byte, 4096),
		Context: xdpMD{DataEnd: uint32(len(frame))}, ContextOut: &ctxOut, Repeat: 1,
	}
	if _, err := p.Program().Run(&opts); err != nil {
		t.Fatal(err)
	}
	meta := opts.DataOut[:ctxOut.Data-ctxOut.DataMeta]
	if len(meta) != classifier.MetaSize || classifier.Verdict(meta[classifier.MetaSize-2]) != classifier.VerdictSteer {
		t.Fatalf("%d metadata bytes in front of the frame, want a steered frame's %d", len(meta), classifier.MetaSize)
	}
	return binary.NativeEndian.Uint64(meta), meta[8:]
}

func monotonicNow(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}

// TestStampSteered: a steered frame's metadata carries no RX timestamp
// after Load, the CLOCK_MONOTONIC time the program saw it while
// StampSteered is on, and none again once it is off; the rest of the
// metadata is the same either way.
func TestStampSteered(t *testing.T) {
	p, c := yardstickProgram(t)
	ts, unstamped := steeredMeta(t, p, c.Frame)
	if ts != 0 {
		t.Errorf("after Load: RX timestamp %d, want none", ts)
	}
	if err := p.StampSteered(true); err != nil {
		t.Fatal(err)
	}
	before := monotonicNow(t)
	ts, stamped := steeredMeta(t, p, c.Frame)
	after := monotonicNow(t)
	if ts < before || ts > after {
		t.Errorf("stamping: RX timestamp %d outside the run's CLOCK_MONOTONIC window %d .. %d", ts, before, after)
	}
	if string(stamped) != string(unstamped) {
		t.Errorf("metadata behind the timestamp differs:\n  stamped   % x\n  unstamped % x", stamped, unstamped)
	}
	if err := p.StampSteered(false); err != nil {
		t.Fatal(err)
	}
	if ts, _ := steeredMeta(t, p, c.Frame); ts != 0 {
		t.Errorf("stamping off again: RX timestamp %d, want none", ts)
	}
}

// TestStampSteeredAdopted: a program taken over from a pin directory keeps
// its predecessor's setting and can change it.
func TestStampSteeredAdopted(t *testing.T) {
	dir := testenv.BPFFS(t)
	var c framegen.BenchCase
	for _, bc := range framegen.BenchCases() {
		if bc.Name == "listener-hit" {
			c = bc
		}
	}
	first, err := LoadWith(Options{PinDir: dir, FlowCapacity: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	tables, err := classifier.Compile(c.Rules)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Update(tables); err != nil {
		t.Fatal(err)
	}
	if err := first.StampSteered(true); err != nil {
		t.Fatal(err)
	}
	second, err := LoadWith(Options{PinDir: dir, FlowCapacity: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if !second.Adoption().Program {
		t.Fatalf("the second program did not take the first over: %+v", second.Adoption())
	}
	if ts, _ := steeredMeta(t, second, c.Frame); ts == 0 {
		t.Error("the adopted program lost its predecessor's stamping")
	}
	if err := second.StampSteered(false); err != nil {
		t.Fatal(err)
	}
	if ts, _ := steeredMeta(t, second, c.Frame); ts != 0 {
		t.Errorf("the adopted program stamps after StampSteered(false): %d", ts)
	}
}
