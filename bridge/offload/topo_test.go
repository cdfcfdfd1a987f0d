package offload

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
	fbebpf "github.com/fabricbridge/fabricbridge/ebpf"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/ingesttest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// topo is the test topology: the XDP classifier and the engine on end A of
// a veth in namespace br, kernel UDP senders on end B in namespace out.
type topo struct {
	t       testing.TB
	br, out *topology.NS
	v       *topology.Veth
	prog    *fbebpf.Program
	eng     *Engine
	rings   map[uint32]*ingest.Ring
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
func newTopo(t testing.TB, rings map[uint32]ingest.Config, ecfg Config) *topo {
	return newTopoWith(t, topology.VethOptions{}, rings, ecfg)
}

// newTopoWith is newTopo on a veth made with opts.
func newTopoWith(t testing.TB, opts topology.VethOptions, rings map[uint32]ingest.Config, ecfg Config) *topo {
	testenv.RequirePrivileged(t)
	br, out, v := topology.Pair(t, opts)
	tp := &topo{t: t, br: br, out: out, v: v, rings: map[uint32]*ingest.Ring{}}
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
		r, err := ingest.Create(cfg)
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

// sender opens a kernel UDP sender in the outside namespace, from source
// port sport to dport on end A.
func (tp *topo) sender(v6 bool, sport, dport uint16) *ingesttest.Sender {
	tp.t.Helper()
	local, dst := tp.v.B.Addr4.Addr(), tp.v.A.Addr4.Addr()
	if v6 {
		local, dst = tp.v.B.Addr6.Addr(), tp.v.A.Addr6.Addr()
	}
	return ingesttest.NewSender(tp.t, tp.out, local, sport, netip.AddrPortFrom(dst, dport))
}

// reader drains the ring of buffer id in the background (see
// ingesttest.Reader); failures describe the topology's counters.
func (tp *topo) reader(id uint32, check func(src ingest.Source, payload []byte) error) *ingesttest.Reader {
	tp.t.Helper()
	r := ingesttest.NewReader(tp.t, tp.rings[id].Name(), check)
	r.Describe = tp.describe
	return r
}

var (
	triggerPayload = ingesttest.TriggerPayload
	checkTrigger   = ingesttest.CheckTrigger
)
