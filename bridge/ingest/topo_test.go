package ingest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
	fingest "github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/netns"
	"github.com/fabricbridge/fabricbridge/internal/testenv"
)

// topo is the test topology: the XDP classifier and the engine on end A of
// a veth in namespace br, kernel UDP senders on end B in namespace out.
type topo struct {
	t       testing.TB
	br, out *netns.NS
	v       *netns.Veth
	prog    *fbebpf.Program
	eng     *Engine
	rings   map[uint32]*fingest.Ring
}

// Ingest rules of the standard topology: UDP to ports 9000-9003 goes to
// buffer 10, to port 9100 to buffer 11; port 9200 ingests into buffer 12,
// which has no ring.
const (
	ruleTrigger = 20
	ruleOther   = 21
	ruleNoRing  = 22
	bufTrigger  = 10
	bufOther    = 11
	bufNoRing   = 12
	portTrigger = 9000
	portOther   = 9100
	portNoRing  = 9200
)

var standardRules = []classifier.Rule{
	{ID: ruleTrigger, Protocol: classifier.ProtoUDP, DstPorts: classifier.PortRange{Lo: portTrigger, Hi: portTrigger + 3}, Action: classifier.ActionIngest, Stream: bufTrigger},
	{ID: ruleOther, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(portOther), Action: classifier.ActionIngest, Stream: bufOther},
	{ID: ruleNoRing, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(portNoRing), Action: classifier.ActionIngest, Stream: bufNoRing},
}

// newTopo builds the topology with a ring per entry of rings (buffer id ->
// ring configuration; names are filled in) and the engine configured by
// ecfg (Program and Ifindex are filled in).
func newTopo(t testing.TB, rings map[uint32]fingest.Config, ecfg Config) *topo {
	return newTopoWith(t, netns.VethOptions{}, rings, ecfg)
}

// newTopoWith is newTopo on a veth made with opts.
func newTopoWith(t testing.TB, opts netns.VethOptions, rings map[uint32]fingest.Config, ecfg Config) *topo {
	testenv.RequirePrivileged(t)
	br, out, v := netns.Pair(t, opts)
	tp := &topo{t: t, br: br, out: out, v: v, rings: map[uint32]*fingest.Ring{}}
	prog, err := fbebpf.Load()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	tables, err := classifier.Compile(&classifier.RuleSet{Rules: standardRules})
	if err != nil {
		t.Fatal(err)
	}
	if err := prog.Update(tables); err != nil {
		t.Fatal(err)
	}
	if err := br.Do(func() error {
		_, err := prog.Attach(v.A.Index, fbebpf.ModeNative)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	tp.prog = prog
	dir := t.TempDir()
	for id, cfg := range rings {
		cfg.Name = filepath.Join(dir, fmt.Sprintf("buffer%d.sock", id))
		cfg.BufferID = id
		r, err := fingest.Create(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		tp.rings[id] = r
	}
	ecfg.Program, ecfg.Ifindex = prog, v.A.Index
	if err := br.Do(func() (err error) {
		tp.eng, err = Start(ecfg)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.eng.Close() })
	for id, r := range tp.rings {
		if err := tp.eng.Attach(id, r); err != nil {
			t.Fatal(err)
		}
	}
	return tp
}

// describe summarises the engine's, the rings' and the program's counters.
func (tp *topo) describe() string {
	s := fmt.Sprintf("engine %+v", tp.eng.Stats())
	for id, r := range tp.rings {
		s += fmt.Sprintf("; ring %d %+v", id, r.Stats())
	}
	if cs, err := tp.prog.Counters(); err == nil {
		s += fmt.Sprintf("; program %+v", cs)
	}
	return s
}

// sender is a kernel UDP socket in the outside namespace, bound to one
// source port.
type sender struct {
	c    *net.UDPConn
	to   netip.AddrPort
	port uint16
}

func (tp *topo) sender(v6 bool, sport, dport uint16) *sender {
	tp.t.Helper()
	local, dst := tp.v.B.Addr4.Addr(), tp.v.A.Addr4.Addr()
	if v6 {
		local, dst = tp.v.B.Addr6.Addr(), tp.v.A.Addr6.Addr()
	}
	var c *net.UDPConn
	if err := tp.out.Do(func() (err error) {
		c, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, sport)))
		return err
	}); err != nil {
		tp.t.Fatal(err)
	}
	tp.t.Cleanup(func() { c.Close() })
	return &sender{c: c, to: netip.AddrPortFrom(dst, dport), port: sport}
}

func (s *sender) send(p []byte) error {
	_, err := s.c.WriteToUDPAddrPort(p, s.to)
	return err
}

// triggerPayload is what source port sport sends as datagram seq: a
// trigger payload whose length and energies depend on both, so that any
// mix-up shows. Every 50th is the bare 4-byte sequence number, shorter than
// an Ethernet header: the XDP program cannot strip those whole.
func triggerPayload(buf []byte, sport uint16, seq uint32) []byte {
	n := int(seq*7+uint32(sport)) % 700
	if seq%50 == 0 {
		n = 0
	}
	var e [700]uint16
	for i := range n {
		e[i] = uint16(seq) ^ uint16(sport)*uint16(i+1)
	}
	return buf[:fingest.PutTriggerPayload(buf, seq, e[:n])]
}

// reader drains a ring's consumer in the background: it checks every
// record's payload with check (if set), feeds the reference consumer, and
// releases each buffer unless hold says to keep it.
type reader struct {
	c       *fingest.Consumer
	ref     fingest.Reference
	mu      sync.Mutex
	records atomic.Uint64
	bad     []string
	stop    atomic.Bool
	done    chan struct{}
	err     error

	describe func() string
}

func (tp *topo) reader(id uint32, check func(src fingest.Source, payload []byte) error) *reader {
	tp.t.Helper()
	c, err := fingest.Open(tp.rings[id].Name(), fingest.ConsumerOptions{Spin: 200 * time.Microsecond})
	if err != nil {
		tp.t.Fatal(err)
	}
	r := &reader{c: c, done: make(chan struct{}), describe: tp.describe}
	tp.t.Cleanup(func() { r.close(); c.Close() })
	go r.run(check)
	return r
}

func (r *reader) run(check func(src fingest.Source, payload []byte) error) {
	defer close(r.done)
	for !r.stop.Load() {
		b, err := r.c.Next(20 * time.Millisecond)
		if errors.Is(err, fingest.ErrTimeout) {
			continue
		}
		if err != nil {
			if !errors.Is(err, fingest.ErrClosed) {
				r.err = err
			}
			return
		}
		r.mu.Lock()
		if check != nil {
			it := b.Iter()
			for it.Next() {
				rec := it.Record()
				src, _ := r.c.Source(rec.Source)
				if err := check(src, rec.Payload); err != nil && len(r.bad) < 10 {
					r.bad = append(r.bad, err.Error())
				}
			}
		}
		if err := r.ref.Process(&b); err != nil {
			r.err = err
			r.mu.Unlock()
			return
		}
		r.mu.Unlock()
		r.records.Add(uint64(b.Records))
		if err := r.c.Release(&b); err != nil {
			r.err = err
			return
		}
	}
}

// debug is set by the topology to describe the engine and rings when a
// wait fails.
func (r *reader) debug() string {
	if r.describe == nil {
		return ""
	}
	return r.describe()
}

// close stops the reader (the consumer stays open for inspection).
func (r *reader) close() {
	if r.stop.Swap(true) {
		return
	}
	<-r.done
}

// waitRecords waits until the reader has seen n records.
func (r *reader) waitRecords(t testing.TB, n uint64, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for r.records.Load() < n {
		select {
		case <-r.done:
			t.Fatalf("the consumer stopped after %d of %d records: %v (%v)", r.records.Load(), n, r.err, r.debug())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the consumer saw %d of %d records (%v)", r.records.Load(), n, r.debug())
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// checkTrigger verifies a payload byte for byte against what its source
// port sends under the sequence number it carries.
func checkTrigger(src fingest.Source, p []byte) error {
	if len(p) < 4 {
		return fmt.Errorf("%v: %d-byte payload", src, len(p))
	}
	var buf [1500]byte
	want := triggerPayload(buf[:], src.SrcPort, binary.BigEndian.Uint32(p))
	if !bytes.Equal(p, want) {
		return fmt.Errorf("%v: payload % x, want % x", src, p[:min(len(p), 16)], want[:min(len(want), 16)])
	}
	return nil
}
