// Package nft realises classifier.Tables in the kernel's nftables, for the
// bridge's AF_PACKET path: there the kernel receives every frame (packet
// sockets are taps), so it would answer steered TCP with resets and steered
// UDP with ICMP port unreachable, and it would see what drop rules drop: an
// application could tell the path in use. Taps run before netfilter's
// netdev ingress hook, so a netdev-family table on the interface that drops
// what the classifier steers or drops, after the tap has copied it, hides
// those frames from the kernel. The table mirrors the classifier's
// precedence:
//
//	exact flows        (set, per family)      → drop
//	listeners on addr  (set, per family)      → drop
//	wildcard listeners (set, per family)      → drop
//	rules in order     (chain "rules")        → drop (steer, drop, ingest while fed) or accept (pass, ingest)
//	anything else                              → accept (the kernel's)
//
// Ingest rules accept until the bridge feeds an offload engine (on the XDP
// path too, an ingest frame with no ingest socket goes to the kernel); from
// then on they drop, or the kernel would answer every trigger datagram with
// a port unreachable and a connected sender would lose the next one to
// ECONNREFUSED. The table cannot check UDP lengths, so with an engine fed,
// an ingest-matched datagram the classifier calls malformed (a fragment, a
// bad length) is dropped rather than passed to the kernel.
//
// Where nftables and the classifier part ways (documented in package
// bridge): later fragments reach the kernel (it cannot reassemble them
// without the dropped first fragment and discards them silently); a frame
// with two VLAN tags is not IP to the netdev hook and reaches the kernel
// (which has no device for it unless one was made); malformed TCP/UDP
// headers the classifier passes may be dropped (the kernel would drop them
// too).
//
// Changes go through the nft binary (Debian package nftables), one
// `nft -f -` transaction per update, so every frame meets the old rules or
// the new ones. Sets are updated by difference; the rules chain is flushed
// and refilled in the same transaction. Flow deltas (AddFlows,
// RemoveFlows) skip nft: they are set elements sent over netfilter's
// netlink socket, also one transaction each, in order with the updates.
package nft

import (
	"bytes"
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/vishvananda/netns"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// TableName is the name of the table on interface ifname; a restart after
// a crash finds it by this name and replaces it.
func TableName(ifname string) string {
	var b strings.Builder
	b.WriteString("fabricbridge_")
	for _, r := range ifname {
		if r < 0x80 && (r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return b.String()
}

// elementSets are the element lists of the table's listener sets, by set
// name.
type elementSets map[string]map[string]struct{}

// installed is what the kernel's sets hold: the listener sets' elements as
// nft writes them, and the flows, by key (no pointers for the collector to
// follow however many flows there are, and no text made for a delta).
type installed struct {
	sets  elementSets
	flows map[classifier.FlowKey]struct{}
}

var setTypes = [...]struct{ name, typ, match string }{
	{"flows4", "inet_proto . ipv4_addr . inet_service . ipv4_addr . inet_service", "meta l4proto . ip saddr . th sport . ip daddr . th dport"},
	{"flows6", "inet_proto . ipv6_addr . inet_service . ipv6_addr . inet_service", "meta l4proto . ip6 saddr . th sport . ip6 daddr . th dport"},
	{"listen4", "inet_proto . ipv4_addr . inet_service", "meta l4proto . ip daddr . th dport"},
	{"listen6", "inet_proto . ipv6_addr . inet_service", "meta l4proto . ip6 daddr . th dport"},
	{"any4", "inet_proto . inet_service", "meta protocol ip meta l4proto . th dport"},
	{"any6", "inet_proto . inet_service", "meta protocol ip6 meta l4proto . th dport"},
}

func protoName(p uint8) string {
	switch classifier.Protocol(p) {
	case classifier.ProtoTCP:
		return "tcp"
	case classifier.ProtoUDP:
		return "udp"
	}
	return fmt.Sprint(p)
}

func addrOf(family uint8, a classifier.Addr16) netip.Addr {
	if family == 4 {
		return netip.AddrFrom4([4]byte(a[:4]))
	}
	return netip.AddrFrom16(a)
}

// flowElement is the set and element that hide flow k from the kernel.
func flowElement(k classifier.FlowKey) (set, elem string) {
	set = "flows4"
	if k.Family == 6 {
		set = "flows6"
	}
	return set, fmt.Sprintf("%s . %s . %d . %s . %d", protoName(k.Proto), addrOf(k.Family, k.Src), k.SrcPort, addrOf(k.Family, k.Dst), k.DstPort)
}

// isFlowSet says whether set name holds flows.
func isFlowSet(name string) bool { return strings.HasPrefix(name, "flows") }

// elements lists the listener set elements that tables t needs.
func elements(t *classifier.Tables) elementSets {
	s := elementSets{}
	for _, st := range setTypes {
		if !isFlowSet(st.name) {
			s[st.name] = map[string]struct{}{}
		}
	}
	for k := range t.Listeners() {
		f := "4"
		if k.Family == 6 {
			f = "6"
		}
		if k.Addr == (classifier.Addr16{}) {
			s["any"+f][fmt.Sprintf("%s . %d", protoName(k.Proto), k.Port)] = struct{}{}
		} else {
			s["listen"+f][fmt.Sprintf("%s . %s . %d", protoName(k.Proto), addrOf(k.Family, k.Addr), k.Port)] = struct{}{}
		}
	}
	return s
}

// ruleBody renders one compiled rule as an nft rule body.
func ruleBody(r classifier.CompiledRule, ingestFed bool) string {
	var b strings.Builder
	if r.VLAN != 0 {
		// The tag as the link-layer header shows it (nft rebuilds a tag
		// the kernel took off), 802.1Q or 802.1ad alike, as the classifier
		// takes either; "vlan id" would mean 802.1Q only.
		fmt.Fprintf(&b, "@ll,96,16 { 0x8100, 0x88a8 } @ll,116,12 %d ", r.VLAN)
	}
	ip := ""
	switch r.Family {
	case 4:
		ip = "ip"
	case 6:
		ip = "ip6"
	}
	if ip != "" {
		fmt.Fprintf(&b, "meta protocol %s ", ip)
	}
	for _, p := range []struct {
		dir       string
		net, mask classifier.Addr16
	}{{"saddr", r.SrcNet, r.SrcMask}, {"daddr", r.DstNet, r.DstMask}} {
		ones := 0
		for _, m := range p.mask {
			ones += bits.OnesCount8(m)
		}
		if ones > 0 {
			fmt.Fprintf(&b, "%s %s %s/%d ", ip, p.dir, addrOf(r.Family, p.net), ones)
		}
	}
	if r.Proto != 0 {
		fmt.Fprintf(&b, "meta l4proto %s ", protoName(r.Proto))
	} else {
		b.WriteString("meta l4proto { tcp, udp } ")
	}
	for _, p := range []struct {
		dir string
		r   classifier.PortRange
	}{{"sport", r.SrcPorts}, {"dport", r.DstPorts}} {
		switch {
		case p.r.IsAny():
		case p.r.Lo == p.r.Hi:
			fmt.Fprintf(&b, "th %s %d ", p.dir, p.r.Lo)
		default:
			fmt.Fprintf(&b, "th %s %d-%d ", p.dir, p.r.Lo, p.r.Hi)
		}
	}
	switch {
	case r.Action == classifier.ActionSteer, r.Action == classifier.ActionDrop, r.Action == classifier.ActionIngest && ingestFed:
		b.WriteString("drop")
	default:
		b.WriteString("accept")
	}
	fmt.Fprintf(&b, " comment \"rule %d\"", r.ID)
	return b.String()
}

// transaction renders the transaction that takes the table from the sets in
// prev (nil: the table does not exist, or is a leftover to replace) to
// tables t, and returns it with the sets it leaves. ingestFed: an ingest
// engine takes the ingest rules' frames.
func transaction(table, ifname string, prev *installed, t *classifier.Tables, ingestFed bool) (string, *installed) {
	next := &installed{sets: elements(t), flows: make(map[classifier.FlowKey]struct{}, t.NumFlows())}
	for k := range t.Flows() {
		next.flows[k] = struct{}{}
	}
	var b strings.Builder
	if prev == nil {
		// "add" then "delete" removes a leftover and is no error when
		// there is none; the table is then made whole.
		fmt.Fprintf(&b, "add table netdev %s\ndelete table netdev %s\n", table, table)
		fmt.Fprintf(&b, "table netdev %s {\n", table)
		for _, st := range setTypes {
			fmt.Fprintf(&b, "\tset %s { type %s; }\n", st.name, st.typ)
		}
		b.WriteString("\tchain rules {\n\t}\n")
		fmt.Fprintf(&b, "\tchain ingress {\n\t\ttype filter hook ingress device %q priority -500; policy accept;\n", ifname)
		// A later fragment has no ports (nft would read payload bytes as
		// ports): it goes to the kernel, whose datagram it may be.
		b.WriteString("\t\tip frag-off & 0x1fff != 0 accept\n\t\tfrag frag-off != 0 accept\n")
		for _, st := range setTypes {
			fmt.Fprintf(&b, "\t\t%s @%s drop\n", st.match, st.name)
		}
		b.WriteString("\t\tjump rules\n\t}\n}\n")
		prev = &installed{}
	}
	// Only the flows that change are written out.
	deleted, added := flowsMissing(prev.flows, next.flows), flowsMissing(next.flows, prev.flows)
	for _, st := range setTypes {
		del, add := deleted[st.name], added[st.name]
		for e := range prev.sets[st.name] {
			if _, ok := next.sets[st.name][e]; !ok {
				del = append(del, e)
			}
		}
		for e := range next.sets[st.name] {
			if _, ok := prev.sets[st.name][e]; !ok {
				add = append(add, e)
			}
		}
		slices.Sort(del)
		slices.Sort(add)
		if len(del) > 0 {
			fmt.Fprintf(&b, "delete element netdev %s %s { %s }\n", table, st.name, strings.Join(del, ", "))
		}
		if len(add) > 0 {
			fmt.Fprintf(&b, "add element netdev %s %s { %s }\n", table, st.name, strings.Join(add, ", "))
		}
	}
	fmt.Fprintf(&b, "flush chain netdev %s rules\n", table)
	for _, r := range t.Rules() {
		fmt.Fprintf(&b, "add rule netdev %s rules %s\n", table, ruleBody(r, ingestFed))
	}
	return b.String(), next
}

// flowsMissing is the elements, by set, of the flows of from that to
// lacks.
func flowsMissing(from, to map[classifier.FlowKey]struct{}) map[string][]string {
	out := map[string][]string{}
	for k := range from {
		if _, ok := to[k]; !ok {
			set, e := flowElement(k)
			out[set] = append(out[set], e)
		}
	}
	return out
}

// findNft finds the nft binary.
func findNft() (string, error) {
	if p, err := exec.LookPath("nft"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/nft", "/sbin/nft"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("the nft binary (Debian package nftables) is not installed")
}

// runner runs nft in one network namespace: on its own OS thread, moved
// into the namespace once and never given back to the runtime (the thread
// ends with the runner), so nft sees the table's interface whichever thread
// calls; the netlink socket for flow elements is opened there too. Starting
// nft costs milliseconds whatever the script, so requests that queue up
// while one runs go together as one transaction (a group commit), scripts
// with scripts and element changes with element changes; if that fails,
// each is run again alone, so that one request's error is its own.
type runner struct {
	path  string
	elems *elemConn
	reqs  chan request
}

type request struct {
	script string
	elems  *elemChange // set: a change of flow elements of table, not a script
	table  string
	done   chan error
	out    *bytes.Buffer // set: the output is wanted, and the request runs alone
}

func newRunner(ns netns.NsHandle) (*runner, error) {
	path, err := findNft()
	if err != nil {
		return nil, err
	}
	r := &runner{path: path, reqs: make(chan request, maxGroup)}
	started := make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with us
		if err := netns.Set(ns); err != nil {
			started <- fmt.Errorf("enter the interface's network namespace: %w", err)
			return
		}
		if r.elems, err = openElemConn(); err != nil {
			started <- err
			return
		}
		defer r.elems.close()
		started <- nil
		req, ok := <-r.reqs
		for ok {
			var batch []request
			var led bool
			batch, req, led = r.gather(req)
			r.runBatch(batch)
			if !led {
				req, ok = <-r.reqs
			}
		}
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return r, nil
}

// maxGroup bounds the requests run as one transaction, maxGroupFlows the
// flow elements.
const (
	maxGroup      = 256
	maxGroupFlows = 16384
)

// gather takes first and whatever requests of its kind are queued behind
// it, and returns them with the request that ended the group and leads
// the next (led false: none). A request that wants nft's output runs
// alone.
func (r *runner) gather(first request) (batch []request, next request, led bool) {
	batch = []request{first}
	flows := 0
	if first.elems != nil {
		flows = len(first.elems.flows)
	}
	for len(batch) < maxGroup && flows < maxGroupFlows && first.out == nil {
		select {
		case req, open := <-r.reqs:
			if !open {
				return batch, request{}, false
			}
			if req.out != nil || (req.elems == nil) != (first.elems == nil) || req.table != first.table {
				return batch, req, true
			}
			batch = append(batch, req)
			if req.elems != nil {
				flows += len(req.elems.flows)
			}
		default:
			return batch, request{}, false
		}
	}
	return batch, request{}, false
}

func (r *runner) runBatch(batch []request) {
	if len(batch) > 1 {
		var err error
		if batch[0].elems != nil {
			changes := make([]elemChange, len(batch))
			for i, req := range batch {
				changes[i] = *req.elems
			}
			err = r.elems.apply(batch[0].table, changes)
		} else {
			var all strings.Builder
			for _, req := range batch {
				all.WriteString(req.script)
			}
			err = r.exec(all.String())
		}
		if err == nil {
			for _, req := range batch {
				req.done <- nil
			}
			return
		}
	}
	for _, req := range batch {
		if req.elems != nil {
			req.done <- r.elems.apply(req.table, []elemChange{*req.elems})
			continue
		}
		out := req.out
		if out == nil {
			out = new(bytes.Buffer)
		}
		req.done <- r.execTo(req.script, out)
	}
}

func (r *runner) exec(script string) error {
	var out bytes.Buffer
	return r.execTo(script, &out)
}

func (r *runner) execTo(script string, out *bytes.Buffer) error {
	cmd := exec.Command(r.path, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %v: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// capture runs script on the runner's thread, alone, and hands back what
// nft printed.
func (r *runner) capture(script string, out *bytes.Buffer) error {
	done := make(chan error, 1)
	r.reqs <- request{script: script, done: done, out: out}
	return <-done
}

// run runs one transaction.
func (r *runner) run(script string) error { return <-r.submit(script) }

// submit queues one transaction; its result arrives on the channel.
// Transactions run in the order they were submitted.
func (r *runner) submit(script string) <-chan error {
	done := make(chan error, 1)
	r.reqs <- request{script: script, done: done}
	return done
}

// submitElems queues a change of table's flow elements, in order with
// the transactions submitted before it.
func (r *runner) submitElems(table string, ch elemChange) <-chan error {
	done := make(chan error, 1)
	r.reqs <- request{elems: &ch, table: table, done: done}
	return done
}

func (r *runner) close() { close(r.reqs) }

// Table is the nftables table that realises classification tables on one
// interface. Its methods are safe for concurrent use; flow changes must not
// race an Update that concerns the same flows (the caller orders those).
type Table struct {
	run    *runner
	table  string
	ifname string
	mu     sync.Mutex // sets and ingestFed; held from deciding a change to queueing it
	sets   *installed // what the kernel's sets hold (or will, once queued changes ran)
	// ingestFed: ingest rules drop (see the package description).
	ingestFed bool
}

// Open installs the table for t on interface ifname of namespace ns,
// replacing any leftover of an earlier run. Ingest rules accept until
// UpdateIngestFed says an engine is fed.
func Open(ns netns.NsHandle, ifname string, t *classifier.Tables) (*Table, error) {
	run, err := newRunner(ns)
	if err != nil {
		return nil, err
	}
	h := &Table{run: run, table: TableName(ifname), ifname: ifname}
	if err := h.Update(t); err != nil {
		run.close()
		return nil, err
	}
	return h, nil
}

// Update makes the table match t in one transaction. On failure the old
// state stays (nft transactions are all or nothing).
func (h *Table) Update(t *classifier.Tables) error {
	return h.UpdateIngestFed(t, h.ingestFed)
}

// UpdateIngestFed is Update that also decides the ingest rules' fate: with
// ingestFed they drop, as an offload engine takes their frames.
func (h *Table) UpdateIngestFed(t *classifier.Tables, ingestFed bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	script, next := transaction(h.table, h.ifname, h.sets, t, ingestFed)
	if err := h.run.run(script); err != nil {
		return fmt.Errorf("hiding steered frames from the kernel: %w", err)
	}
	h.sets, h.ingestFed = next, ingestFed
	return nil
}

// AddFlows hides flows from the kernel, one set element each, in one
// transaction: the delta of a flow claim. Flows already hidden are left.
func (h *Table) AddFlows(flows []classifier.Flow) error {
	return h.changeFlows(flows, true)
}

// flowChunk bounds the elements one transaction of RemoveFlows deletes, so
// that other applications' claims interleave with a large release.
const flowChunk = 4096

// RemoveFlows shows flows to the kernel again; flows not hidden are left.
func (h *Table) RemoveFlows(flows []classifier.Flow) error {
	for len(flows) > 0 {
		n := min(len(flows), flowChunk)
		if err := h.changeFlows(flows[:n], false); err != nil {
			return err
		}
		flows = flows[n:]
	}
	return nil
}

func (h *Table) changeFlows(flows []classifier.Flow, add bool) error {
	changed := make([]classifier.FlowKey, 0, len(flows))
	h.mu.Lock()
	for _, f := range flows {
		k := f.Key()
		if _, ok := h.sets.flows[k]; ok != add {
			changed = append(changed, k)
			if add {
				h.sets.flows[k] = struct{}{}
			} else {
				delete(h.sets.flows, k)
			}
		}
	}
	if len(changed) == 0 {
		h.mu.Unlock()
		return nil
	}
	done := h.run.submitElems(h.table, elemChange{flows: changed, add: add}) // queued under mu: in order with Update
	h.mu.Unlock()
	if err := <-done; err != nil {
		h.mu.Lock()
		for _, k := range changed {
			if add {
				delete(h.sets.flows, k)
			} else {
				h.sets.flows[k] = struct{}{}
			}
		}
		h.mu.Unlock()
		return fmt.Errorf("hiding steered frames from the kernel: %w", err)
	}
	return nil
}

// Elements lists, by set name, the elements the table needs for t, in the
// form Installed reads them back.
func Elements(t *classifier.Tables) map[string][]string {
	out := map[string][]string{}
	for set, els := range elements(t) {
		for e := range els {
			out[set] = append(out[set], e)
		}
	}
	for k := range t.Flows() {
		set, e := flowElement(k)
		out[set] = append(out[set], e)
	}
	for set := range out {
		slices.Sort(out[set])
	}
	return out
}

// Installed reads the table's set elements back from the kernel, by set
// name, sorted.
func (h *Table) Installed() (map[string][]string, error) {
	out := map[string][]string{}
	for _, st := range setTypes {
		var listing bytes.Buffer
		if err := h.run.capture(fmt.Sprintf("list set netdev %s %s\n", h.table, st.name), &listing); err != nil {
			return nil, err
		}
		text := listing.String()
		i := strings.Index(text, "elements = {")
		if i < 0 {
			continue
		}
		text = text[i+len("elements = {"):]
		text = text[:strings.Index(text, "}")]
		for _, e := range strings.Split(text, ",") {
			if e = strings.Join(strings.Fields(e), " "); e != "" {
				out[st.name] = append(out[st.name], e)
			}
		}
		slices.Sort(out[st.name])
	}
	return out, nil
}

// Close removes the table.
func (h *Table) Close() error {
	err := h.run.run(fmt.Sprintf("delete table netdev %s\n", h.table))
	h.run.close()
	return err
}

// RemoveLeftover deletes the table a crashed run may have left on the
// interface (on any path: a stale table would hide frames from the kernel
// that nobody steers any more). No nft binary means no table to remove.
func RemoveLeftover(ns netns.NsHandle, ifname string) error {
	if _, err := findNft(); err != nil {
		return nil
	}
	run, err := newRunner(ns)
	if err != nil {
		return err
	}
	defer run.close()
	t := TableName(ifname)
	return run.run(fmt.Sprintf("add table netdev %s\ndelete table netdev %s\n", t, t))
}
