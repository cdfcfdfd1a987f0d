package appliance

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/classifier"
)

// reservedPortsFile is the kernel's list of ports its ephemeral allocator
// must skip (net.ipv4.ip_local_reserved_ports, which covers IPv6 too). It
// belongs to the network namespace of the thread that opens it.
const reservedPortsFile = "/proc/sys/net/ipv4/ip_local_reserved_ports"

// reservePorts adds r to the kernel's reserved ports, so that the kernel
// never hands one of them to its own sockets while applications use them
// for their outgoing connections. It returns the ports it added — none when
// r was already reserved, as after a crash — for unreservePorts.
func reservePorts(r config.PortRange) (*classifier.PortSet, error) {
	have, err := readReserved()
	if err != nil {
		return nil, err
	}
	added := &classifier.PortSet{}
	for p := int(r.Lo); p <= int(r.Hi); p++ {
		if !have.Has(uint16(p)) {
			added.Add(uint16(p), uint16(p))
		}
	}
	if added.String() == "" {
		return added, nil
	}
	want := *have
	want.Add(r.Lo, r.Hi)
	return added, writeReserved(&want)
}

// unreservePorts removes the ports reservePorts added and leaves every
// other entry, the operator's included, as it is.
func unreservePorts(added *classifier.PortSet) error {
	if added == nil || added.String() == "" {
		return nil
	}
	have, err := readReserved()
	if err != nil {
		return err
	}
	for i := range have {
		have[i] &^= added[i]
	}
	return writeReserved(have)
}

func readReserved() (*classifier.PortSet, error) {
	b, err := os.ReadFile(reservedPortsFile)
	if err != nil {
		return nil, err
	}
	return parsePorts(reservedPortsFile, string(b))
}

// parsePorts reads the kernel's list syntax, "1000-1999,8080".
func parsePorts(file, text string) (*classifier.PortSet, error) {
	s := &classifier.PortSet{}
	for _, f := range strings.Split(strings.TrimSpace(text), ",") {
		if f == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(f, "-")
		a, err1 := strconv.ParseUint(lo, 10, 16)
		z, err2 := a, error(nil)
		if isRange {
			z, err2 = strconv.ParseUint(hi, 10, 16)
		}
		if err1 != nil || err2 != nil || z < a {
			return nil, fmt.Errorf("%s: cannot read %q", file, f)
		}
		s.Add(uint16(a), uint16(z))
	}
	return s, nil
}

func writeReserved(s *classifier.PortSet) error {
	v := s.String()
	if v == "" {
		v = "\n" // an empty write is refused; a newline clears the list
	}
	if err := os.WriteFile(reservedPortsFile, []byte(v), 0o644); err != nil {
		return fmt.Errorf("reserve ports %s: %w", strings.TrimSpace(v), err)
	}
	return nil
}

// A daemon records its reservation in a file beside its control socket
// (<control.socket>.ports): its range, the ports it added to the kernel's
// list, its network namespace and its metrics address. A daemon started
// after a crash reads its predecessor's record to know which reserved ports
// that one added — and removes them when it stops — instead of taking them
// for the operator's. Other daemons read the records to refuse a range that
// overlaps one a running daemon holds: ip_local_reserved_ports is one list
// per network namespace, and two daemons sharing a range would hand out the
// same ports, and the first to stop would return the other's ports to the
// kernel.

// portRecord is one daemon's record.
type portRecord struct {
	Range   config.PortRange
	Added   *classifier.PortSet
	NetNS   uint64 // inode of the network namespace; 0: unknown (an older record)
	Metrics string // the metrics address as configured
}

func readPortRecord(path string) (*portRecord, error) {
	rec := &portRecord{Added: &classifier.PortSet{}}
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return rec, nil
	}
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		key, value, _ := strings.Cut(strings.TrimSpace(line), " ")
		switch key {
		case "", "#":
		case "range":
			lo, hi, isRange := strings.Cut(value, "-")
			if !isRange {
				hi = lo
			}
			a, err1 := strconv.ParseUint(lo, 10, 16)
			z, err2 := strconv.ParseUint(hi, 10, 16)
			if err1 != nil || err2 != nil || z < a {
				return nil, fmt.Errorf("%s: cannot read range %q", path, value)
			}
			rec.Range = config.PortRange{Lo: uint16(a), Hi: uint16(z)}
		case "added":
			if rec.Added, err = parsePorts(path, value); err != nil {
				return nil, err
			}
		case "netns":
			rec.NetNS, _ = strconv.ParseUint(value, 10, 64)
		case "metrics":
			rec.Metrics = value
		default: // the first format: the added ports alone
			if rec.Added, err = parsePorts(path, key); err != nil {
				return nil, err
			}
		}
	}
	return rec, nil
}

func writePortRecord(path string, rec *portRecord) error {
	text := fmt.Sprintf("# fabricbridge: the reserved ports of the daemon with control socket %s\nrange %s\nadded %s\nnetns %d\nmetrics %s\n",
		strings.TrimSuffix(path, ".ports"), rec.Range, rec.Added, rec.NetNS, rec.Metrics)
	return os.WriteFile(path, []byte(text), 0o644)
}

// adoptReservation reserves r and takes over what a crashed predecessor
// recorded: its ports inside r count as added by this daemon, its ports
// outside r are released now. The result is recorded at path, with netns
// and metrics.
func adoptReservation(path string, r config.PortRange, netns uint64, metrics string) (*classifier.PortSet, error) {
	rec, err := readPortRecord(path)
	if err != nil {
		return nil, err
	}
	prev := rec.Added
	outside := &classifier.PortSet{}
	for p := 0; p < 65536; p++ {
		if prev.Has(uint16(p)) && !(int(r.Lo) <= p && p <= int(r.Hi)) {
			outside.Add(uint16(p), uint16(p))
		}
	}
	if err := unreservePorts(outside); err != nil {
		return nil, err
	}
	added, err := reservePorts(r)
	if err != nil {
		return nil, err
	}
	for i := range added {
		added[i] |= prev[i] &^ outside[i]
	}
	return added, writePortRecord(path, &portRecord{Range: r, Added: added, NetNS: netns, Metrics: metrics})
}

// peer is another running daemon, known by its record.
type peer struct {
	socket string // its control socket
	pid    string // as its lock file says
	rec    *portRecord
}

func (p peer) String() string {
	return fmt.Sprintf("the fabricbridge daemon with control socket %s (pid %s)", p.socket, p.pid)
}

// runningPeers finds the other daemons running in network namespace netns
// whose control sockets lie in one of dirs: a record whose daemon holds
// its run lock. A daemon whose socket is elsewhere goes unseen.
func runningPeers(self string, netns uint64, dirs ...string) []peer {
	var peers []peer
	seen := map[string]bool{self + ".ports": true}
	for _, dir := range dirs {
		records, _ := filepath.Glob(filepath.Join(dir, "*.ports"))
		for _, path := range records {
			if seen[path] {
				continue
			}
			seen[path] = true
			socket := strings.TrimSuffix(path, ".ports")
			pid, held := lockHeld(socket + ".lock")
			if !held {
				continue
			}
			rec, err := readPortRecord(path)
			if err != nil || (rec.NetNS != 0 && netns != 0 && rec.NetNS != netns) {
				continue
			}
			peers = append(peers, peer{socket: socket, pid: pid, rec: rec})
		}
	}
	return peers
}

// lockHeld reports whether a daemon holds the run lock at path, and the pid
// it wrote there. Taking the lock shared, and at once letting it go, tells
// without disturbing the holder.
func lockHeld(path string) (pid string, held bool) {
	f, err := os.Open(path)
	if err != nil {
		return "", false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err == nil {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
		return "", false
	}
	b, _ := os.ReadFile(path)
	return strings.TrimSpace(string(b)), true
}

// checkOverlap refuses a range that overlaps one a running peer holds, and
// suggests a range of the same size that overlaps none.
func checkOverlap(cfg *config.Config, peers []peer) error {
	r := cfg.ReservedPorts
	for _, p := range peers {
		o := p.rec.Range
		if !o.IsSet() || o.Hi < r.Lo || r.Hi < o.Lo {
			continue
		}
		return cfg.Errorf("reserved_ports", "%s overlaps %s, the range of %s; each daemon in a network namespace needs its own range%s",
			r, o, p, suggestRange(r, peers))
	}
	return nil
}

// suggestRange proposes a range as long as r that no peer holds, next to
// one a peer holds: just above it, else just below.
func suggestRange(r config.PortRange, peers []peer) string {
	n := r.Len()
	var starts []int
	for _, p := range peers {
		if o := p.rec.Range; o.IsSet() {
			starts = append(starts, int(o.Hi)+1, int(o.Lo)-n)
		}
	}
	for _, lo := range starts {
		if lo < 1024 || lo+n-1 > 65535 {
			continue
		}
		c := config.PortRange{Lo: uint16(lo), Hi: uint16(lo + n - 1)}
		free := true
		for _, p := range peers {
			if o := p.rec.Range; o.IsSet() && !(o.Hi < c.Lo || c.Hi < o.Lo) {
				free = false
			}
		}
		if free {
			return fmt.Sprintf(": set, for example, reserved_ports: %s", c)
		}
	}
	return ""
}

// netnsID is the inode of the calling thread's network namespace, which
// tells namespaces apart on one host.
func netnsID() uint64 {
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		return 0
	}
	return st.Ino
}

// peers are the other daemons running in the daemon's namespace, looked
// for beside its control socket and in the default run directory.
func (d *Daemon) peers(cfg *config.Config) []peer {
	return runningPeers(cfg.Control.Socket, d.netns, filepath.Dir(cfg.Control.Socket), filepath.Dir(config.DefaultSocket))
}

// reserve refuses a range another running daemon holds, then reserves the
// configured range and records it. The run directory stays locked
// meanwhile, so that two daemons starting at once cannot both find the
// range free.
func (d *Daemon) reserve(cfg *config.Config) (*classifier.PortSet, error) {
	dir, err := os.Open(filepath.Dir(cfg.Control.Socket))
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	if err := unix.Flock(int(dir.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("lock %s: %w", dir.Name(), err)
	}
	if err := checkOverlap(cfg, d.peers(cfg)); err != nil {
		return nil, err
	}
	added, err := adoptReservation(d.portRecord, cfg.ReservedPorts, d.netns, string(cfg.Metrics.Address))
	if err != nil {
		return nil, cfg.Errorf("reserved_ports", "%v", err)
	}
	return added, nil
}

// withoutPeers is added less every port a running peer's range covers: a
// daemon that stops never takes ports from under another, whatever their
// records say.
func (d *Daemon) withoutPeers(added *classifier.PortSet) *classifier.PortSet {
	cfg := d.Config()
	if cfg == nil {
		return added
	}
	return exceptPeers(added, d.peers(cfg))
}

// exceptPeers is added less every port the ranges of peers cover.
func exceptPeers(added *classifier.PortSet, peers []peer) *classifier.PortSet {
	out := *added
	for _, p := range peers {
		if r := p.rec.Range; r.IsSet() {
			for port := int(r.Lo); port <= int(r.Hi); port++ {
				out[port/64] &^= 1 << (port % 64)
			}
		}
	}
	return &out
}

// metricsAddrErr explains a metrics address that cannot be listened on;
// one in use, by another daemon most likely, gets the setting that would
// work.
func metricsAddrErr(cfg *config.Config, peers []peer, err error) error {
	if !errors.Is(err, unix.EADDRINUSE) {
		return cfg.Errorf("metrics.address", "%v", err)
	}
	addr := string(cfg.Metrics.Address)
	by := "another process"
	for _, p := range peers {
		if p.rec.Metrics == addr {
			by = p.String()
		}
	}
	hint := `metrics: {address: ""} to serve none`
	if host, port, err := net.SplitHostPort(addr); err == nil {
		if n, err := strconv.Atoi(port); err == nil {
			for next := n + 1; next < n+100 && next < 65536; next++ {
				a := net.JoinHostPort(host, strconv.Itoa(next))
				if ln, err := net.Listen("tcp", a); err == nil {
					ln.Close()
					hint = fmt.Sprintf("metrics: {address: %q} (free now), or %s", a, hint)
					break
				}
			}
		}
	}
	return cfg.Errorf("metrics.address", "%s is in use by %s; give each daemon its own: set %s", addr, by, hint)
}
