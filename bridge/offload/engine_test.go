package offload

import (
	"bytes"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
)

// TestKernelSenders: kernel UDP senders on several source ports (IPv4 and
// IPv6) reach the ring complete, in order per source and byte-exact; a
// second ingest rule fills its own ring; a buffer id with no ring is counted.
func TestKernelSenders(t *testing.T) {
	tp := newTopo(t, map[uint32]ingest.Config{
		bufTrigger: {Buffers: 64, BufferSize: 64 << 10, Window: 100 * time.Microsecond},
		bufOther:   {Buffers: 64, BufferSize: 16 << 10, Window: 100 * time.Microsecond},
	}, Config{})
	rd := tp.reader(bufTrigger, checkTrigger)
	other := tp.reader(bufOther, checkTrigger)
	senders := []*ingesttest.Sender{
		tp.sender(false, 5001, portTrigger),
		tp.sender(false, 5002, portTrigger+1),
		tp.sender(false, 5003, portTrigger+3),
		tp.sender(true, 5004, portTrigger),
	}
	const perSender, chunk = 1500, 25
	// Paced by the consumer: this test is about correctness, the
	// overload test about drops.
	ingesttest.SendPaced(t, rd, senders, perSender, chunk)
	var buf [1500]byte
	o := tp.sender(false, 5005, portOther)
	for seq := range 50 {
		o.Send(triggerPayload(buf[:], o.Port, uint32(seq)))
		if seq%10 == 9 {
			other.WaitRecords(t, uint64(seq+1), 10*time.Second)
		}
	}
	other.WaitRecords(t, 50, 5*time.Second)
	nr := tp.sender(false, 5006, portNoRing)
	for seq := range 7 {
		nr.Send(triggerPayload(buf[:], nr.Port, uint32(seq)))
	}
	deadline := time.Now().Add(5 * time.Second)
	for tp.eng.Stats().NoRing < 7 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}

	rd.Close()
	other.Close()
	if rd.Err != nil || other.Err != nil {
		t.Fatal(rd.Err, other.Err)
	}
	if len(rd.Bad) > 0 {
		t.Fatalf("payloads differ: %v", rd.Bad)
	}
	if got := len(rd.Ref.Sources); got != len(senders) {
		t.Fatalf("%d sources in the ring, want %d", got, len(senders))
	}
	for i, s := range rd.Ref.Sources {
		src, _ := rd.C.Source(uint16(i))
		if s.Records != perSender || s.FirstSeq != 0 || s.LastSeq != perSender-1 || s.SenderGaps != 0 || s.SenderBackwards != 0 || s.DroppedHere != 0 {
			t.Errorf("source %d (%v): %+v", i, src, s)
		}
	}
	if s := other.Ref.Sources; len(s) != 1 || s[0].Records != 50 || s[0].SenderGaps != 0 {
		t.Errorf("the second ring: %+v", s)
	}
	st := tp.eng.Stats()
	want := uint64(len(senders)*perSender + 50)
	if st.Appended != want || st.Dropped != 0 || st.NoRing != 7 || st.Malformed != 0 || st.KernelDrops != 0 {
		t.Errorf("engine stats %+v, want %d appended", st, want)
	}
	cs, err := tp.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if cs.Verdicts[classifier.VerdictIngest].Packets != want+7 || cs.RedirectFailed != 0 || cs.StripFailed != 0 {
		t.Errorf("program: %d ingest verdicts (want %d), %d failed redirects, %d failed strips",
			cs.Verdicts[classifier.VerdictIngest].Packets, want+7, cs.RedirectFailed, cs.StripFailed)
	}
	lat := rd.C.Stats().Latency
	t.Logf("%d buffers; latency p50 %v p99 %v", lat.Count, time.Duration(lat.Quantile(0.5)), time.Duration(lat.Quantile(0.99)))
}

// TestSenderGap: a sender that skips sequence numbers is reported as a gap
// in its source and only there.
func TestSenderGap(t *testing.T) {
	tp := newTopo(t, map[uint32]ingest.Config{bufTrigger: {Buffers: 64, BufferSize: 64 << 10}}, Config{})
	rd := tp.reader(bufTrigger, checkTrigger)
	a, b := tp.sender(false, 5001, portTrigger), tp.sender(false, 5002, portTrigger)
	var buf [1500]byte
	sent := 0
	for seq := range uint32(300) {
		a.Send(triggerPayload(buf[:], a.Port, seq))
		sent++
		if seq >= 100 && seq < 110 || seq == 200 {
			continue // b skips 100..109 and 200
		}
		b.Send(triggerPayload(buf[:], b.Port, seq))
		sent++
		if seq%10 == 9 {
			rd.WaitRecords(t, uint64(sent), 10*time.Second)
		}
	}
	rd.WaitRecords(t, uint64(sent), 10*time.Second)
	rd.Close()
	if rd.Err != nil || len(rd.Bad) > 0 {
		t.Fatal(rd.Err, rd.Bad)
	}
	sa, sb := rd.Ref.Sources[0], rd.Ref.Sources[1]
	if sa.SenderGaps != 0 || sa.Records != 300 {
		t.Errorf("source a: %+v", sa)
	}
	if sb.SenderGaps != 11 || sb.Records != 289 || sb.DroppedHere != 0 {
		t.Errorf("source b: %+v", sb)
	}
	gaps := rd.Ref.Gaps
	if len(gaps) != 2 || gaps[0] != (ingest.Gap{Source: 1, Sender: true, Want: 100, Got: 110}) || gaps[1] != (ingest.Gap{Source: 1, Sender: true, Want: 200, Got: 201}) {
		t.Errorf("gaps %v", gaps)
	}
}

// TestOverload: while the consumer holds every buffer, datagrams are
// dropped and counted — by the ring, the engine and as gaps in the ring's
// per-source sequence — the held buffers stay exactly as published, and
// once released the ring fills again. Nothing stored is corrupt.
func TestOverload(t *testing.T) {
	tp := newTopo(t, map[uint32]ingest.Config{bufTrigger: {Buffers: 4, BufferSize: 8 << 10, Window: 50 * time.Microsecond}}, Config{})
	ring := tp.rings[bufTrigger]
	c, err := ingest.Open(ring.Name(), ingest.ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := tp.sender(false, 5001, portTrigger)
	var buf [1500]byte
	seq := uint32(0)
	// Fill all four buffers (and more) while nobody releases.
	var held []ingest.Buffer
	var snapshots [][]byte
	for len(held) < 4 {
		for range 20 {
			s.Send(triggerPayload(buf[:], s.Port, seq))
			seq++
		}
		for {
			b, ok, err := c.Poll()
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				break
			}
			held = append(held, b)
			snapshots = append(snapshots, bytes.Clone(b.Data()))
		}
		if seq > 2000 {
			t.Fatalf("only %d buffers published after %d datagrams", len(held), seq)
		}
	}
	dropsBefore := tp.eng.Stats().Dropped
	for range 500 {
		s.Send(triggerPayload(buf[:], s.Port, seq))
		seq++
	}
	deadline := time.Now().Add(5 * time.Second)
	for tp.eng.Stats().Received+tp.eng.Stats().KernelDrops < uint64(seq) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if st := tp.eng.Stats(); st.Dropped-dropsBefore < 450 {
		t.Fatalf("only %d drops with every buffer held: %+v", st.Dropped-dropsBefore, st)
	}
	for i := range held {
		if !bytes.Equal(held[i].Data(), snapshots[i]) {
			t.Fatalf("held buffer %d changed while the ring was overloaded", held[i].Index)
		}
	}
	var ref ingest.Reference
	for i := range held {
		if err := ref.Process(&held[i]); err != nil {
			t.Fatal(err)
		}
		if err := c.Release(&held[i]); err != nil {
			t.Fatal(err)
		}
	}
	// After release the ring takes data again: three datagrams, which
	// fit the four buffers even if each lands in a window of its own.
	for range 3 {
		s.Send(triggerPayload(buf[:], s.Port, seq))
		seq++
	}
	total := uint64(0)
	deadline = time.Now().Add(5 * time.Second)
	for ref.Sources[0].LastSeq != seq-1 && time.Now().Before(deadline) {
		b, err := c.Next(100 * time.Millisecond)
		if err != nil {
			continue
		}
		it := b.Iter()
		for it.Next() {
			if err := checkTrigger(ingest.Source{SrcPort: s.Port}, it.Record().Payload); err != nil {
				t.Fatal(err)
			}
		}
		if err := ref.Process(&b); err != nil {
			t.Fatal(err)
		}
		total += uint64(b.Records)
		c.Release(&b)
	}
	src := ref.Sources[0]
	rs := ring.Stats()
	es := tp.eng.Stats()
	if src.LastSeq != seq-1 {
		t.Fatalf("the last datagram never arrived after release: %+v; sent %d; %s", src, seq, tp.describe())
	}
	// Every datagram is accounted for: stored, dropped by the ring (a
	// gap in its sequence), or dropped by the kernel before the engine.
	if rs.NoBuffer != es.Dropped || src.DroppedHere != rs.NoBuffer || src.Records+rs.NoBuffer+es.KernelDrops != uint64(seq) {
		t.Errorf("ring %+v, engine %+v, reference %+v: %d sent", rs, es, src, seq)
	}
	if src.SenderGaps != src.DroppedHere || src.SenderBackwards != 0 {
		t.Errorf("sender gaps %d should be exactly the drops here %d", src.SenderGaps, src.DroppedHere)
	}
	t.Logf("%d sent, %d stored, %d dropped by the ring, %d by the kernel", seq, src.Records, rs.NoBuffer, es.KernelDrops)
}

// TestMalformedNeverReachesBuffer sends, from a packet socket outside,
// UDP datagrams to the ingest port with a bad UDP length, a truncated IP
// packet and fragments, plus the kernel's own fragments of a datagram too
// big for the MTU. None reaches the ring; each is counted as malformed by
// the program, and whole datagrams around them still arrive.
func TestMalformedNeverReachesBuffer(t *testing.T) {
	tp := newTopo(t, map[uint32]ingest.Config{bufTrigger: {Buffers: 8, BufferSize: 64 << 10}}, Config{})
	rd := tp.reader(bufTrigger, checkTrigger)
	bad := ingesttest.MalformedFrames(ingesttest.Endpoints{
		Src4: tp.v.B.Addr4.Addr(), Dst4: tp.v.A.Addr4.Addr(), Src6: tp.v.B.Addr6.Addr(), Dst6: tp.v.A.Addr6.Addr(),
	}, 6001, portTrigger)
	before, err := tp.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	s := tp.sender(false, 5001, portTrigger)
	var buf [1500]byte
	s.Send(triggerPayload(buf[:], s.Port, 0))
	raw := tp.packetSocket()
	for _, f := range bad {
		copy(f[0:6], tp.v.A.MAC)
		copy(f[6:12], tp.v.B.MAC)
		if err := unix.Sendto(raw, f, 0, &unix.SockaddrLinklayer{Ifindex: tp.v.B.Index}); err != nil {
			t.Fatal(err)
		}
	}
	// The kernel fragments a 3000-byte datagram into three frames.
	big := make([]byte, 3000)
	ingest.PutTriggerPayload(big, 999, nil)
	if err := s.Send(big); err != nil {
		t.Fatal(err)
	}
	s.Send(triggerPayload(buf[:], s.Port, 1))
	rd.WaitRecords(t, 2, 5*time.Second)
	time.Sleep(50 * time.Millisecond) // anything else that would arrive
	rd.Close()
	after, err := tp.prog.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if rd.Err != nil || len(rd.Bad) > 0 {
		t.Fatal(rd.Err, rd.Bad)
	}
	if n := rd.Records.Load(); n != 2 || rd.Ref.Sources[0].LastSeq != 1 {
		t.Fatalf("%d records reached the ring (%+v), want the 2 whole datagrams", n, rd.Ref.Sources)
	}
	wantMalformed := uint64(len(bad) + 3)
	if n := after.Verdicts[classifier.VerdictMalformed].Packets - before.Verdicts[classifier.VerdictMalformed].Packets; n != wantMalformed {
		t.Errorf("%d malformed verdicts, want %d", n, wantMalformed)
	}
	if st := tp.eng.Stats(); st.Appended != 2 || st.Malformed != 0 {
		t.Errorf("engine %+v", st)
	}
}

// packetSocket opens an AF_PACKET socket on end B, in the outside
// namespace, for sending hand-made frames.
func (tp *topo) packetSocket() int {
	tp.t.Helper()
	var fd int
	if err := tp.out.Do(func() (err error) {
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		return err
	}); err != nil {
		tp.t.Fatal(err)
	}
	tp.t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// TestNoAllocationsPerPacket drives the engine by hand over frames waiting
// in its socket: a batch allocates nothing.
func TestNoAllocationsPerPacket(t *testing.T) {
	tp := newTopo(t, map[uint32]ingest.Config{bufTrigger: {Buffers: 64, BufferSize: 1 << 20, Window: time.Hour}}, Config{manual: true})
	c, err := ingest.Open(tp.rings[bufTrigger].Name(), ingest.ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := tp.sender(false, 5001, portTrigger)
	var buf [1500]byte
	const n = 22 * 64
	for seq := range uint32(n) {
		s.Send(triggerPayload(buf[:], s.Port, seq))
	}
	q := tp.eng.queues[0]
	// The frames are in the RX ring once the program counted them.
	deadline := time.Now().Add(5 * time.Second)
	for cs, _ := tp.prog.Counters(); cs.Verdicts[classifier.VerdictIngest].Packets < n; cs, _ = tp.prog.Counters() {
		if time.Now().After(deadline) {
			t.Fatalf("the program ingested %d of %d", cs.Verdicts[classifier.VerdictIngest].Packets, n)
		}
		time.Sleep(time.Millisecond)
	}
	q.poll() // the first batch may fault in the ring's pages
	allocs := testing.AllocsPerRun(20, func() {
		if q.poll() == 0 {
			panic("no frames waiting")
		}
		tp.eng.tick()
	})
	if allocs != 0 {
		t.Errorf("%v allocations per batch of %d frames", allocs, 64)
	}
	if st := tp.eng.Stats(); st.Appended != 22*64 {
		t.Errorf("engine %+v", st)
	}
}
