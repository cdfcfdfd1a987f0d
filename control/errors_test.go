package control

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoDaemonSaysSo: dialling a control socket nobody serves says that no
// daemon is there, naming the socket, and is still ErrBridgeGone.
func TestNoDaemonSaysSo(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "control.sock")
	_, err := DialLocal(context.Background(), missing, "web")
	want := "no fabricbridge daemon at " + missing + " (is it running?)"
	if err == nil || err.Error() != want || !errors.Is(err, ErrBridgeGone) {
		t.Errorf("missing socket: %v, want %q", err, want)
	}

	// A socket file left by a daemon that is gone: connection refused.
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	if _, err := DialLocal(context.Background(), stale, "web"); err == nil || !strings.HasPrefix(err.Error(), "no fabricbridge daemon at "+stale) {
		t.Errorf("stale socket: %v", err)
	}

	l2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l2.Addr().String()
	l2.Close()
	if _, err := DialRemote(context.Background(), addr, "web", make([]byte, MinSecretSize)); err == nil ||
		err.Error() != "no fabricbridge daemon at "+addr+" (is it running?)" || !errors.Is(err, ErrBridgeGone) {
		t.Errorf("refused TCP: %v", err)
	}
}

// TestNameTakenOnTheWire: a second registration of a name that holds
// configured listeners comes back as ErrNameTaken, not as a held port.
func TestNameTakenOnTheWire(t *testing.T) {
	err := wireError(fmt.Errorf("%w: application %q is registered already", ErrNameTaken, "web")).Err()
	if !errors.Is(err, ErrNameTaken) || errors.Is(err, ErrPortInUse) || !strings.HasPrefix(err.Error(), "control: name already registered") {
		t.Errorf("%v", err)
	}
}
