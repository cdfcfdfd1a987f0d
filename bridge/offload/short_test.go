package offload

import (
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
)

// TestShortPayloads: on the XDP path, payloads of 0 to
// ingesttest.MaxShort bytes — those under 14 bytes keep header bytes in
// front of them in the stripped frame (IngestMeta.PayloadOffset) — reach
// the consumer byte-exact, with no header byte before them and nothing
// after them: from kernel senders over IPv4 and IPv6, and in hand-made
// IPv4 frames padded to 60 bytes as a NIC pads them (the padding must not
// reach the ring either).
func TestShortPayloads(t *testing.T) {
	// The consumer reads after the last send: a buffer per datagram
	// (sends slower than the window) must fit.
	tp := newTopo(t, map[uint32]ingest.Config{bufTrigger: {Buffers: 128, BufferSize: 16 << 10}}, Config{})
	v4, v6 := tp.sender(false, 5101, portTrigger), tp.sender(true, 5102, portTrigger+1)
	frames := ingesttest.ShortFrames(ingesttest.Endpoints{Src4: tp.v.B.Addr4.Addr(), Dst4: tp.v.A.Addr4.Addr()}, 5103, portTrigger+2)
	raw := tp.packetSocket()
	const want = 3 * (ingesttest.MaxShort + 1)
	got := ingesttest.Collect(t, tp.rings[bufTrigger].Name(), want, 5*time.Second, func() {
		ingesttest.SendShort(t, v4, v6, raw, frames, tp.v)
	})
	ingesttest.CheckShort(t, got, 5101, 5102, 5103)
	cs, err := tp.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if st := tp.eng.Stats(); st.Appended != want || st.Malformed != 0 || cs.StripFailed != 0 || cs.Verdicts[classifier.VerdictMalformed].Packets != 0 {
		t.Errorf("engine %+v; program: %d failed strips, %d malformed", st, cs.StripFailed, cs.Verdicts[classifier.VerdictMalformed].Packets)
	}
}
