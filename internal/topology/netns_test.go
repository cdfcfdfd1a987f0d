package topology

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
)

// homeNetns is the namespace the test binary started in, as "net:[inode]".
var homeNetns string

func TestMain(m *testing.M) {
	homeNetns, _ = os.Readlink("/proc/self/ns/net")
	os.Exit(m.Run())
}

// checkThreadsHome fails if any thread of the process is in a namespace other
// than the one the binary started in: the invariant Do and New promise.
// Threads kept locked after a failed restore have exited by the time their
// goroutine has, so they do not show up here.
func checkThreadsHome(t *testing.T) {
	t.Helper()
	tasks, err := filepath.Glob("/proc/self/task/*/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range tasks {
		ns, err := os.Readlink(p)
		if err != nil {
			continue // thread exited meanwhile
		}
		if ns != homeNetns {
			t.Errorf("%s is %s, want %s", p, ns, homeNetns)
		}
	}
}

func TestPairPing(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := Pair(t, VethOptions{})

	for _, e := range []End{v.A, v.B} {
		if len(e.Name) > 15 || !strings.HasPrefix(e.Name, namePrefix) {
			t.Errorf("bad link name %q", e.Name)
		}
		if e.Index <= 0 || len(e.MAC) != 6 {
			t.Errorf("%s: index %d, MAC %v", e.Name, e.Index, e.MAC)
		}
		if checkPrefix(e.Addr4, true) != nil || checkPrefix(e.Addr6, false) != nil {
			t.Errorf("%s: addresses %v %v outside the benchmark ranges", e.Name, e.Addr4, e.Addr6)
		}
		l, err := e.NS.Handle().LinkByIndex(e.Index)
		if err != nil {
			t.Fatal(err)
		}
		if l.Attrs().Name != e.Name || l.Attrs().MTU != 1500 || l.Attrs().OperState != netlink.OperUp {
			t.Errorf("%s: name %s, MTU %d, state %v", e.Name, l.Attrs().Name, l.Attrs().MTU, l.Attrs().OperState)
		}
	}
	for _, tc := range []struct {
		from *NS
		to   netip.Addr
	}{
		{a, v.B.Addr4.Addr()},
		{a, v.B.Addr6.Addr()},
		{b, v.A.Addr4.Addr()},
		{b, v.A.Addr6.Addr()},
		{a, netip.MustParseAddr("127.0.0.1")},
	} {
		n, err := tc.from.Ping(tc.to, 3, 3*time.Second)
		if err != nil || n != 3 {
			t.Errorf("ping %v from %s: %d replies, %v", tc.to, tc.from.Name, n, err)
		}
	}
	// Nothing answers for an unassigned address on the link: the loss is
	// counted and reported, and the time bound holds.
	start := time.Now()
	silent := v.B.Addr4.Addr().Next()
	if n, err := a.Ping(silent, 2, 300*time.Millisecond); err == nil || n != 0 {
		t.Errorf("ping of unassigned %v: %d replies, err %v", silent, n, err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("ping with a 300ms timeout took %v", d)
	}
	if _, err := a.Ping(netip.MustParseAddr("192.0.2.1"), 1, time.Second); err == nil {
		t.Error("Ping accepted a destination outside the benchmark ranges")
	}
	checkThreadsHome(t)
}

func TestOptions(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b := New(t), New(t)
	v := Connect(t, a, b, VethOptions{
		MTU:    9000,
		Queues: 4,
		A4:     netip.MustParsePrefix("198.19.77.1/30"),
		B4:     netip.MustParsePrefix("198.19.77.2/30"),
	})
	for _, e := range []End{v.A, v.B} {
		l, err := e.NS.Handle().LinkByName(e.Name)
		if err != nil {
			t.Fatal(err)
		}
		at := l.Attrs()
		if at.MTU != 9000 || at.NumTxQueues != 4 || at.NumRxQueues != 4 {
			t.Errorf("%s: MTU %d, %d TX / %d RX queues; want 9000, 4/4", e.Name, at.MTU, at.NumTxQueues, at.NumRxQueues)
		}
	}
	if v.A.Addr4.String() != "198.19.77.1/30" {
		t.Errorf("pinned address not used: %v", v.A.Addr4)
	}
	if _, err := b.Ping(v.A.Addr4.Addr(), 1, 2*time.Second); err != nil {
		t.Error(err)
	}
	if _, err := b.Ping(v.A.Addr6.Addr(), 1, 2*time.Second); err != nil {
		t.Error(err)
	}
	// A second link between the same namespaces gets its own subnets.
	w := Connect(t, a, b, VethOptions{})
	if w.A.Addr4.Masked() == v.A.Addr4.Masked() || w.A.Addr6.Masked() == v.A.Addr6.Masked() {
		t.Errorf("second link reuses subnets: %v %v", w.A.Addr4, w.A.Addr6)
	}
	if _, err := a.Ping(w.B.Addr6.Addr(), 1, 2*time.Second); err != nil {
		t.Error(err)
	}
}

// TestUDP is the pattern the rest of the project uses: kernel sockets opened
// inside namespaces with Do, then used from the test goroutine.
func TestUDP(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, b, v := Pair(t, VethOptions{})
	for _, fam := range []struct {
		name   string
		src    netip.Addr
		dst    netip.Addr
		listen string
	}{
		{"udp4", v.A.Addr4.Addr(), v.B.Addr4.Addr(), "udp4"},
		{"udp6", v.A.Addr6.Addr(), v.B.Addr6.Addr(), "udp6"},
	} {
		t.Run(fam.name, func(t *testing.T) {
			var srv, cli *net.UDPConn
			err := b.Do(func() (err error) {
				srv, err = net.ListenUDP(fam.listen, net.UDPAddrFromAddrPort(netip.AddrPortFrom(fam.dst, 0)))
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			err = a.Do(func() (err error) {
				cli, err = net.DialUDP(fam.listen, nil, srv.LocalAddr().(*net.UDPAddr))
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			defer cli.Close()

			msg := []byte("fabricbridge " + fam.name)
			if _, err := cli.Write(msg); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 64)
			_ = srv.SetReadDeadline(time.Now().Add(3 * time.Second))
			n, from, err := srv.ReadFromUDPAddrPort(buf)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf[:n], msg) || from.Addr().Unmap() != fam.src {
				t.Fatalf("got %q from %v, want %q from %v", buf[:n], from, msg, fam.src)
			}
			// And back, so both directions of the sockets are proven.
			if _, err := srv.WriteToUDPAddrPort([]byte("ack"), from); err != nil {
				t.Fatal(err)
			}
			_ = cli.SetReadDeadline(time.Now().Add(3 * time.Second))
			if n, err = cli.Read(buf); err != nil || string(buf[:n]) != "ack" {
				t.Fatalf("reply %q, %v", buf[:n], err)
			}
		})
	}
	checkThreadsHome(t)
}

func TestDo(t *testing.T) {
	testenv.RequirePrivileged(t)
	n := New(t)

	// fn sees n, and the caller's thread never leaves home.
	var inside string
	runtime.LockOSThread()
	err := n.Do(func() (err error) {
		inside, err = os.Readlink("/proc/thread-self/ns/net")
		return err
	})
	mine, _ := os.Readlink("/proc/thread-self/ns/net")
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(runDir, n.Name))
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprintf("net:[%d]", inodeOf(st)) != inside {
		t.Errorf("inside Do the thread is in %s, want %s's", inside, n.Name)
	}
	if mine != homeNetns {
		t.Errorf("caller's thread moved to %s", mine)
	}

	// Errors come back, panics are re-raised here, Goexit is reported.
	sentinel := errors.New("sentinel")
	if err := n.Do(func() error { return sentinel }); !errors.Is(err, sentinel) {
		t.Errorf("error not returned: %v", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want boom", r)
			}
		}()
		_ = n.Do(func() error { panic("boom") })
	}()
	if err := n.Do(func() error { runtime.Goexit(); return nil }); !errors.Is(err, errGoexit) {
		t.Errorf("Goexit gave %v", err)
	}
	// Many concurrent switches leave every thread at home.
	done := make(chan error)
	for range 16 {
		go func() { done <- n.Do(func() error { time.Sleep(time.Millisecond); return nil }) }()
	}
	for range 16 {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	checkThreadsHome(t)
}

func TestExec(t *testing.T) {
	testenv.RequirePrivileged(t)
	a, _, v := Pair(t, VethOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := a.Exec(ctx, "ip", "-o", "addr", "show", "dev", v.A.Name)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{v.A.Addr4.String(), v.A.Addr6.String()} {
		if !strings.Contains(string(out), want) {
			t.Errorf("ip addr in %s lacks %s:\n%s", a.Name, want, out)
		}
	}
	if out, err := a.Exec(ctx, "ip", "link", "show", "dev", "eth0"); err == nil {
		t.Errorf("the host's eth0 is visible inside %s:\n%s", a.Name, out)
	}
	if _, err := a.Exec(ctx, "false"); err == nil {
		t.Error("Exec of false succeeded")
	}
}

// TestCleanup checks that a finished (sub)test leaves no trace: no mount,
// no name under /run/netns, no descriptor in this process that would keep the
// namespace alive, and no link anywhere the host can see.
func TestCleanup(t *testing.T) {
	testenv.RequirePrivileged(t)
	var (
		a, b   *NS
		v      *Veth
		inodes []uint64
	)
	t.Run("topology", func(t *testing.T) {
		a, b, v = Pair(t, VethOptions{})
		for _, n := range []*NS{a, b} {
			st, err := os.Stat(filepath.Join(runDir, n.Name))
			if err != nil {
				t.Fatal(err)
			}
			inodes = append(inodes, inodeOf(st))
		}
		if _, err := a.Ping(v.B.Addr4.Addr(), 1, 2*time.Second); err != nil {
			t.Fatal(err)
		}
	})
	if t.Failed() {
		t.FailNow()
	}
	mountinfo, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var fds []string
	links, _ := filepath.Glob("/proc/self/fd/*")
	for _, l := range links {
		if target, err := os.Readlink(l); err == nil {
			fds = append(fds, target)
		}
	}
	for i, n := range []*NS{a, b} {
		if _, err := os.Stat(filepath.Join(runDir, n.Name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still under %s: %v", n.Name, runDir, err)
		}
		if bytes.Contains(mountinfo, []byte(filepath.Join(runDir, n.Name))) {
			t.Errorf("%s still mounted", n.Name)
		}
		ref := fmt.Sprintf("net:[%d]", inodes[i])
		for _, f := range fds {
			if f == ref {
				t.Errorf("this process still holds %s (%s) open", ref, n.Name)
			}
		}
		if _, err := vnetns.GetFromName(n.Name); err == nil {
			t.Errorf("%s can still be opened by name", n.Name)
		}
		if n.Handle() != nil {
			t.Errorf("%s: Handle() not nil after cleanup", n.Name)
		}
		if err := n.Do(func() error { return nil }); err == nil {
			t.Errorf("%s: Do succeeded after cleanup", n.Name)
		}
	}
	for _, name := range []string{v.A.Name, v.B.Name} {
		if _, err := netlink.LinkByName(name); err == nil {
			t.Errorf("link %s visible in the host namespace", name)
		}
	}
	for i, used := range slots.used {
		if used {
			t.Errorf("address slot %d not released", i)
		}
	}
}

func TestSweep(t *testing.T) {
	testenv.RequirePrivileged(t)
	// Simulate a crashed run: a namespace mounted under our kind of name that
	// nobody holds, and a placeholder file whose bind mount never happened.
	crashed, err := create(namePrefix + randomHex(4))
	if err != nil {
		t.Fatal(err)
	}
	crashed.handle.Close()
	crashed.fd.Close()
	t.Cleanup(func() { _ = vnetns.DeleteNamed(crashed.Name) })
	placeholder := namePrefix + randomHex(4)
	if err := os.WriteFile(filepath.Join(runDir, placeholder), nil, 0o444); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(filepath.Join(runDir, placeholder)) })
	live := New(t)

	// Only touch what this test made: other test binaries may be running.
	ours := func(name string) bool { return name == crashed.Name || name == placeholder || name == live.Name }

	removed, err := sweep(time.Hour, ours)
	if err != nil || len(removed) != 0 {
		t.Fatalf("sweep of fresh namespaces removed %v, %v", removed, err)
	}
	young := func(name string) bool { return name != live.Name && ours(name) }
	removed, err = sweep(-time.Second, young)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(removed, " ") != crashed.Name+" "+placeholder && strings.Join(removed, " ") != placeholder+" "+crashed.Name {
		t.Errorf("sweep removed %v, want %s and %s", removed, crashed.Name, placeholder)
	}
	for _, name := range []string{crashed.Name, placeholder} {
		if _, err := os.Stat(filepath.Join(runDir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s survived the sweep: %v", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(runDir, live.Name)); err != nil {
		t.Errorf("sweep touched %s: %v", live.Name, err)
	}
}
