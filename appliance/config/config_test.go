package config

import (
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// base is the smallest valid configuration; cases append to it, so their
// errors are on line 3 and later.
const base = "interfaces: [{name: eth1}]\naddresses: [198.18.0.1]\n"

func TestErrorsArePrecise(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"syntax", base + "rules: [\n", []string{"t.yaml:3: invalid YAML: did not find expected node content"}},
		{"tab", base + "log:\n\tlevel: info\n", []string{"t.yaml:4: invalid YAML: found character that cannot start any token"}},
		{"top-level not a mapping", "- a\n", []string{"t.yaml:1:1: want a mapping of fields, got a list"}},
		{"unknown field", base + "metrix: {address: 127.0.0.1}\n", []string{`t.yaml:3:1: metrix: unknown field (did you mean "metrics"?); known fields here: interfaces, addresses, reserved_ports, streams, ingest, listeners, rules, applications, default_quota, unlisted_quota, control, metrics, log, bgp, spread`}},
		{"unknown nested field", base + "log:\n  levle: info\n", []string{`t.yaml:4:3: log.levle: unknown field (did you mean "level"?); known fields here: level, format`}},
		{"duplicate field", base + "log: {level: info, level: debug}\n", []string{"t.yaml:3:20: log.level: set twice (first on line 3)"}},
		{"missing interfaces", "addresses: [198.18.0.1]\n", []string{"t.yaml:1:1: interfaces: at least one interface is required"}},
		{"missing addresses", "interfaces: [{name: eth1}]\n", []string{"t.yaml:1:1: addresses: at least one address is required: the addresses applications may use"}},
		{"bad address", "interfaces: [{name: eth1}]\naddresses: [198.18.0.1, 198.18.0.300]\n", []string{`t.yaml:2:25: addresses[1]: "198.18.0.300" is not an IP address`}},
		{"duplicate address", "interfaces: [{name: eth1}]\naddresses: [198.18.0.1, 198.18.0.1]\n", []string{"t.yaml:2:25: addresses[1]: 198.18.0.1 is listed twice"}},
		{"interface name", "interfaces:\n  - name: averyveryverylongname\naddresses: [198.18.0.1]\n", []string{`t.yaml:2:5: interfaces[0].name: "averyveryverylongname" is longer than an interface name can be (15 bytes)`}},
		{"interface twice", "interfaces:\n  - name: eth1\n  - name: eth1\naddresses: [198.18.0.1]\n", []string{
			"t.yaml:3:5: interfaces[1]: one interface per daemon: a stream is served by the bridge of one interface; run a daemon per interface, each with its own control.socket",
			`t.yaml:3:5: interfaces[1].name: "eth1" is already configured at interfaces[0]`,
		}},
		{"attach", "interfaces:\n  - name: eth1\n    attach: fast\naddresses: [198.18.0.1]\n", []string{`t.yaml:3:13: interfaces[0].attach: "fast" is not one of auto, strict`}},
		{"path", "interfaces:\n  - name: eth1\n    path: xdp\naddresses: [198.18.0.1]\n", []string{`t.yaml:3:11: interfaces[0].path: "xdp" is not one of auto, native-zerocopy, native-copy, generic, afpacket`}},
		{"frame size", "interfaces:\n  - name: eth1\n    frame_size: 3000\naddresses: [198.18.0.1]\n", []string{"t.yaml:3:5: interfaces[0].frame_size: must be 2048 or 4096, not 3000"}},
		{"frames", "interfaces:\n  - {name: eth1, frames: 1000}\naddresses: [198.18.0.1]\n", []string{"t.yaml:2:18: interfaces[0].frames: must be a power of two from 64 to 1048576, not 1000"}},
		{"ingest priority", "interfaces:\n  - {name: eth1, ingest_priority: 100}\naddresses: [198.18.0.1]\n", []string{"t.yaml:2:18: interfaces[0].ingest_priority: must be a real-time priority from 1 to 99, or 0 for none, not 100"}},
		{"cpu twice", "interfaces:\n  - {name: eth1, cpus: [1, 1]}\naddresses: [198.18.0.1]\n", []string{"t.yaml:2:28: interfaces[0].cpus[1]: CPU 1 is listed twice"}},
		{"cpu out of range", "interfaces:\n  - {name: eth1, cpus: [1024]}\naddresses: [198.18.0.1]\n", []string{"t.yaml:2:25: interfaces[0].cpus[0]: CPU 1024 is out of range 0-1023"}},
		{"negative spin", "interfaces:\n  - {name: eth1, spin: -5us}\naddresses: [198.18.0.1]\n", []string{`t.yaml:2:24: interfaces[0].spin: "-5us" is not a duration (for example 100us, 5s)`}},
		{"queue twice", "interfaces:\n  - {name: eth1, queues: [0, 0]}\naddresses: [198.18.0.1]\n", []string{"t.yaml:2:30: interfaces[0].queues[1]: queue 0 is listed twice"}},
		{"integer wanted", "interfaces:\n  - {name: eth1, frames: many}\naddresses: [198.18.0.1]\n", []string{`t.yaml:2:26: interfaces[0].frames: want an integer, got "many"`}},
		{"list wanted", base + "ingest: {name: x}\n", []string{"t.yaml:3:9: ingest: want a list, got a mapping"}},
		{"reserved backwards", base + "reserved_ports: 62000-61000\n", []string{`t.yaml:3:17: reserved_ports: range "62000-61000" runs backwards (write 61000-62000)`}},
		{"reserved privileged", base + "reserved_ports: 100-2000\n", []string{"t.yaml:3:1: reserved_ports: 100-2000 reaches into the privileged ports below 1024"}},
		{"port out of range", base + "reserved_ports: 61000-70000\n", []string{`t.yaml:3:17: reserved_ports: "70000" is not a port (1-65535)`}},
		{"slots", base + "streams:\n  rx_slots: 1000\n", []string{"t.yaml:4:3: streams.rx_slots: must be a power of two from 2 to 1048576, not 1000"}},
		{"slots above quota", base + "streams:\n  tx_slots: 16384\n", []string{"t.yaml:4:3: streams.tx_slots: 16384 is above default_quota.max_slots (8192)"}},
		{"ring bytes", base + "default_quota: {max_slots: 1048576}\nstreams: {rx_slots: 1048576, slot_size: 2048}\n", []string{"t.yaml:4:11: streams.rx_slots: 1048576 slots of 2048 bytes need a 2147485696-byte ring, above the 1073741824-byte limit"}},
		{"slot size", base + "streams: {slot_size: 100}\n", []string{"t.yaml:3:11: streams.slot_size: must be a multiple of 64 from 128 to 65536, not 100"}},
		{"size suffix", base + "ingest:\n  - name: t\n    buffer_size: 1T\n", []string{`t.yaml:5:18: ingest[0].buffer_size: "1T" is not a size (a number of bytes, optionally with K, M or G)`}},
		{"duration", base + "ingest:\n  - name: t\n    window: soon\n", []string{`t.yaml:5:13: ingest[0].window: "soon" is not a duration (for example 100us, 5s)`}},
		{"ingest unnamed", base + "ingest:\n  - buffers: 8\n", []string{"t.yaml:4:5: ingest[0].name: required"}},
		{"route cache", "interfaces: [{name: eth0, route_cache: 8}]\naddresses: [198.18.0.1]\n", []string{
			"t.yaml:1:27: interfaces[0].route_cache: must be from 16 to 16777216 destinations, not 8",
		}},
		{"flow capacity", "interfaces: [{name: eth0, flow_capacity: 1000}]\naddresses: [198.18.0.1]\n", []string{
			"t.yaml:1:27: interfaces[0].flow_capacity: must be from 1024 to 16777216 flows, not 1000",
		}},
		{"flow capacity huge", "interfaces: [{name: eth0, flow_capacity: 16777217}]\naddresses: [198.18.0.1]\n", []string{
			"t.yaml:1:27: interfaces[0].flow_capacity: must be from 1024 to 16777216 flows, not 16777217",
		}},
		{"ingest sources", base + "ingest:\n  - {name: t, sources: 0, source_idle: 0s}\n", []string{
			"t.yaml:4:15: ingest[0].sources: must be from 1 to 65536, not 0",
			"t.yaml:4:27: ingest[0].source_idle: must be longer than 0",
		}},
		{"listener fields", base + "listeners:\n  - {id: 1, port: 80}\n", []string{
			"t.yaml:4:5: listeners[0].protocol: required: tcp or udp",
			"t.yaml:4:5: listeners[0].app: required: the application to deliver to",
		}},
		{"listener address", base + "applications: [{name: web}]\nlisteners:\n  - {id: 1, protocol: tcp, address: 198.18.0.2, port: 80, app: web}\n", []string{
			"t.yaml:5:28: listeners[0].address: 198.18.0.2 is not one of addresses",
		}},
		{"listener unknown app", base + "listeners:\n  - id: 1\n    protocol: tcp\n    port: 80\n    app: webb\n", []string{
			`t.yaml:7:5: listeners[0].app: application "webb" is not in applications`,
		}},
		{"listener in reserved range", base + "applications: [{name: web}]\nlisteners:\n  - {id: 1, protocol: udp, port: 61005, app: web}\n", []string{
			"t.yaml:5:28: listeners[0].port: 61005 is in reserved_ports 61000-61999, which are for outgoing connections",
		}},
		{"listener twice", base + "applications: [{name: web}]\nlisteners:\n  - {id: 1, protocol: tcp, port: 80, app: web}\n  - {id: 2, protocol: tcp, port: 80, app: web}\n", []string{
			"t.yaml:6:5: listeners[1]: claims the same protocol, address and port as listeners[0]",
		}},
		{"rule id missing", base + "rules:\n  - action: drop\n", []string{"t.yaml:4:5: rules[0].id: required: a number from 1 to 4095 that names the counters"}},
		{"rule id range", base + "rules:\n  - {id: 5000, action: drop}\n", []string{"t.yaml:4:6: rules[0].id: 5000 is out of range 1-4095 (ids above are the control plane's)"}},
		{"rule id twice", base + "rules:\n  - {id: 7, action: drop}\n  - {id: 7, action: pass}\n", []string{"t.yaml:5:6: rules[1].id: 7 is already used by rules[0]"}},
		{"rule id negative", base + "rules:\n  - {id: -1, action: drop}\n", []string{`t.yaml:4:10: rules[0].id: want an integer from 0 to 4294967295, got "-1"`}},
		{"action missing", base + "rules:\n  - id: 1\n", []string{"t.yaml:4:5: rules[0].action: required: pass, drop, steer or ingest"}},
		{"action unknown", base + "rules:\n  - id: 1\n    action: reject\n", []string{`t.yaml:5:13: rules[0].action: "reject" is not one of pass, drop, steer, ingest`}},
		{"ingest needs udp", base + "ingest: [{name: trig}]\nrules:\n  - id: 1\n    action: ingest\n    ingest: trig\n", []string{
			"t.yaml:5:5: rules[0].match.protocol: an ingest rule must match protocol udp (ingest is UDP offload)",
		}},
		{"ingest unknown ring", base + "rules:\n  - id: 1\n    match: {protocol: udp}\n    action: ingest\n    ingest: trig\n", []string{
			`t.yaml:7:5: rules[0].ingest: ingest ring "trig" is not in ingest`,
		}},
		{"steer needs app", base + "rules:\n  - {id: 1, action: steer}\n", []string{"t.yaml:4:5: rules[0].app: required: the application to deliver to"}},
		{"drop names app", base + "applications: [{name: web}]\nrules:\n  - {id: 1, action: drop, app: web}\n", []string{"t.yaml:5:27: rules[0].app: only a steer rule names an application"}},
		{"prefix host bits", base + "rules:\n  - id: 1\n    match: {src: 198.18.0.1/15}\n    action: drop\n", []string{
			`t.yaml:5:18: rules[0].match.src: prefix "198.18.0.1/15" has bits set beyond its length (did you mean 198.18.0.0/15?)`,
		}},
		{"prefix family", base + "rules:\n  - id: 1\n    match: {ip: 6, dst: 198.18.0.0/15}\n    action: drop\n", []string{
			"t.yaml:5:20: rules[0].match.dst: 198.18.0.0/15 is IPv4 but match.ip is 6",
		}},
		{"mixed families", base + "rules:\n  - id: 1\n    match:\n      src: 198.18.0.0/15\n      dst: 2001:db8::/32\n    action: drop\n", []string{
			"t.yaml:7:7: rules[0].match.dst: 2001:db8::/32 and src 198.18.0.0/15 are of different IP versions",
		}},
		{"vlan", base + "rules:\n  - {id: 1, match: {vlan: 5000}, action: drop}\n", []string{"t.yaml:4:21: rules[0].match.vlan: 5000 is not a VLAN id (1-4094)"}},
		{"ip version", base + "rules:\n  - {id: 1, match: {ip: 5}, action: drop}\n", []string{`t.yaml:4:25: rules[0].match.ip: "5" is not one of 4, 6`}},
		{"listener and rule share id", base + "applications: [{name: web}]\nlisteners:\n  - {id: 3, protocol: tcp, port: 80, app: web}\nrules:\n  - {id: 3, action: drop}\n", []string{
			"t.yaml:7:6: rules[0].id: 3 is already used by listeners[0]",
		}},
		{"application twice", base + "applications:\n  - name: a\n  - name: a\n", []string{`t.yaml:5:5: applications[1].name: "a" is already used by applications[0]`}},
		{"application ports reserved", base + "applications:\n  - name: a\n    ports: [80, 60000-61000]\n", []string{
			"t.yaml:5:17: applications[0].ports[1]: 60000-61000 overlaps reserved_ports 61000-61999, which are for outgoing connections",
		}},
		{"quota slots", base + "applications:\n  - name: a\n    quota: {max_slots: 3}\n", []string{"t.yaml:5:13: applications[0].quota.max_slots: must be a power of two from 2 to 1048576, not 3"}},
		{"default quota ports", base + "default_quota: {ports: 0}\n", []string{"t.yaml:3:17: default_quota.ports: must be at least 1, not 0"}},
		{"socket relative", base + "control: {socket: fb.sock}\n", []string{`t.yaml:3:11: control.socket: "fb.sock" must be an absolute path`}},
		{"admin socket same", base + "control: {socket: /run/x.sock, admin_socket: /run/x.sock}\n", []string{"t.yaml:3:32: control.admin_socket: must differ from control.socket"}},
		{"socket mode", base + "control: {socket_mode: 999}\n", []string{`t.yaml:3:24: control.socket_mode: "999" is not an octal permission mode such as 0660`}},
		{"tcp without auth", base + "control:\n  tcp:\n    address: 198.18.0.1:7070\n", []string{
			"t.yaml:4:3: control.tcp.auth: required with control.tcp.address: secret or tls",
			"t.yaml:5:5: control.tcp.address: set, but neither control.tcp.secret_file nor any application's secret_file is: no remote application could connect",
		}},
		{"wildcard address needs geneve", base + "applications: [{name: a, secret_file: /s}]\ncontrol:\n  tcp: {address: \":7070\", auth: secret}\n", []string{
			"t.yaml:5:3: control.tcp.geneve: required when control.tcp.address has no specific host: the address remote applications send their streams to",
		}},
		{"secret relative", base + "applications: [{name: a, secret_file: s}]\n", []string{`t.yaml:3:26: applications[0].secret_file: "s" must be an absolute path`}},
		{"tcp without secrets", base + "control:\n  tcp: {address: \"198.18.0.1:7070\", auth: secret}\n", []string{
			"t.yaml:4:9: control.tcp.address: set, but neither control.tcp.secret_file nor any application's secret_file is: no remote application could connect",
		}},
		{"tls files with secret", base + "applications: [{name: a, secret_file: /s}]\ncontrol:\n  tcp: {address: \"198.18.0.1:7070\", auth: secret, cert_file: /c}\n", []string{
			"t.yaml:5:51: control.tcp.cert_file: only used with auth: tls",
		}},
		{"tls needs files", base + "applications: [{name: a, secret_file: /s}]\ncontrol:\n  tcp:\n    address: 198.18.0.1:7070\n    auth: tls\n    cert_file: /etc/c.pem\n", []string{
			"t.yaml:5:3: control.tcp.key_file: required with auth: tls",
			"t.yaml:5:3: control.tcp.client_ca_file: required with auth: tls",
		}},
		{"refuse everyone", base + "control: {refuse_unlisted: true}\n", []string{"t.yaml:3:11: control.refuse_unlisted: true, but applications is empty: no application could register"}},
		{"uid", base + "applications: [{name: a, uids: [-1]}]\n", []string{`t.yaml:3:33: applications[0].uids[0]: want an integer from 0 to 4294967295, got "-1"`}},
		{"shared secret without address", base + "control:\n  tcp: {secret_file: /s}\n", []string{"t.yaml:4:9: control.tcp.secret_file: set, but control.tcp.address is not: the TCP control plane is off"}},
		{"auth without address", base + "control:\n  tcp: {auth: secret}\n", []string{"t.yaml:4:9: control.tcp.auth: set, but control.tcp.address is not: the TCP control plane is off"}},
		{"auth unknown", base + "control:\n  tcp: {address: \":1\", auth: password}\n", []string{`t.yaml:4:30: control.tcp.auth: "password" is not one of secret, tls`}},
		{"metrics address", base + "metrics: {address: 9469}\n", []string{`t.yaml:3:20: metrics.address: "9469" is not host:port`}},
		{"log level", base + "log: {level: verbose}\n", []string{`t.yaml:3:14: log.level: "verbose" is not one of debug, info, warn, error`}},
		{"merge key", base + "log:\n  <<: {level: info}\n", []string{"t.yaml:4:3: log: merge keys (<<) are not supported; write the fields out"}},
		{"scalar wanted", base + "log: {level: [info]}\n", []string{"t.yaml:3:14: log.level: want a single value, got a list"}},
		{"decoding errors stop before the semantic checks", base + "log: {level: loud}\nstreams: {rx_slots: 3}\nrules:\n  - {id: 0, action: drop}\n", []string{
			`t.yaml:3:14: log.level: "loud" is not one of debug, info, warn, error`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("t.yaml", []byte(tc.yaml))
			if err == nil {
				t.Fatalf("accepted:\n%s\nas %+v", tc.yaml, c)
			}
			var es Errors
			if !errors.As(err, &es) {
				t.Fatalf("error is %T, not Errors: %v", err, err)
			}
			got := strings.Split(err.Error(), "\n")
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("errors:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestSemanticErrorsTogether checks that one pass reports every semantic
// problem, sorted by line, once the file decodes.
func TestSemanticErrorsTogether(t *testing.T) {
	_, err := Parse("t.yaml", []byte(base+"streams: {rx_slots: 3}\nrules:\n  - {id: 0, action: drop}\n  - {id: 1, action: steer, app: nope}\n"))
	want := "t.yaml:3:11: streams.rx_slots: must be a power of two from 2 to 1048576, not 3\n" +
		"t.yaml:5:6: rules[0].id: 0 is out of range 1-4095 (ids above are the control plane's)\n" +
		"t.yaml:6:28: rules[1].app: application \"nope\" is not in applications"
	if err == nil || err.Error() != want {
		t.Errorf("got:\n%v\nwant:\n%s", err, want)
	}
}

func TestDefaults(t *testing.T) {
	c, err := Parse("t.yaml", []byte(base+"ingest: [{name: trig}]\napplications: [{name: web}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	in := c.Interfaces[0]
	if in.Attach != AttachAuto || in.Path != PathAuto || in.FrameSize != 2048 || in.Frames != 4096 || len(in.Queues) != 0 ||
		time.Duration(in.Spin) != 20*time.Microsecond || len(in.CPUs) != 0 || in.RouteCache != 4096 ||
		in.FlowCapacity != 262144 {
		t.Errorf("interface defaults: %+v", in)
	}
	if c.ReservedPorts != (PortRange{61000, 61999}) || c.Streams != (Streams{1024, 1024, 2048}) {
		t.Errorf("defaults: reserved %v streams %+v", c.ReservedPorts, c.Streams)
	}
	g := c.Ingest[0]
	if g.Buffers != 64 || g.BufferSize != 1<<20 || time.Duration(g.Window) != 100*time.Microsecond || !g.Hugepages ||
		g.Sources != 256 || time.Duration(g.SourceIdle) != time.Second {
		t.Errorf("ingest defaults: %+v", g)
	}
	if c.Control.Socket != DefaultSocket || c.Control.AdminSocket != "/run/fabricbridge/admin.sock" || c.Control.SocketMode != 0o660 || c.Control.TCP.Address != "" {
		t.Errorf("control defaults: %+v", c.Control)
	}
	if c.Metrics.Address != DefaultMetrics || slog.Level(c.Log.Level) != slog.LevelInfo || c.Log.Format != LogText {
		t.Errorf("metrics/log defaults: %+v %+v", c.Metrics, c.Log)
	}
	if c.QuotaOf("web") != c.DefaultQuota || c.QuotaOf("unlisted") != c.DefaultQuota {
		t.Errorf("application defaults: %+v, quota %+v", c.Applications[0], c.QuotaOf("web"))
	}
}

func TestEmptyFileNeedsTheMachine(t *testing.T) {
	_, err := Parse("t.yaml", nil)
	want := "t.yaml:1: interfaces: at least one interface is required\nt.yaml:1: addresses: at least one address is required: the addresses applications may use"
	if err == nil || err.Error() != want {
		t.Errorf("got %v, want\n%s", err, want)
	}
}

func TestValues(t *testing.T) {
	c, err := Parse("t.yaml", []byte(`
interfaces:
  - name: eth1
    queues: [0, 3]
    attach: STRICT
    path: afpacket
    frame_size: 4K
    busy_poll: 50us
    spin: 0s
    cpus: [3, 1]
addresses: [198.18.0.1, "2001:db8::1", "::ffff:198.18.0.9"]
ingest:
  - {name: a, buffer_size: 2MiB, window: 1ms}
applications:
  - name: web
    secret_file: /etc/fabricbridge/web.secret
    uids: [0, 1000]
    ports: [80, 8000-8099]
    quota: {ports: 10}
listeners:
  - {id: 1, protocol: tcp, address: "2001:db8::1", port: 80, app: web}
  - {id: 2, protocol: udp, port: 8053, app: web}
rules:
  - id: 3
    priority: 7
    match: {vlan: 10, ip: 6, protocol: udp, src: "2001:db8:1::/48", dst: "2001:db8::1", src_port: 1-1023, dst_port: 9000}
    action: ingest
    ingest: a
  - {id: 4, name: web-range, match: {dst_port: 8000-8099}, action: steer, app: web}
control:
  socket_mode: "0600"
  tcp: {address: "[2001:db8::1]:7070", auth: tls, cert_file: /c, key_file: /k, client_ca_file: /ca}
log: {level: debug, format: json}
metrics: {address: ""}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Interfaces[0].Attach != AttachStrict || c.Interfaces[0].Path != PathAFPacket || c.Interfaces[0].FrameSize != 4096 || len(c.Interfaces[0].Queues) != 2 || time.Duration(c.Interfaces[0].BusyPoll) != 50*time.Microsecond ||
		c.Interfaces[0].Spin != 0 || !slices.Equal(c.Interfaces[0].CPUs, []int{3, 1}) {
		t.Errorf("interface: %+v", c.Interfaces[0])
	}
	if c.Addresses[2].Addr != netip.MustParseAddr("198.18.0.9") {
		t.Errorf("a mapped address is not unmapped: %v", c.Addresses[2])
	}
	if c.Ingest[0].BufferSize != 2<<20 || time.Duration(c.Ingest[0].Window) != time.Millisecond {
		t.Errorf("ingest: %+v", c.Ingest[0])
	}
	if q := c.QuotaOf("web"); q.Ports != 10 || q.MaxSlots != DefaultQuotaSlots {
		t.Errorf("quota of web: %+v", q)
	}
	if c.Control.SocketMode != 0o600 || c.Control.TCP.Auth != AuthTLS || c.Metrics.Address != "" || c.Log.Format != LogJSON {
		t.Errorf("control %+v metrics %+v log %+v", c.Control, c.Metrics, c.Log)
	}

	rules, apps := c.Classification()
	want := classifier.Rule{ID: 3, Priority: 7, VLAN: 10, IPVersion: 6, Protocol: classifier.ProtoUDP,
		Src: netip.MustParsePrefix("2001:db8:1::/48"), Dst: netip.MustParsePrefix("2001:db8::1/128"),
		SrcPorts: classifier.PortRange{Lo: 1, Hi: 1023}, DstPorts: classifier.Port(9000), Action: classifier.ActionIngest, Stream: 1}
	if len(rules) != 1 || rules[0] != want {
		t.Errorf("rules bound to no application:\n%+v\nwant\n%+v", rules, want)
	}
	web := apps["web"]
	if len(apps) != 1 || len(web.Listeners) != 2 || len(web.Rules) != 1 {
		t.Fatalf("application entries: %+v", apps)
	}
	if l := web.Listeners[0]; l.ID != 1 || l.Protocol != classifier.ProtoTCP || l.Addr != netip.MustParseAddr("2001:db8::1") || l.Port != 80 || l.Stream != 0 {
		t.Errorf("listener: %+v", l)
	}
	if l := web.Listeners[1]; l.Addr.IsValid() || l.Port != 8053 {
		t.Errorf("wildcard listener: %+v", l)
	}
	if r := web.Rules[0]; r.ID != 4 || r.Action != classifier.ActionSteer || r.DstPorts != (classifier.PortRange{Lo: 8000, Hi: 8099}) {
		t.Errorf("steer rule: %+v", r)
	}
	if _, err := classifier.Compile(c.ruleSet()); err != nil {
		t.Errorf("the rule set does not compile: %v", err)
	}
	if n := c.RuleNames(); n[4] != "web-range" || n[3] != "rule 3" || n[1] != "listener 1" {
		t.Errorf("names: %v", n)
	}
}

func TestErrorfLocatesLaterProblems(t *testing.T) {
	c, err := Parse("t.yaml", []byte(base+"applications:\n  - name: a\n    secret_file: /nonexistent\ncontrol:\n  tcp:\n    address: 198.18.0.1:7070\n    auth: secret\n"))
	if err != nil {
		t.Fatal(err)
	}
	got := c.Errorf("applications[0].secret_file", "cannot read it: %v", "no such file").Error()
	if want := "t.yaml:5:5: applications[0].secret_file: cannot read it: no such file"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	// A field the file did not write falls back to its parent.
	got = c.Errorf("control.tcp.cert_file", "x").Error()
	if want := "t.yaml:7:3: control.tcp.cert_file: x"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestLoadNamesTheFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "fb.yaml")
	if err := os.WriteFile(path, []byte(base+"log: {level: 3}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Load(path)
	if want := path + `:3:14: log.level: "3" is not one of debug, info, warn, error`; err == nil || err.Error() != want {
		t.Errorf("got %v, want %s", err, want)
	}
	if _, err := Load(filepath.Join(dir, "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

func TestAliases(t *testing.T) {
	c, err := Parse("t.yaml", []byte(`
interfaces: [{name: eth1}]
addresses: [198.18.0.1]
rules:
  - {id: 1, match: &m {protocol: udp, dst_port: 53}, action: drop}
  - {id: 2, match: *m, action: pass, priority: 1}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Rules[1].Match != c.Rules[0].Match {
		t.Errorf("alias not followed: %+v vs %+v", c.Rules[1].Match, c.Rules[0].Match)
	}
}

// TestQuotaBounds: by default no application can hold the whole reserved
// range (its ports quota is a quarter of it, following the range); a quota
// of the whole range or more is an error; quotas that together exceed the
// range are a warning; unlisted applications share unlisted_quota, whose
// unset fields are default_quota's.
func TestQuotaBounds(t *testing.T) {
	c, err := Parse("t.yaml", []byte(base+"reserved_ports: 20000-20399\napplications: [{name: web}]\nunlisted_quota: {streams: 2}\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := Quota{Ports: 100, Flows: DefaultQuotaFlows, Streams: DefaultQuotaStreams, RingBytes: DefaultQuotaRingBytes, MaxSlots: DefaultQuotaSlots}
	if q := c.QuotaOf("web"); q != want {
		t.Errorf("quota of a listed application: %+v, want %+v", q, want)
	}
	want.Streams = 2
	if q := c.QuotaOf("stranger"); q != want {
		t.Errorf("quota of unlisted applications: %+v, want %+v", q, want)
	}
	if len(c.Warnings) != 0 {
		t.Errorf("warnings: %q", c.Warnings)
	}

	for _, tc := range []struct{ name, yaml, want string }{
		{"default", "default_quota: {ports: 1000}\n", "t.yaml:3:17: default_quota.ports: 1000 is at least the 1000 ports of reserved_ports 61000-61999: one application could hold them all (a quarter of the range is the default)"},
		{"application", "applications: [{name: web, quota: {ports: 5000}}]\n", "t.yaml:3:36: applications[0].quota.ports: 5000 is at least the 1000 ports of reserved_ports 61000-61999: one application could hold them all (a quarter of the range is the default)"},
		{"flows", "default_quota: {flows: -1}\n", "t.yaml:3:17: default_quota.flows: must be at least 1, not -1"},
	} {
		_, err := Parse("t.yaml", []byte(base+tc.yaml))
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s: %v\nwant %s", tc.name, err, tc.want)
		}
	}

	c, err = Parse("t.yaml", []byte(base+"applications: [{name: a, quota: {ports: 600}}, {name: b, quota: {ports: 600}}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "add up to 1450, more than the 1000 ports") {
		t.Errorf("warnings for quotas past the range: %q", c.Warnings)
	}
}
