package classifier

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// Limits shared with the XDP program; the ebpf package checks that its C
// constants agree.
const (
	// MaxRules is the number of prefix/range rules one rule set may hold.
	MaxRules = 1024
	// MaxRuleID is the largest rule id. Ids index per-rule counters, so the
	// bound keeps those arrays small on machines with many CPUs.
	MaxRuleID = 16383
	// MaxExtHeaders is how many IPv6 extension headers the parser walks.
	MaxExtHeaders = 8
)

// Protocol is an IP protocol number; only TCP and UDP are classified.
type Protocol uint8

// Protocols a rule can name. ProtoAny matches both TCP and UDP.
const (
	ProtoAny Protocol = 0
	ProtoTCP Protocol = 6
	ProtoUDP Protocol = 17
)

func (p Protocol) String() string {
	switch p {
	case ProtoAny:
		return "any"
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	}
	return fmt.Sprintf("proto(%d)", uint8(p))
}

// Action is what a rule does with the packets it matches.
type Action uint8

// Actions. The zero value is invalid so that a forgotten action is an error,
// not a silent pass.
const (
	ActionSteer  Action = 1 // deliver to the rule's stream
	ActionIngest Action = 2 // UDP offload into the rule's ingest buffer
	ActionPass   Action = 3 // hand to the kernel
	ActionDrop   Action = 4 // discard
)

func (a Action) String() string {
	switch a {
	case ActionSteer:
		return "steer"
	case ActionIngest:
		return "ingest"
	case ActionPass:
		return "pass"
	case ActionDrop:
		return "drop"
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// PortRange is an inclusive range of ports. The zero value matches any port.
type PortRange struct {
	Lo, Hi uint16
}

// AnyPort matches every port.
var AnyPort = PortRange{}

// Port is the range holding exactly p.
func Port(p uint16) PortRange { return PortRange{p, p} }

// IsAny reports whether r matches every port.
func (r PortRange) IsAny() bool { return r == PortRange{} || r == PortRange{0, 65535} }

// Contains reports whether p lies in r.
func (r PortRange) Contains(p uint16) bool { return r.IsAny() || (r.Lo <= p && p <= r.Hi) }

// Rule is an ordered match on header fields. Zero-valued fields match
// anything.
type Rule struct {
	ID       uint32 // 1..MaxRuleID, unique across rules and listeners
	Priority uint32 // lower is matched first
	VLAN     uint16 // innermost VLAN id; 0 matches any
	// IPVersion is 4 or 6, or 0 for either. A prefix implies its family.
	IPVersion uint8
	Protocol  Protocol
	Src, Dst  netip.Prefix // zero matches any
	SrcPorts  PortRange
	DstPorts  PortRange
	Action    Action
	// Stream is the stream (steer) or ingest buffer (ingest) id; it must be 0
	// for pass and drop.
	Stream uint32
}

// Listener claims every packet to a local address and port, the way a
// listening socket does. An invalid (zero) Addr listens on the wildcard
// address of both families; 0.0.0.0 or :: on the wildcard of one.
type Listener struct {
	ID       uint32
	Protocol Protocol // TCP or UDP
	Addr     netip.Addr
	Port     uint16
	Stream   uint32
	// Spread, when set, shares the listener among several instances of
	// one application: a packet goes to the current owner of its flow's
	// slot instead of Stream. Stream is then one of the instances (any).
	Spread *Spread
}

// Spread is one listener's consistent-hash table (maglev.Chain in stream
// ids): a packet goes to the stream that owns the slot of
// maglev.FlowHash(Seed, protocol, source, destination, ports) modulo
// len(Slots). Every box builds the same Spread from the same instance set,
// so which box a router picks does not matter.
type Spread struct {
	Seed  uint64
	Slots []Slot // maglev.DefaultSize of them in the data plane
}

// Slot is one entry of a Spread. Previous is the stream that owned the
// slot before it last changed hands (0: none, or the same as Current). A
// packet steered by a slot with a Previous carries FlagSecondChance: if
// Current does not know its connection, the bridge hands it to Previous
// (see fabric.MarkMayReturn).
type Slot struct{ Current, Previous uint32 }

// Flow is one established conversation, named from the receiver's side:
// packets from Remote to Local.
type Flow struct {
	// ID is the counter the flow's packets are counted under. Unlike rule
	// and listener ids it need not be unique: the connections of one
	// listener typically share its id.
	ID       uint32
	Protocol Protocol // TCP or UDP
	Remote   netip.AddrPort
	Local    netip.AddrPort
	Stream   uint32
}

// RuleSet is everything the classifier matches on. It is plain data; Compile
// checks it and builds the lookup tables.
type RuleSet struct {
	Flows     []Flow
	Listeners []Listener
	Rules     []Rule
}

// Validate reports every problem with s at once, so a bad configuration can
// be fixed in one pass.
func (s *RuleSet) Validate() error {
	var errs []error
	ids := make(map[uint32]string)
	claimID := func(id uint32, what string) {
		switch {
		case id == 0 || id > MaxRuleID:
			errs = append(errs, fmt.Errorf("%s: id %d outside 1..%d", what, id, MaxRuleID))
		case ids[id] != "":
			errs = append(errs, fmt.Errorf("%s: id %d already used by %s", what, id, ids[id]))
		default:
			ids[id] = what
		}
	}
	if len(s.Rules) > MaxRules {
		errs = append(errs, fmt.Errorf("%d rules: at most %d", len(s.Rules), MaxRules))
	}
	flowKeys := make(map[FlowKey]uint32)
	for i, f := range s.Flows {
		what := fmt.Sprintf("flow %d (id %d)", i, f.ID)
		errs = append(errs, f.check(what)...)
		if !f.Remote.IsValid() || !f.Local.IsValid() || f.Remote.Addr().Is4() != f.Local.Addr().Is4() {
			continue
		}
		if k := f.Key(); flowKeys[k] != 0 {
			errs = append(errs, fmt.Errorf("%s: same tuple as flow id %d", what, flowKeys[k]))
		} else {
			flowKeys[k] = f.ID
		}
	}
	listenKeys := make(map[ListenKey]uint32)
	for i, l := range s.Listeners {
		what := fmt.Sprintf("listener %d (id %d)", i, l.ID)
		claimID(l.ID, what)
		if l.Protocol != ProtoTCP && l.Protocol != ProtoUDP {
			errs = append(errs, fmt.Errorf("%s: protocol must be tcp or udp, not %v", what, l.Protocol))
		}
		if l.Port == 0 {
			errs = append(errs, fmt.Errorf("%s: port must not be 0", what))
		}
		if l.Spread != nil {
			errs = append(errs, l.Spread.validate(what)...)
		}
		if l.Stream == 0 {
			errs = append(errs, fmt.Errorf("%s: stream must not be 0", what))
		}
		for _, k := range keysOfListener(l) {
			if listenKeys[k] != 0 {
				errs = append(errs, fmt.Errorf("%s: %v port %d already held by listener id %d", what, l.Protocol, l.Port, listenKeys[k]))
				break
			}
			listenKeys[k] = l.ID
		}
	}
	for i, r := range s.Rules {
		what := fmt.Sprintf("rule %d (id %d)", i, r.ID)
		claimID(r.ID, what)
		errs = append(errs, r.check(what)...)
	}
	return errors.Join(errs...)
}

func (r *Rule) check(what string) []error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf(what+": "+format, args...))
	}
	switch r.Action {
	case ActionSteer, ActionIngest:
		if r.Stream == 0 {
			bad("%v needs a stream id", r.Action)
		}
	case ActionPass, ActionDrop:
		if r.Stream != 0 {
			bad("%v takes no stream id (got %d)", r.Action, r.Stream)
		}
	default:
		bad("unknown action %d", uint8(r.Action))
	}
	if r.Action == ActionIngest && r.Protocol != ProtoUDP {
		bad("ingest needs protocol udp")
	}
	if r.Protocol != ProtoAny && r.Protocol != ProtoTCP && r.Protocol != ProtoUDP {
		bad("protocol must be tcp, udp or any, not %v", r.Protocol)
	}
	if r.VLAN > 4094 {
		bad("vlan %d outside 0..4094", r.VLAN)
	}
	if r.IPVersion != 0 && r.IPVersion != 4 && r.IPVersion != 6 {
		bad("ip version %d is not 4, 6 or 0", r.IPVersion)
	}
	fam := r.IPVersion
	for _, p := range []netip.Prefix{r.Src, r.Dst} {
		if p == (netip.Prefix{}) {
			continue
		}
		if !p.IsValid() {
			bad("invalid prefix %v", p)
			continue
		}
		v := uint8(6)
		if p.Addr().Is4() {
			v = 4
		}
		if p.Addr().Is4In6() {
			bad("prefix %v: write IPv4 prefixes in dotted form", p)
		}
		if fam != 0 && fam != v {
			bad("prefix %v does not belong to IPv%d", p, fam)
		}
		fam = v
	}
	for _, pr := range []PortRange{r.SrcPorts, r.DstPorts} {
		if pr.Lo > pr.Hi {
			bad("port range %d-%d is empty", pr.Lo, pr.Hi)
		}
	}
	return errs
}

// Compile validates s and builds the tables the reference classifier looks
// up. The result is immutable and may be shared by many Classifiers; package
// ebpf loads the same tables into the XDP program's maps.
func Compile(s *RuleSet) (*Tables, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	t := &Tables{
		flows:     newFlowTable(len(s.Flows)),
		listeners: make(map[ListenKey]Target, len(s.Listeners)),
		rules:     make([]CompiledRule, 0, len(s.Rules)),
	}
	for _, f := range s.Flows {
		t.flows.put(f.Key(), Target{Stream: f.Stream, Rule: f.ID})
	}
	for _, l := range s.Listeners {
		for _, k := range keysOfListener(l) {
			t.listeners[k] = Target{Stream: l.Stream, Rule: l.ID}
			if l.Spread != nil {
				if t.spreads == nil {
					t.spreads = make(map[ListenKey]*Spread)
				}
				t.spreads[k] = l.Spread
			}
		}
	}
	for _, r := range SortRules(s.Rules) {
		t.rules = append(t.rules, compileRule(r))
	}
	return t, nil
}

// SortRules returns the rules in the order they are matched.
func SortRules(rules []Rule) []Rule {
	sorted := slices.Clone(rules)
	slices.SortStableFunc(sorted, func(a, b Rule) int {
		return cmp.Or(cmp.Compare(a.Priority, b.Priority), cmp.Compare(a.ID, b.ID))
	})
	return sorted
}

// Addr16 is an address as the tables store it: IPv6 in network order, IPv4 in
// the first four bytes and zeros after, the family kept beside it.
type Addr16 [16]byte

// ToAddr16 converts a to the table form.
func ToAddr16(a netip.Addr) Addr16 {
	var out Addr16
	if a.Is4() {
		b := a.As4()
		copy(out[:], b[:])
	} else {
		out = a.As16()
	}
	return out
}

// Family is 4 or 6.
func Family(a netip.Addr) uint8 {
	if a.Is4() {
		return 4
	}
	return 6
}

// FlowKey is the exact-flow table's key, named from the receiver's side:
// Src is the remote end.
type FlowKey struct {
	Family, Proto    uint8
	SrcPort, DstPort uint16
	Src, Dst         Addr16
}

// ListenKey is the listener table's key; a zero Addr is the wildcard.
type ListenKey struct {
	Family, Proto uint8
	Port          uint16
	Addr          Addr16
}

// Target is where a flow or listener sends its packets, and the id they are
// counted under.
type Target struct {
	Stream, Rule uint32
}

// CompiledRule is a Rule in the form both classifiers match it: the family
// made explicit, prefixes as masked address and mask, port ranges closed.
type CompiledRule struct {
	ID, Stream      uint32
	Action          Action
	Family, Proto   uint8 // 0 matches any
	VLAN            uint16
	SrcNet, SrcMask Addr16
	DstNet, DstMask Addr16
	SrcPorts        PortRange
	DstPorts        PortRange
}

func compileRule(r Rule) CompiledRule {
	c := CompiledRule{
		ID: r.ID, Stream: r.Stream, Action: r.Action,
		Family: r.IPVersion, Proto: uint8(r.Protocol), VLAN: r.VLAN,
		SrcPorts: closed(r.SrcPorts), DstPorts: closed(r.DstPorts),
	}
	for _, p := range []struct {
		pfx       netip.Prefix
		net, mask *Addr16
	}{{r.Src, &c.SrcNet, &c.SrcMask}, {r.Dst, &c.DstNet, &c.DstMask}} {
		if p.pfx == (netip.Prefix{}) {
			continue
		}
		c.Family = Family(p.pfx.Addr())
		base := ToAddr16(p.pfx.Addr())
		for i, bits := 0, p.pfx.Bits(); bits > 0; i, bits = i+1, bits-8 {
			p.mask[i] = 0xff
			if bits < 8 {
				p.mask[i] = ^byte(0xff >> bits)
			}
			p.net[i] = base[i] & p.mask[i]
		}
	}
	return c
}

func closed(r PortRange) PortRange {
	if r.IsAny() {
		return PortRange{0, 65535}
	}
	return r
}

// Key is f's tuple as the exact-flow tables hold it.
func (f Flow) Key() FlowKey {
	return FlowKey{
		Family: Family(f.Local.Addr()), Proto: uint8(f.Protocol),
		SrcPort: f.Remote.Port(), DstPort: f.Local.Port(),
		Src: ToAddr16(f.Remote.Addr()), Dst: ToAddr16(f.Local.Addr()),
	}
}

func keysOfListener(l Listener) []ListenKey {
	if !l.Addr.IsValid() {
		return []ListenKey{
			{Family: 4, Proto: uint8(l.Protocol), Port: l.Port},
			{Family: 6, Proto: uint8(l.Protocol), Port: l.Port},
		}
	}
	return []ListenKey{{Family: Family(l.Addr), Proto: uint8(l.Protocol), Port: l.Port, Addr: ToAddr16(l.Addr)}}
}
