package config

import (
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/ebpf"
	fingest "github.com/fabricbridge/fabricbridge/fabric/ingest"
)

// Config is one fabricbridge configuration file, decoded and checked. Every
// field has a default (see Default) except the interfaces and addresses,
// which describe the machine.
type Config struct {
	// File is where the configuration was read from; errors name it.
	File string `yaml:"-"`

	Interfaces []Interface `yaml:"interfaces"`
	// Addresses are the addresses of this box that applications may use
	// as source and listening addresses. The bridge drops any packet an
	// application sends from another address.
	Addresses []Addr `yaml:"addresses"`
	// ReservedPorts is the port range taken from the kernel's ephemeral
	// range (ip_local_reserved_ports) for the outgoing connections of
	// applications.
	ReservedPorts PortRange `yaml:"reserved_ports"`
	Streams       Streams   `yaml:"streams"`
	Ingest        []Ingest  `yaml:"ingest"`
	// Listeners and Rules are the static classification: they are loaded
	// at start and replaced atomically on SIGHUP.
	Listeners    []Listener    `yaml:"listeners"`
	Rules        []Rule        `yaml:"rules"`
	Applications []Application `yaml:"applications"`
	// DefaultQuota fills the quota fields a listed application leaves
	// unset.
	DefaultQuota Quota `yaml:"default_quota"`
	// UnlistedQuota bounds every application the applications list does
	// not name, all of them together, so that new names cannot multiply
	// it; fields left unset take default_quota's.
	UnlistedQuota Quota   `yaml:"unlisted_quota"`
	Control       Control `yaml:"control"`
	Metrics       Metrics `yaml:"metrics"`
	Log           Log     `yaml:"log"`
	BGP           BGP     `yaml:"bgp"`
	Spread        Spread  `yaml:"spread"`

	// Warnings are what the file allows but an operator should look at;
	// check prints them, the daemon logs them.
	Warnings []string `yaml:"-"`

	where map[string]pos
}

// Interface is one Ethernet interface the bridge serves.
type Interface struct {
	Name string `yaml:"name"`
	// Queues are the receive queues to serve; empty means all of them.
	Queues []int  `yaml:"queues"`
	Attach Attach `yaml:"attach"`
	// Path is the first path tried (auto) or the only one (strict); auto
	// means the fastest the interface offers.
	Path Path `yaml:"path"`
	// FrameSize is the UMEM frame size: 2048 or 4096.
	FrameSize Size `yaml:"frame_size"`
	// Frames is the number of UMEM frames per queue, a power of two.
	Frames int `yaml:"frames"`
	// BusyPoll, if set, turns on busy polling (SO_PREFER_BUSY_POLL) on the
	// AF_XDP sockets for this long per poll, such as 50us.
	BusyPoll Duration `yaml:"busy_poll"`
	// Spin is how long an idle bridge loop keeps polling before it sleeps
	// until the next packet wakes it; 0s sleeps at once.
	Spin Duration `yaml:"spin"`
	// CPUs pins the bridge's queue loops: the i-th served queue's loop
	// runs only on CPUs[i mod len]. Empty: wherever the scheduler puts them.
	CPUs []int `yaml:"cpus"`
	// IngestPriority, if set (1-99), runs the ingest engine's loops at
	// this SCHED_FIFO real-time priority: a loop woken by a datagram or
	// due to close a window preempts ordinary threads, at the price of
	// holding its CPU while windows are open (bridge/offload
	// Config.Priority). 0: ordinary threads.
	IngestPriority int `yaml:"ingest_priority"`
	// RouteCache bounds how many destinations the bridge keeps the next
	// hop of (bridge Config.RouteCache); a flood of new peer addresses
	// evicts entries instead of growing the daemon.
	RouteCache int `yaml:"route_cache"`
	// FlowCapacity is how many exact flows (outgoing connections) of each
	// IP family the XDP program's flow tables hold (bridge
	// Config.FlowCapacity); a claim beyond it is refused. FlowEntryBytes
	// of kernel memory a flow are taken up front.
	FlowCapacity int `yaml:"flow_capacity"`
	// NoSegmentOffload keeps every frame on the AF_XDP TX ring in copy
	// mode instead of joining a TCP connection's consecutive segments
	// into segmentation-offload packets (bridge Config.NoSegmentOffload).
	NoSegmentOffload bool `yaml:"no_segment_offload"`
}

// Streams sizes the stream an application gets when it does not ask for
// another size (within its quota).
type Streams struct {
	RxSlots  int  `yaml:"rx_slots"`
	TxSlots  int  `yaml:"tx_slots"`
	SlotSize Size `yaml:"slot_size"`
}

// Ingest is one ring of persistent buffers for UDP offload (ingest rules
// name it).
type Ingest struct {
	Name string `yaml:"name"`
	// Buffers is the number of buffers in the ring, BufferSize the bytes of
	// each.
	Buffers    int  `yaml:"buffers"`
	BufferSize Size `yaml:"buffer_size"`
	// Window is how long a buffer that holds records stays open before it
	// is published even though it is not full.
	Window Duration `yaml:"window"`
	// LatencyBudget is the wire-to-consumer latency above which a buffer
	// counts as a violation.
	LatencyBudget Duration `yaml:"latency_budget"`
	// Hugepages backs the ring with huge pages when the machine has them.
	Hugepages bool `yaml:"hugepages"`
	// Sources bounds the ring's table of senders (address and ports);
	// SourceIdle is how long a sender must have been silent before a new
	// one may take its entry when the table is full (fabric/ingest
	// Config.SourceIdle).
	Sources    int      `yaml:"sources"`
	SourceIdle Duration `yaml:"source_idle"`
}

// Listener claims every packet to one local address and port for an
// application, the way a listening socket does.
type Listener struct {
	// ID names the listener's counters; unique across listeners and rules,
	// 1..MaxStaticID.
	ID       uint32   `yaml:"id"`
	Name     string   `yaml:"name"`
	Protocol Protocol `yaml:"protocol"`
	// Address is one of Addresses; unset listens on all of them.
	Address Addr   `yaml:"address"`
	Port    Port   `yaml:"port"`
	App     string `yaml:"app"`
}

// Rule is an ordered match on header fields with an action.
type Rule struct {
	// ID names the rule's counters; unique across listeners and rules,
	// 1..MaxStaticID.
	ID   uint32 `yaml:"id"`
	Name string `yaml:"name"`
	// Priority orders the rules: lower first, ties by id.
	Priority uint32 `yaml:"priority"`
	Match    Match  `yaml:"match"`
	Action   Action `yaml:"action"`
	// App is the application a steer rule delivers to.
	App string `yaml:"app"`
	// Ingest is the ingest ring an ingest rule fills.
	Ingest string `yaml:"ingest"`
}

// Match is what a rule matches; every unset field matches anything.
type Match struct {
	VLAN     uint16    `yaml:"vlan"`
	IP       IPVersion `yaml:"ip"`
	Protocol Protocol  `yaml:"protocol"`
	Src      Prefix    `yaml:"src"`
	Dst      Prefix    `yaml:"dst"`
	SrcPort  PortRange `yaml:"src_port"`
	DstPort  PortRange `yaml:"dst_port"`
}

// Application is an application the bridge knows by name.
type Application struct {
	Name string `yaml:"name"`
	// Ports are the ports it may listen on; empty means any port that is
	// outside the reserved range and not held by another application.
	Ports []PortRange `yaml:"ports"`
	// Quota fields left at 0 take default_quota's.
	Quota Quota `yaml:"quota"`
	// UIDs, if set, are the only local users (by the control socket's peer
	// credentials) that may register under this name.
	UIDs []uint32 `yaml:"uids"`
	// SecretFile holds the secret this application proves when it
	// connects over TCP (control.tcp), instead of control.tcp.secret_file;
	// at least 16 bytes.
	SecretFile string `yaml:"secret_file"`
}

// Quota bounds what one application may hold, whatever number of control
// connections it uses.
type Quota struct {
	// Ports is how many distinct ports (listeners' and connections') it
	// may hold at once; at the bound its new connections share its ports.
	Ports int `yaml:"ports"`
	// Flows is how many connections it may hold at once.
	Flows int `yaml:"flows"`
	// Streams is how many streams (registrations) it may hold at once.
	Streams int `yaml:"streams"`
	// RingBytes bounds the memory of its local streams' rings together.
	RingBytes Size `yaml:"ring_bytes"`
	// MaxSlots bounds the depth of each ring of its stream.
	MaxSlots int `yaml:"max_slots"`
}

// Control configures the control plane.
type Control struct {
	// Socket is the Unix socket local applications connect to; its mode
	// decides which local users may.
	Socket     string   `yaml:"socket"`
	SocketMode FileMode `yaml:"socket_mode"`
	// AdminSocket serves the operator's tools (fabricbridge capture,
	// stats): HTTP over a Unix socket of mode 0600, so only root may look
	// at traffic. Default: see DefaultAdminSocket.
	AdminSocket string `yaml:"admin_socket"`
	// RefuseUnlisted refuses applications that the applications list
	// does not name.
	RefuseUnlisted bool       `yaml:"refuse_unlisted"`
	TCP            ControlTCP `yaml:"tcp"`
}

// ControlTCP is the control plane for applications on other nodes. It is
// off unless Address is set. Every application proves its secret
// (applications[].secret_file, else SecretFile) with a mutual HMAC
// challenge-response; with auth: tls the connection is also mutual TLS,
// encrypted, and the client's certificate must chain to ClientCAFile.
type ControlTCP struct {
	Address HostPort `yaml:"address"`
	Auth    Auth     `yaml:"auth"`
	// SecretFile holds the secret shared by every application without a
	// secret_file of its own; at least 16 bytes.
	SecretFile string `yaml:"secret_file"`
	// Geneve is the UDP endpoint of the remote stream transport; default
	// the host of Address with port 6081.
	Geneve HostPort `yaml:"geneve"`
	// CertFile and KeyFile are the bridge's certificate; ClientCAFile the
	// CA that client certificates must chain to (auth: tls).
	CertFile     string `yaml:"cert_file"`
	KeyFile      string `yaml:"key_file"`
	ClientCAFile string `yaml:"client_ca_file"`
}

// Metrics configures the Prometheus endpoint.
type Metrics struct {
	// Address serves /metrics; empty turns the endpoint off.
	Address HostPort `yaml:"address"`
}

// Log configures the structured log on standard error.
type Log struct {
	Level  LogLevel  `yaml:"level"`
	Format LogFormat `yaml:"format"`
}

// Defaults.
const (
	DefaultSocket        = "/run/fabricbridge/control.sock"
	DefaultMetrics       = "127.0.0.1:9469"
	DefaultSlots         = 1024
	DefaultSlotSize      = 2048
	DefaultFrames        = 4096
	DefaultFrameSize     = 2048
	DefaultSpin          = 20 * time.Microsecond
	DefaultRouteCache    = bridge.DefaultRouteCache
	MaxRouteCache        = 1 << 24
	DefaultReservedLo    = 61000
	DefaultReservedHi    = 61999
	DefaultIngestBuffers = 64
	DefaultIngestSize    = 1 << 20
	DefaultIngestWindow  = 100 * time.Microsecond
	DefaultIngestBudget  = time.Millisecond
	// DefaultIngestSources and DefaultIngestSourceIdle size an ingest
	// ring's table of senders; MaxIngestSources is the most it may hold.
	DefaultIngestSources    = fingest.DefaultMaxSources
	DefaultIngestSourceIdle = fingest.DefaultSourceIdle
	MaxIngestSources        = fingest.MaxSourcesCap
	// DefaultQuotaPorts is default_quota.ports without a reserved range;
	// with one it is a quarter of the range, so that no application can
	// hold every reserved port.
	DefaultQuotaPorts     = control.DefaultMaxPorts
	DefaultQuotaFlows     = control.DefaultMaxFlows
	DefaultQuotaStreams   = control.DefaultMaxStreams
	DefaultQuotaRingBytes = control.DefaultMaxRingBytes
	DefaultQuotaSlots     = 8192

	// MaxStaticID is the largest id of a static listener or rule. The ids
	// above it, up to classifier.MaxRuleID, are left to the control plane
	// for the listeners and flows applications register, so a reload can
	// never collide with them.
	MaxStaticID = 4095
)

// interfaces[].flow_capacity: its default and bounds, and about what one
// flow of it costs in kernel memory, preallocated.
const (
	DefaultFlowCapacity = ebpf.DefaultFlowCapacity
	MinFlowCapacity     = 1024
	MaxFlowCapacity     = 1 << 24
	FlowEntryBytes      = ebpf.FlowEntryBytes
)

// Default returns the configuration an empty file gives.
func Default() *Config {
	return &Config{
		ReservedPorts: PortRange{DefaultReservedLo, DefaultReservedHi},
		Streams:       Streams{RxSlots: DefaultSlots, TxSlots: DefaultSlots, SlotSize: DefaultSlotSize},
		DefaultQuota: Quota{Flows: DefaultQuotaFlows, Streams: DefaultQuotaStreams,
			RingBytes: DefaultQuotaRingBytes, MaxSlots: DefaultQuotaSlots},
		Control: Control{Socket: DefaultSocket, SocketMode: 0o660},
		Metrics: Metrics{Address: DefaultMetrics},
		Log:     Log{Level: LogLevel(0)},
		BGP:     defaultBGP(),
		Spread:  defaultSpread(),
	}
}

func (i *Interface) setDefaults() {
	i.FrameSize, i.Frames = DefaultFrameSize, DefaultFrames
	i.Spin = Duration(DefaultSpin)
	i.RouteCache = DefaultRouteCache
	i.FlowCapacity = DefaultFlowCapacity
}

func (g *Ingest) setDefaults() {
	g.Buffers, g.BufferSize = DefaultIngestBuffers, DefaultIngestSize
	g.Window, g.LatencyBudget = Duration(DefaultIngestWindow), Duration(DefaultIngestBudget)
	g.Hugepages = true
	g.Sources, g.SourceIdle = DefaultIngestSources, Duration(DefaultIngestSourceIdle)
}

// DefaultAdminSocket is the admin socket of a daemon whose control socket
// is socket: admin.sock beside control.sock, and NAME.admin.sock beside any
// other NAME.sock, so that daemons whose control sockets share a directory
// do not share an admin socket.
func DefaultAdminSocket(socket string) string {
	dir, base := filepath.Split(socket)
	if base == filepath.Base(DefaultSocket) {
		return filepath.Join(dir, "admin.sock")
	}
	return filepath.Join(dir, strings.TrimSuffix(base, ".sock")+".admin.sock")
}

// Parse decodes and checks a configuration; file names it in errors. The
// error, if any, is an Errors listing every problem with its line and field.
func Parse(file string, data []byte) (*Config, error) {
	c := Default()
	c.File = file
	d := &decoder{file: file, where: map[string]pos{}}
	if root := d.parseYAML(data); root != nil {
		d.where[""] = pos{root.Line, root.Column}
		d.decode("", root, reflect.ValueOf(c).Elem())
	}
	if !d.written("default_quota.ports") {
		c.DefaultQuota.Ports = c.defaultPorts()
	}
	if len(d.errs) == 0 {
		c.where = d.where
		if c.Control.AdminSocket == "" && c.Control.Socket != "" {
			c.Control.AdminSocket = DefaultAdminSocket(c.Control.Socket)
		}
		c.check(d)
	}
	d.finish()
	if len(d.errs) > 0 {
		d.errs.sort()
		return nil, d.errs
	}
	c.where = d.where
	return c, nil
}

// Errorf returns an error located at a field of the file, for problems found
// after Parse, such as a secret file that cannot be read when the daemon
// starts. Its arguments are quoted whole: they are the caller's text (and
// values Parse already bounded), not raw input, and a remedy it suggests
// must not be cut short.
func (c *Config) Errorf(field, format string, args ...any) error {
	d := &decoder{file: c.File, where: c.where}
	d.add(d.lookup(field), field, "", fmt.Sprintf(format, args...))
	return d.errs[0]
}

// App returns the named application, or nil.
func (c *Config) App(name string) *Application {
	for i := range c.Applications {
		if c.Applications[i].Name == name {
			return &c.Applications[i]
		}
	}
	return nil
}

// defaultPorts is default_quota.ports when the file does not set it: a
// quarter of the reserved range.
func (c *Config) defaultPorts() int {
	if !c.ReservedPorts.IsSet() {
		return DefaultQuotaPorts
	}
	return max(1, c.ReservedPorts.Len()/4)
}

// QuotaOf is the quota of an application: its own fields where set, the
// default quota's elsewhere. An unlisted application gets the unlisted
// quota, which all unlisted applications share.
func (c *Config) QuotaOf(name string) Quota {
	own := c.UnlistedQuota
	if a := c.App(name); a != nil {
		own = a.Quota
	}
	return own.orDefault(c.DefaultQuota)
}

// orDefault is q with its unset fields taken from def.
func (q Quota) orDefault(def Quota) Quota {
	pick := func(own, def int) int {
		if own != 0 {
			return own
		}
		return def
	}
	return Quota{Ports: pick(q.Ports, def.Ports), Flows: pick(q.Flows, def.Flows), Streams: pick(q.Streams, def.Streams),
		RingBytes: Size(pick(int(q.RingBytes), int(def.RingBytes))), MaxSlots: pick(q.MaxSlots, def.MaxSlots)}
}

// IngestID is the buffer id of the named ingest ring (its position in the
// list, from 1), which ingest rules carry in the XDP metadata; 0 if unknown.
func (c *Config) IngestID(name string) uint32 {
	for i, g := range c.Ingest {
		if g.Name == name {
			return uint32(i + 1)
		}
	}
	return 0
}

func (c *Config) String() string { return fmt.Sprintf("config %s", c.File) }
