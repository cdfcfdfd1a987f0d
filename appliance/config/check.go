package config

import (
	"fmt"
	"math/bits"
	"net"
	"net/netip"
	"path/filepath"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// check validates what the types alone cannot: required fields, ranges,
// references between sections and uniqueness. It reports through d so every
// problem carries its line.
func (c *Config) check(d *decoder) {
	c.checkInterfaces(d)
	c.checkAddresses(d)
	c.checkStreams(d)
	c.checkIngest(d)
	c.checkApplications(d)
	ids := map[uint32]string{}
	c.checkListeners(d, ids)
	c.checkRules(d, ids)
	c.checkControl(d)
	c.checkBGP(d)
	c.checkSpread(d)
	if len(d.errs) == 0 {
		// The classifier's own validation is the last word; the checks
		// above should have caught everything it would refuse, with a
		// better location.
		if _, err := classifier.Compile(c.ruleSet()); err != nil {
			d.errorAt("rules", "%v", err)
		}
	}
}

func powerOfTwo(n int) bool { return n > 0 && bits.OnesCount(uint(n)) == 1 }

func (c *Config) checkInterfaces(d *decoder) {
	if len(c.Interfaces) == 0 {
		d.errorAt("interfaces", "at least one interface is required")
	}
	if len(c.Interfaces) > 1 {
		d.errorAt("interfaces[1]", "one interface per daemon: a stream is served by the bridge of one interface; run a daemon per interface, each with its own control.socket")
	}
	names := map[string]string{}
	for i, in := range c.Interfaces {
		p := fmt.Sprintf("interfaces[%d]", i)
		switch {
		case in.Name == "":
			d.errorAt(p+".name", "required")
		case len(in.Name) > 15:
			d.errorAt(p+".name", "%q is longer than an interface name can be (15 bytes)", in.Name)
		case names[in.Name] != "":
			d.errorAt(p+".name", "%q is already configured at %s", in.Name, names[in.Name])
		default:
			names[in.Name] = p
		}
		checkIndexList(d, p+".queues", "queue", in.Queues)
		if in.FrameSize != 2048 && in.FrameSize != 4096 {
			d.errorAt(p+".frame_size", "must be 2048 or 4096, not %d", in.FrameSize)
		}
		if !powerOfTwo(in.Frames) || in.Frames < 64 || in.Frames > 1<<20 {
			d.errorAt(p+".frames", "must be a power of two from 64 to 1048576, not %d", in.Frames)
		}
		if in.IngestPriority < 0 || in.IngestPriority > 99 {
			d.errorAt(p+".ingest_priority", "must be a real-time priority from 1 to 99, or 0 for none, not %d", in.IngestPriority)
		}
		checkIndexList(d, p+".cpus", "CPU", in.CPUs)
		if in.RouteCache < 16 || in.RouteCache > MaxRouteCache {
			d.errorAt(p+".route_cache", "must be from 16 to %d destinations, not %d", MaxRouteCache, in.RouteCache)
		}
		if in.FlowCapacity < MinFlowCapacity || in.FlowCapacity > MaxFlowCapacity {
			d.errorAt(p+".flow_capacity", "must be from %d to %d flows, not %d", MinFlowCapacity, MaxFlowCapacity, in.FlowCapacity)
		}
	}
}

// checkIndexList checks a list of queue or CPU numbers: each in 0-1023,
// none twice.
func checkIndexList(d *decoder, field, what string, list []int) {
	seen := map[int]bool{}
	for j, n := range list {
		at := fmt.Sprintf("%s[%d]", field, j)
		if n < 0 || n > 1023 {
			d.errorAt(at, "%s %d is out of range 0-1023", what, n)
		} else if seen[n] {
			d.errorAt(at, "%s %d is listed twice", what, n)
		}
		seen[n] = true
	}
}

func (c *Config) checkAddresses(d *decoder) {
	if len(c.Addresses) == 0 {
		d.errorAt("addresses", "at least one address is required: the addresses applications may use")
	}
	seen := map[classifier.Addr16]bool{}
	for i, a := range c.Addresses {
		p := fmt.Sprintf("addresses[%d]", i)
		switch {
		case a.IsUnspecified() || a.IsMulticast():
			d.errorAt(p, "%s cannot be an address of this box", a)
		case seen[classifier.ToAddr16(a.Addr)]:
			d.errorAt(p, "%s is listed twice", a)
		}
		seen[classifier.ToAddr16(a.Addr)] = true
	}
	if !c.ReservedPorts.IsSet() {
		d.errorAt("reserved_ports", "required")
	} else if c.ReservedPorts.Lo < 1024 {
		d.errorAt("reserved_ports", "%s reaches into the privileged ports below 1024", c.ReservedPorts)
	}
}

func checkSlots(d *decoder, field string, n int) {
	if !powerOfTwo(n) || n < 2 || n > 1<<20 {
		d.errorAt(field, "must be a power of two from 2 to 1048576, not %d", n)
	}
}

func (c *Config) checkStreams(d *decoder) {
	checkSlots(d, "streams.rx_slots", c.Streams.RxSlots)
	checkSlots(d, "streams.tx_slots", c.Streams.TxSlots)
	if s := c.Streams.SlotSize; s%64 != 0 || s < 128 || s > 65536 {
		d.errorAt("streams.slot_size", "must be a multiple of 64 from 128 to 65536, not %d", s)
	}
	for _, r := range []struct {
		field string
		slots int
	}{{"streams.rx_slots", c.Streams.RxSlots}, {"streams.tx_slots", c.Streams.TxSlots}} {
		if bytes := fabric.RingBytes(r.slots, int(c.Streams.SlotSize)); r.slots > 0 && bytes > fabric.MaxRingBytes {
			d.errorAt(r.field, "%d slots of %d bytes need a %d-byte ring, above the %d-byte limit", r.slots, int64(c.Streams.SlotSize), bytes, fabric.MaxRingBytes)
		}
	}
	if c.Streams.RxSlots > c.DefaultQuota.MaxSlots {
		d.errorAt("streams.rx_slots", "%d is above default_quota.max_slots (%d)", c.Streams.RxSlots, c.DefaultQuota.MaxSlots)
	}
	if c.Streams.TxSlots > c.DefaultQuota.MaxSlots {
		d.errorAt("streams.tx_slots", "%d is above default_quota.max_slots (%d)", c.Streams.TxSlots, c.DefaultQuota.MaxSlots)
	}
}

func (c *Config) checkIngest(d *decoder) {
	names := map[string]string{}
	for i, g := range c.Ingest {
		p := fmt.Sprintf("ingest[%d]", i)
		uniqueName(d, names, p, g.Name)
		if g.Buffers < 2 || g.Buffers > 65536 {
			d.errorAt(p+".buffers", "must be from 2 to 65536, not %d", g.Buffers)
		}
		if g.BufferSize < 4096 || g.BufferSize > 1<<30 || g.BufferSize%4096 != 0 {
			d.errorAt(p+".buffer_size", "must be a multiple of 4096 from 4K to 1G, not %d", g.BufferSize)
		}
		if g.Window <= 0 {
			d.errorAt(p+".window", "must be longer than 0")
		}
		if g.LatencyBudget <= 0 {
			d.errorAt(p+".latency_budget", "must be longer than 0")
		}
		if g.Sources < 1 || g.Sources > MaxIngestSources {
			d.errorAt(p+".sources", "must be from 1 to %d, not %d", MaxIngestSources, g.Sources)
		}
		if g.SourceIdle <= 0 {
			d.errorAt(p+".source_idle", "must be longer than 0")
		}
	}
}

// uniqueName checks the name of the list entry at p: required, and not
// taken by an earlier entry (names maps each name to its entry's path).
func uniqueName(d *decoder, names map[string]string, p, name string) {
	switch {
	case name == "":
		d.errorAt(p+".name", "required")
	case names[name] != "":
		d.errorAt(p+".name", "%q is already used by %s", name, names[name])
	default:
		names[name] = p
	}
}

func (c *Config) checkQuota(d *decoder, p string, q Quota, inherit bool) {
	for _, f := range []struct {
		field string
		n     int64
	}{{"ports", int64(q.Ports)}, {"flows", int64(q.Flows)}, {"streams", int64(q.Streams)}, {"ring_bytes", int64(q.RingBytes)}} {
		if f.n < 0 || (!inherit && f.n == 0) {
			d.errorAt(p+"."+f.field, "must be at least 1, not %d", f.n)
		}
	}
	if !inherit || q.MaxSlots != 0 {
		checkSlots(d, p+".max_slots", q.MaxSlots)
	}
	// One application must never be able to take every reserved port:
	// the others' connections and port-0 listeners would find none.
	if eff := q.orDefault(c.DefaultQuota); c.ReservedPorts.IsSet() && eff.Ports >= c.ReservedPorts.Len() && (!inherit || q.Ports != 0) {
		d.errorAt(p+".ports", "%d is at least the %d ports of reserved_ports %s: one application could hold them all (a quarter of the range is the default)",
			eff.Ports, c.ReservedPorts.Len(), c.ReservedPorts)
	}
}

func (c *Config) checkApplications(d *decoder) {
	c.checkQuota(d, "default_quota", c.DefaultQuota, false)
	c.checkQuota(d, "unlisted_quota", c.UnlistedQuota, true)
	c.checkPortsFit()
	names := map[string]string{}
	for i, a := range c.Applications {
		p := fmt.Sprintf("applications[%d]", i)
		uniqueName(d, names, p, a.Name)
		if a.SecretFile != "" && !filepath.IsAbs(a.SecretFile) {
			d.errorAt(p+".secret_file", "%q must be an absolute path", a.SecretFile)
		}
		for j, r := range a.Ports {
			if c.overlapsReserved(r) {
				d.errorAt(fmt.Sprintf("%s.ports[%d]", p, j), "%s overlaps reserved_ports %s, which are for outgoing connections", r, c.ReservedPorts)
			}
		}
		c.checkQuota(d, p+".quota", a.Quota, true)
	}
}

// checkPortsFit warns when the applications' port quotas together exceed
// the reserved range: each is bounded, but together they may find it full.
func (c *Config) checkPortsFit() {
	if !c.ReservedPorts.IsSet() {
		return
	}
	sum := 0
	for _, a := range c.Applications {
		sum += c.QuotaOf(a.Name).Ports
	}
	if !c.Control.RefuseUnlisted {
		sum += c.QuotaOf("").Ports
	}
	if sum > c.ReservedPorts.Len() {
		c.Warnings = append(c.Warnings, fmt.Sprintf("%s: the applications' quota.ports (unlisted_quota included) add up to %d, more than the %d ports of reserved_ports %s: when all hold their quota, connections and port-0 listeners of some find no free port (no_ports)",
			c.File, sum, c.ReservedPorts.Len(), c.ReservedPorts))
	}
}

func (c *Config) overlapsReserved(r PortRange) bool {
	return r.IsSet() && r.Lo <= c.ReservedPorts.Hi && c.ReservedPorts.Lo <= r.Hi
}

func (c *Config) checkID(d *decoder, p string, id uint32, ids map[uint32]string) {
	switch {
	case !d.written(p + ".id"):
		d.errorAt(p+".id", "required: a number from 1 to %d that names the counters", MaxStaticID)
	case id < 1 || id > MaxStaticID:
		d.errorAt(p+".id", "%d is out of range 1-%d (ids above are the control plane's)", id, MaxStaticID)
	case ids[id] != "":
		d.errorAt(p+".id", "%d is already used by %s", id, ids[id])
	default:
		ids[id] = p
	}
}

func (c *Config) checkAppRef(d *decoder, field, app string) {
	if app == "" {
		d.errorAt(field, "required: the application to deliver to")
	} else if c.App(app) == nil {
		d.errorAt(field, "application %q is not in applications", app)
	}
}

func (c *Config) isAddress(a Addr) bool {
	for _, b := range c.Addresses {
		if b.Addr == a.Addr {
			return true
		}
	}
	return false
}

func (c *Config) checkListeners(d *decoder, ids map[uint32]string) {
	type key struct {
		proto Protocol
		addr  Addr
		port  Port
	}
	seen := map[key]string{}
	for i, l := range c.Listeners {
		p := fmt.Sprintf("listeners[%d]", i)
		c.checkID(d, p, l.ID, ids)
		if l.Protocol == Protocol(classifier.ProtoAny) {
			d.errorAt(p+".protocol", "required: tcp or udp")
		}
		if l.Port == 0 {
			d.errorAt(p+".port", "required")
		} else if c.overlapsReserved(PortRange{uint16(l.Port), uint16(l.Port)}) {
			d.errorAt(p+".port", "%d is in reserved_ports %s, which are for outgoing connections", l.Port, c.ReservedPorts)
		}
		if l.Address.IsValid() && !c.isAddress(l.Address) {
			d.errorAt(p+".address", "%s is not one of addresses", l.Address)
		}
		c.checkAppRef(d, p+".app", l.App)
		k := key{l.Protocol, l.Address, l.Port}
		if other := seen[k]; other != "" && l.Port != 0 {
			d.errorAt(p, "claims the same protocol, address and port as %s", other)
		}
		seen[k] = p
	}
}

func (c *Config) checkRules(d *decoder, ids map[uint32]string) {
	for i, r := range c.Rules {
		p := fmt.Sprintf("rules[%d]", i)
		c.checkID(d, p, r.ID, ids)
		m := r.Match
		if m.VLAN > 4094 {
			d.errorAt(p+".match.vlan", "%d is not a VLAN id (1-4094)", m.VLAN)
		}
		for _, f := range []struct {
			name string
			pf   Prefix
		}{{"src", m.Src}, {"dst", m.Dst}} {
			if !f.pf.IsValid() {
				continue
			}
			fam := IPVersion(classifier.Family(f.pf.Addr()))
			if m.IP != 0 && m.IP != fam {
				d.errorAt(p+".match."+f.name, "%s is IPv%d but match.ip is %d", f.pf, fam, m.IP)
			}
		}
		if m.Src.IsValid() && m.Dst.IsValid() && m.Src.Addr().Is4() != m.Dst.Addr().Is4() {
			d.errorAt(p+".match.dst", "%s and src %s are of different IP versions", m.Dst, m.Src)
		}
		switch classifier.Action(r.Action) {
		case 0:
			d.errorAt(p+".action", "required: pass, drop, steer or ingest")
		case classifier.ActionSteer:
			c.checkAppRef(d, p+".app", r.App)
			if r.Ingest != "" {
				d.errorAt(p+".ingest", "only an ingest rule names an ingest ring")
			}
		case classifier.ActionIngest:
			if classifier.Protocol(m.Protocol) != classifier.ProtoUDP {
				d.errorAt(p+".match.protocol", "an ingest rule must match protocol udp (ingest is UDP offload)")
			}
			if r.Ingest == "" {
				d.errorAt(p+".ingest", "required: the name of an ingest ring")
			} else if c.IngestID(r.Ingest) == 0 {
				d.errorAt(p+".ingest", "ingest ring %q is not in ingest", r.Ingest)
			}
			if r.App != "" {
				d.errorAt(p+".app", "only a steer rule names an application")
			}
		default:
			if r.App != "" {
				d.errorAt(p+".app", "only a steer rule names an application")
			}
			if r.Ingest != "" {
				d.errorAt(p+".ingest", "only an ingest rule names an ingest ring")
			}
		}
	}
}

func (c *Config) checkControl(d *decoder) {
	if c.Control.RefuseUnlisted && len(c.Applications) == 0 {
		d.errorAt("control.refuse_unlisted", "true, but applications is empty: no application could register")
	}
	if c.Control.Socket == "" {
		d.errorAt("control.socket", "required: the path of the control socket")
	} else if !filepath.IsAbs(c.Control.Socket) {
		d.errorAt("control.socket", "%q must be an absolute path", c.Control.Socket)
	}
	if !filepath.IsAbs(c.Control.AdminSocket) && (d.written("control.admin_socket") || filepath.IsAbs(c.Control.Socket)) {
		d.errorAt("control.admin_socket", "%q must be an absolute path", c.Control.AdminSocket)
	} else if c.Control.AdminSocket == c.Control.Socket {
		d.errorAt("control.admin_socket", "must differ from control.socket")
	}
	t := c.Control.TCP
	if t.Address == "" {
		for _, f := range []struct {
			name string
			set  bool
		}{{"auth", t.Auth != AuthNone}, {"secret_file", t.SecretFile != ""}, {"geneve", t.Geneve != ""}, {"cert_file", t.CertFile != ""}, {"key_file", t.KeyFile != ""}, {"client_ca_file", t.ClientCAFile != ""}} {
			if f.set {
				d.errorAt("control.tcp."+f.name, "set, but control.tcp.address is not: the TCP control plane is off")
			}
		}
		return
	}
	if t.Geneve == "" && !specificHost(t.Address) {
		d.errorAt("control.tcp.geneve", "required when control.tcp.address has no specific host: the address remote applications send their streams to")
	}
	secrets := t.SecretFile != ""
	for _, a := range c.Applications {
		secrets = secrets || a.SecretFile != ""
	}
	if !secrets {
		d.errorAt("control.tcp.address", "set, but neither control.tcp.secret_file nor any application's secret_file is: no remote application could connect")
	}
	if t.SecretFile != "" && !filepath.IsAbs(t.SecretFile) {
		d.errorAt("control.tcp.secret_file", "%q must be an absolute path", t.SecretFile)
	}
	switch t.Auth {
	case AuthNone:
		d.errorAt("control.tcp.auth", "required with control.tcp.address: secret or tls")
	case AuthSecret:
		for _, f := range []struct{ name, v string }{{"cert_file", t.CertFile}, {"key_file", t.KeyFile}, {"client_ca_file", t.ClientCAFile}} {
			if f.v != "" {
				d.errorAt("control.tcp."+f.name, "only used with auth: tls")
			}
		}
	case AuthTLS:
		for _, f := range []struct{ name, v string }{{"cert_file", t.CertFile}, {"key_file", t.KeyFile}, {"client_ca_file", t.ClientCAFile}} {
			if f.v == "" {
				d.errorAt("control.tcp."+f.name, "required with auth: tls")
			}
		}
	}
}

// specificHost reports whether a host:port names one address.
func specificHost(h HostPort) bool {
	host, _, err := net.SplitHostPort(string(h))
	if err != nil {
		return false
	}
	a, err := netip.ParseAddr(host)
	return err == nil && !a.IsUnspecified()
}
