package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// keepMetrics is the metrics address of TestSteeringOutlivesTheDaemon's
// daemon, inside its namespace.
const keepMetrics = "127.0.0.1:9471"

// upload is what a sink received from a kernel peer that keeps sending:
// bytes checked against the pattern, and the longest time between two
// reads.
type upload struct {
	mu      sync.Mutex
	got     int
	err     error
	last    time.Time
	longest time.Duration // between two reads since the last reset
}

func (u *upload) progress() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.got
}

// stall returns the longest pause between reads since the previous call.
func (u *upload) stall() time.Duration {
	u.mu.Lock()
	defer u.mu.Unlock()
	s := u.longest
	u.longest = 0
	return s
}

// sinkPattern reads c to its end, checking each byte with patternAt, then
// answers with the count and whether it was all right.
func sinkPattern(c net.Conn, u *upload) {
	defer c.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := c.Read(buf)
		now := time.Now()
		u.mu.Lock()
		for i, b := range buf[:n] {
			if b != patternAt(u.got+i) && u.err == nil {
				u.err = fmt.Errorf("byte %d is %#x, not %#x", u.got+i, b, patternAt(u.got+i))
			}
		}
		u.got += n
		if n > 0 {
			if !u.last.IsZero() {
				u.longest = max(u.longest, now.Sub(u.last))
			}
			u.last = now
		}
		if err != nil && !errors.Is(err, io.EOF) && u.err == nil {
			u.err = err
		}
		got, bad := u.got, u.err
		u.mu.Unlock()
		if err != nil {
			fmt.Fprintf(c, "%d %v\n", got, bad == nil)
			return
		}
	}
}

// estabResets is the kernel's count of connections in ns that a reset
// ended (Tcp EstabResets).
func estabResets(t *testing.T, ns *topology.NS) uint64 {
	t.Helper()
	var n uint64
	if err := ns.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		var names []string
		for _, line := range strings.Split(string(b), "\n") {
			fields := strings.Fields(line)
			if len(fields) == 0 || fields[0] != "Tcp:" {
				continue
			}
			if names == nil {
				names = fields
				continue
			}
			for i, name := range names {
				if name == "EstabResets" && i < len(fields) {
					n, err = strconv.ParseUint(fields[i], 10, 64)
					return err
				}
			}
		}
		return errors.New("no Tcp EstabResets in /proc/net/snmp")
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSteeringOutlivesTheDaemon stops the daemon (SIGTERM, then kill -9)
// and starts it again while a kernel peer keeps uploading to an
// application: with the data path pinned in a bpf file system, the XDP
// program stays attached while no daemon runs and drops the peer's
// segments instead of letting the kernel reset them, so the upload goes on
// byte-exact with no reset. It reports how long the applications heard
// nothing: the upload's sink, and `app echo` answering a datagram a
// millisecond. Then the daemon stops for good and `fabricbridge release` gives
// the interface back.
func TestSteeringOutlivesTheDaemon(t *testing.T) {
	testenv.RequirePrivileged(t)
	// Under -race a process sleeps a second before it exits (the race
	// runtime's atexit_sleep_ms), which would count in the restart.
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	bridge, outside, v := topology.Pair(t, topology.VethOptions{})
	if err := ethtool.DisableTxChecksum(outside, v.B.Name); err != nil {
		t.Fatal(err)
	}
	bpffs := testenv.BPFFS(t)
	dir := t.TempDir()
	path, sock := filepath.Join(dir, "fb.yaml"), filepath.Join(dir, "control.sock")
	cfg := fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\ncontrol: {socket: %s}\nmetrics: {address: %q}\n",
		v.A.Name, v.A.Addr4.Addr(), sock, keepMetrics)
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	var d *daemonProc
	start := func() time.Time {
		t.Helper()
		d = startDaemon(t, bridge, "run", "--config", path, "--bpffs", bpffs)
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
			if c, err := net.Dial("unix", sock); err == nil {
				c.Close()
				return time.Now()
			}
			if time.Now().After(deadline) {
				t.Fatalf("the daemon's control socket never answered:\n%s", d.out.String())
			}
		}
	}
	start()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	back := make(chan time.Time, 4)
	st, err := userstack.Open(ctx, userstack.Options{App: "sink", Control: sock, Events: func(e userstack.Event) {
		if e.Kind == userstack.BridgeBack {
			back <- time.Now()
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ln, err := st.Listen("tcp", ":82")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	up := &upload{}
	go func() {
		if c, err := ln.Accept(); err == nil {
			sinkPattern(c, up)
		}
	}()
	runApp(t, ctx, "echo", "--control", sock, "--listen", ":7", "--udp")

	resets := estabResets(t, outside)
	var peer net.Conn
	if err := outside.Do(func() (err error) {
		peer, err = net.DialTimeout("tcp", netip.AddrPortFrom(v.A.Addr4.Addr(), 82).String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	// The peer sends 4 MB/s in 16 KiB writes until told to stop; a write
	// that fails is a reset.
	stop := make(chan struct{})
	sent := make(chan error, 1)
	var wrote int
	go func() {
		buf := make([]byte, 16<<10)
		tick := time.NewTicker(4 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				sent <- peer.(*net.TCPConn).CloseWrite()
				return
			case <-tick.C:
			}
			for i := range buf {
				buf[i] = patternAt(wrote + i)
			}
			if _, err := peer.Write(buf); err != nil {
				sent <- err
				return
			}
			wrote += len(buf)
		}
	}()
	waitUpload := func(atLeast int, what string) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); up.progress() < atLeast; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the upload is stuck at %d bytes %s:\n%s", up.progress(), what, d.out.String())
			}
		}
	}
	waitUpload(1<<20, "before the restarts")

	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		probe := startUDPProbe(t, outside, netip.AddrPortFrom(v.A.Addr4.Addr(), 7), time.Millisecond)
		time.Sleep(50 * time.Millisecond)
		up.stall()
		prog := bridge.XDPProgram(t, v.A.Name)
		t0 := time.Now()
		d.signal(t, sig)
		d.wait(t)
		exited := time.Now()
		// Nobody runs: the program is still attached through its pin.
		if id := bridge.XDPProgram(t, v.A.Name); id == 0 || id != prog {
			t.Errorf("%v: XDP program %d on the interface while no daemon runs, want %d (the one left steering)", sig, id, prog)
		}
		if links, _ := filepath.Glob(filepath.Join(bpffs, "fabricbridge", "*", v.A.Name, "link")); len(links) != 1 {
			t.Errorf("%v: pinned links %v, want one", sig, links)
		}
		log := d.out
		started := time.Now()
		answered := start()
		var reattached time.Time
		select {
		case reattached = <-back:
		case <-time.After(30 * time.Second):
			t.Fatalf("%v: the application never came back:\n%s", sig, d.out.String())
		}
		before := up.progress()
		waitUpload(before+1<<20, "after the restart")
		stall := up.stall()
		window, lost, probes := probe.finish()
		if !strings.Contains(d.out.String(), "took over the data path the previous daemon left steering\" pins=") || !strings.Contains(d.out.String(), "program=true link=true tables=true") {
			t.Errorf("%v: the new daemon did not take the pinned data path over:\n%s", sig, d.out.String())
		}
		if sig == syscall.SIGTERM && !strings.Contains(log.String(), "its data path keeps steering for the next daemon") {
			t.Errorf("SIGTERM: the daemon did not say it left its data path steering:\n%s", log.String())
		}
		t.Logf("%v: exited %v after the signal; the new daemon answered %v after its start (%v after the exit); the application was back %v after that; "+
			"the upload heard nothing for %v at most; no UDP echo for %v (%d of %d lost, one sent every ms)",
			sig, exited.Sub(t0).Round(time.Millisecond), answered.Sub(started).Round(time.Millisecond), answered.Sub(exited).Round(time.Millisecond),
			reattached.Sub(answered).Round(time.Millisecond), stall.Round(time.Millisecond), window, lost, probes)
	}

	close(stop)
	if err := <-sent; err != nil {
		t.Fatalf("the peer's upload failed after %d bytes: %v", wrote, err)
	}
	peer.SetReadDeadline(time.Now().Add(30 * time.Second))
	reply, err := io.ReadAll(peer)
	if want := fmt.Sprintf("%d true\n", wrote); err != nil || string(reply) != want {
		t.Errorf("the sink answered %q (%v), want %q", reply, err, want)
	}
	up.mu.Lock()
	if up.err != nil {
		t.Errorf("the upload: %v", up.err)
	}
	up.mu.Unlock()
	if n := estabResets(t, outside) - resets; n != 0 {
		t.Errorf("the peer's kernel counted %d connections reset", n)
	}

	// A final stop: the program stays until release gives it back.
	d.signal(t, syscall.SIGTERM)
	d.wait(t)
	var out bytes.Buffer
	if err := bridge.Do(func() error {
		return execute(context.Background(), []string{"release", "--config", path, "--bpffs", bpffs}, &out, &out)
	}); err != nil {
		t.Fatalf("release: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "detached the XDP program") {
		t.Errorf("release said:\n%s", out.String())
	}
	if id := bridge.XDPProgram(t, v.A.Name); id != 0 {
		t.Errorf("XDP program %d still attached after release", id)
	}
	if left, _ := filepath.Glob(filepath.Join(bpffs, "fabricbridge", "*", "*")); len(left) != 0 {
		t.Errorf("pins left after release: %v", left)
	}
}
