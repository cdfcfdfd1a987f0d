package config

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// Port is a TCP or UDP port, 1..65535.
type Port uint16

func (p *Port) parseScalar(s string) error {
	v, err := parsePort(s)
	*p = Port(v)
	return err
}

func parsePort(s string) (uint16, error) {
	v, err := strconv.ParseUint(strings.TrimSpace(s), 10, 32)
	if err != nil || v < 1 || v > 65535 {
		return 0, fmt.Errorf("%q is not a port (1-65535)", s)
	}
	return uint16(v), nil
}

// PortRange is a port ("80") or an inclusive range ("9000-9003"). Unset, it
// matches any port.
type PortRange struct{ Lo, Hi uint16 }

func (r *PortRange) parseScalar(s string) error {
	lo, hi, isRange := strings.Cut(s, "-")
	a, err := parsePort(lo)
	if err != nil {
		return err
	}
	b := a
	if isRange {
		if b, err = parsePort(hi); err != nil {
			return err
		}
		if b < a {
			return fmt.Errorf("range %q runs backwards (write %d-%d)", s, b, a)
		}
	}
	*r = PortRange{a, b}
	return nil
}

// Classifier converts the range to the classifier's form.
func (r PortRange) Classifier() classifier.PortRange { return classifier.PortRange{Lo: r.Lo, Hi: r.Hi} }

// IsSet reports whether a range was given.
func (r PortRange) IsSet() bool { return r.Lo != 0 }

// Len is the number of ports in the range.
func (r PortRange) Len() int {
	if !r.IsSet() {
		return 0
	}
	return int(r.Hi) - int(r.Lo) + 1
}

func (r PortRange) String() string {
	if r.Lo == r.Hi {
		return strconv.Itoa(int(r.Lo))
	}
	return fmt.Sprintf("%d-%d", r.Lo, r.Hi)
}

// Addr is one IPv4 or IPv6 address without a zone.
type Addr struct{ netip.Addr }

func (a *Addr) parseScalar(s string) error {
	v, err := netip.ParseAddr(strings.TrimSpace(s))
	if err != nil || v.Zone() != "" {
		return fmt.Errorf("%q is not an IP address", s)
	}
	a.Addr = v.Unmap()
	return nil
}

// Prefix is a network such as 198.18.0.0/15; a bare address means that one
// host. Host bits must be zero, to catch typos in the prefix length.
type Prefix struct{ netip.Prefix }

func (p *Prefix) parseScalar(s string) error {
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return fmt.Errorf("%q is not an address or prefix", s)
		}
		a = a.Unmap()
		p.Prefix = netip.PrefixFrom(a, a.BitLen())
		return nil
	}
	v, err := netip.ParsePrefix(s)
	if err != nil {
		return fmt.Errorf("%q is not a prefix", s)
	}
	if v.Masked() != v {
		return fmt.Errorf("prefix %q has bits set beyond its length (did you mean %s?)", s, v.Masked())
	}
	p.Prefix = v
	return nil
}

// HostPort is a listening address "host:port"; the host may be empty for
// every address. An empty string means off.
type HostPort string

func (h *HostPort) parseScalar(s string) error {
	if s == "" {
		*h = ""
		return nil
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("%q is not host:port", s)
	}
	if host != "" {
		if _, err := netip.ParseAddr(host); err != nil && host != "localhost" {
			return fmt.Errorf("%q: host %q is not an IP address", s, host)
		}
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || (p == 0 && port != "0") {
		return fmt.Errorf("%q: port %q is not a number 0-65535", s, port)
	}
	*h = HostPort(s)
	return nil
}

// Size is a byte count: a number with an optional suffix K, M, G (powers of
// 1024, also written KiB, MiB, GiB).
type Size int64

func (z *Size) parseScalar(s string) error {
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"B", 1}} {
		if v, ok := strings.CutSuffix(t, u.suffix); ok {
			t, mult = strings.TrimSpace(v), u.mult
			break
		}
	}
	v, err := strconv.ParseInt(t, 10, 64)
	if err != nil || v < 0 || v > (1<<40)/mult {
		return fmt.Errorf("%q is not a size (a number of bytes, optionally with K, M or G)", s)
	}
	*z = Size(v * mult)
	return nil
}

// Duration is a Go duration such as 100us, 5s or 1m30s.
type Duration time.Duration

func (d *Duration) parseScalar(s string) error {
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil || v < 0 {
		return fmt.Errorf("%q is not a duration (for example 100us, 5s)", s)
	}
	*d = Duration(v)
	return nil
}

// FileMode is a permission mode written in octal, such as "0660".
type FileMode os.FileMode

func (m *FileMode) parseScalar(s string) error {
	v, err := strconv.ParseUint(strings.TrimSpace(s), 8, 32)
	if err != nil || v > 0o777 {
		return fmt.Errorf("%q is not an octal permission mode such as 0660", s)
	}
	*m = FileMode(v)
	return nil
}

// oneOf parses s as one of names and returns its index.
func oneOf(s string, names ...string) (int, error) {
	for i, n := range names {
		if strings.EqualFold(strings.TrimSpace(s), n) {
			return i, nil
		}
	}
	return 0, fmt.Errorf("%q is not one of %s", s, strings.Join(names, ", "))
}

// Protocol is tcp, udp or any.
type Protocol classifier.Protocol

func (p *Protocol) parseScalar(s string) error {
	i, err := oneOf(s, "any", "tcp", "udp")
	*p = Protocol([]classifier.Protocol{classifier.ProtoAny, classifier.ProtoTCP, classifier.ProtoUDP}[i])
	return err
}

func (p Protocol) String() string { return classifier.Protocol(p).String() }

// Action is what a static rule does: pass, drop, steer or ingest.
type Action classifier.Action

func (a *Action) parseScalar(s string) error {
	i, err := oneOf(s, "pass", "drop", "steer", "ingest")
	if err != nil {
		return err
	}
	*a = Action([]classifier.Action{classifier.ActionPass, classifier.ActionDrop, classifier.ActionSteer, classifier.ActionIngest}[i])
	return nil
}

func (a Action) String() string { return classifier.Action(a).String() }

// IPVersion is 4 or 6.
type IPVersion uint8

func (v *IPVersion) parseScalar(s string) error {
	i, err := oneOf(s, "4", "6")
	*v = IPVersion(4 + 2*i)
	return err
}

// Attach says how hard the bridge tries to get the fast path on an
// interface.
type Attach uint8

const (
	// AttachAuto tries native XDP with zero-copy AF_XDP, then native with
	// copy, then generic XDP, then AF_PACKET, and logs what it got.
	AttachAuto Attach = iota
	// AttachStrict insists on native XDP with zero-copy AF_XDP and fails
	// otherwise: for deployments that must never run slow unnoticed.
	AttachStrict
)

func (a *Attach) parseScalar(s string) error {
	i, err := oneOf(s, "auto", "strict")
	*a = Attach(i)
	return err
}

func (a Attach) String() string { return [...]string{"auto", "strict"}[a] }

// Path is where the bridge starts its attach walk (with attach auto) or
// the only path it accepts (with strict). The names and their order, fastest
// first, are the bridge's (bridge.Path).
type Path uint8

const (
	PathAuto Path = iota
	PathNativeZeroCopy
	PathNativeCopy
	PathGeneric
	PathAFPacket
)

var pathNames = []string{"auto", "native-zerocopy", "native-copy", "generic", "afpacket"}

func (p *Path) parseScalar(s string) error {
	i, err := oneOf(s, pathNames...)
	*p = Path(i)
	return err
}

func (p Path) String() string { return pathNames[p] }

// Auth is how TCP control clients prove who they are.
type Auth uint8

const (
	AuthNone   Auth = iota // unset: only valid without a TCP control address
	AuthSecret             // each application's shared secret (mutual HMAC challenge-response)
	AuthTLS                // the same inside mutual TLS: cert_file/key_file, clients checked against client_ca_file
)

func (a *Auth) parseScalar(s string) error {
	i, err := oneOf(s, "secret", "tls")
	if err != nil {
		return err
	}
	*a = Auth(i + 1)
	return nil
}

func (a Auth) String() string { return [...]string{"none", "secret", "tls"}[a] }

// LogLevel is debug, info, warn or error.
type LogLevel slog.Level

func (l *LogLevel) parseScalar(s string) error {
	i, err := oneOf(s, "debug", "info", "warn", "error")
	*l = LogLevel([]slog.Level{slog.LevelDebug, slog.LevelInfo, slog.LevelWarn, slog.LevelError}[i])
	return err
}

// LogFormat is text (logfmt-like key=value) or json.
type LogFormat uint8

const (
	LogText LogFormat = iota
	LogJSON
)

func (f *LogFormat) parseScalar(s string) error {
	i, err := oneOf(s, "text", "json")
	*f = LogFormat(i)
	return err
}

var errEmpty = errors.New("must not be empty")
