package appliance

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func TestRunLockAndStaleSocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "sub", "control.sock")
	lock, err := lockRun(sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockRun(sock); err == nil || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Errorf("second lock: %v", err)
	}

	// A socket file left by a dead listener is removed.
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if removed, err := removeStaleSocket(sock); err != nil || !removed {
		t.Fatalf("stale socket: removed %v, %v", removed, err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("stale socket still there: %v", err)
	}
	if removed, err := removeStaleSocket(sock); err != nil || removed {
		t.Errorf("no socket: removed %v, %v", removed, err)
	}

	// A live one and a regular file are left alone.
	ln, err = net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := removeStaleSocket(sock); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("live socket: %v", err)
	}
	ln.Close()
	os.WriteFile(sock, []byte("x"), 0o600)
	if _, err := removeStaleSocket(sock); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("regular file: %v", err)
	}

	lock.release()
	if l, err := lockRun(sock); err != nil {
		t.Errorf("lock after release: %v", err)
	} else {
		l.release()
	}
}

func TestReservedPorts(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns := topology.New(t)
	read := func() string {
		var s string
		if err := ns.Do(func() error {
			b, err := os.ReadFile(reservedPortsFile)
			s = strings.TrimSpace(string(b))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return s
	}
	err := ns.Do(func() error {
		if err := os.WriteFile(reservedPortsFile, []byte("8080,60000-61499"), 0o644); err != nil {
			return err
		}
		added, err := reservePorts(config.PortRange{Lo: 61000, Hi: 61999})
		if err != nil {
			return err
		}
		if got := added.String(); got != "61500-61999" {
			t.Errorf("added %q, want only the ports that were not reserved", got)
		}
		if got, _ := readReserved(); got.String() != "8080,60000-61999" {
			t.Errorf("reserved after: %s", got)
		}
		// A restart after a crash finds the range reserved and adds nothing.
		again, err := reservePorts(config.PortRange{Lo: 61000, Hi: 61999})
		if err != nil || again.String() != "" {
			t.Errorf("second reserve added %q, %v", again, err)
		}
		return unreservePorts(added)
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := read(); got != "8080,60000-61499" {
		t.Errorf("after unreserve: %q, want the operator's entries back", got)
	}
}

// TestAdoptReservation: a daemon started after a crash takes over the ports
// its predecessor recorded, inside its range, and releases the rest.
func TestAdoptReservation(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns := topology.New(t)
	record := filepath.Join(t.TempDir(), "control.sock.ports")
	err := ns.Do(func() error {
		// The crashed daemon had reserved 50000-50099 (recorded); the
		// operator reserves 8080.
		if err := os.WriteFile(reservedPortsFile, []byte("8080,50000-50099"), 0o644); err != nil {
			return err
		}
		if err := os.WriteFile(record, []byte("50000-50099\n"), 0o644); err != nil {
			return err
		}
		added, err := adoptReservation(record, config.PortRange{Lo: 50050, Hi: 50149}, 42, "127.0.0.1:9469")
		if err != nil {
			return err
		}
		if got, _ := readReserved(); got.String() != "8080,50050-50149" {
			t.Errorf("reserved: %s, want the operator's port and the new range", got)
		}
		if added.String() != "50050-50149" {
			t.Errorf("owned %s, want the whole new range", added)
		}
		if rec, err := readPortRecord(record); err != nil || rec.Added.String() != "50050-50149" ||
			rec.Range != (config.PortRange{Lo: 50050, Hi: 50149}) || rec.NetNS != 42 || rec.Metrics != "127.0.0.1:9469" {
			t.Errorf("record %+v, %v", rec, err)
		}
		if err := unreservePorts(added); err != nil {
			return err
		}
		if got, _ := readReserved(); got.String() != "8080" {
			t.Errorf("after stop: %s, want only the operator's port", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
