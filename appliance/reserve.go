package appliance

import (
	"fmt"
	"os"
	"strconv"
	"strings"

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

// The ports a daemon added are recorded in a file beside the control socket,
// so that a daemon started after a crash knows which reserved ports its
// predecessor added — and removes them when it stops — instead of taking
// them for the operator's.

func readPortRecord(path string) (*classifier.PortSet, error) {
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return &classifier.PortSet{}, nil
	}
	if err != nil {
		return nil, err
	}
	return parsePorts(path, string(b))
}

func writePortRecord(path string, s *classifier.PortSet) error {
	return os.WriteFile(path, []byte(s.String()+"\n"), 0o644)
}

// adoptReservation reserves r and takes over what a crashed predecessor
// recorded: its ports inside r count as added by this daemon, its ports
// outside r are released now. The result is recorded at path.
func adoptReservation(path string, r config.PortRange) (*classifier.PortSet, error) {
	prev, err := readPortRecord(path)
	if err != nil {
		return nil, err
	}
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
	return added, writePortRecord(path, added)
}
