// Package topology builds small network topologies out of real network
// namespaces and veth pairs, so that the kernel's own datapath can be driven
// on one machine with nothing leaking into the host's namespace. Tests use
// it, and so does `fabricbridge demo`: it is the one part of the internal
// test tooling that the shipped binary links, and only for the demo.
//
// Every namespace and link made here belongs to a TB (a test, or the demo's
// scope): it is removed by tb.Cleanup, in reverse order of creation, whether
// or not the test passed. Namespaces are named (fb followed by eight hex
// digits) and bind-mounted under /run/netns, so while a test is paused or
// hanging one can look inside with `ip netns exec fbXXXXXXXX ...`. Sweep
// removes what a crashed run left.
//
// Only the benchmark ranges 198.18.0.0/15 and 2001:db8::/32 are ever assigned,
// and Ping refuses any other destination, so a mistake in a test cannot send
// traffic anywhere real.
package topology

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"

	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// namePrefix marks namespaces and links as ours; Sweep relies on it.
const namePrefix = "fb"

// NS is a network namespace owned by one test.
type NS struct {
	// Name is the name under /run/netns, usable with `ip netns exec`.
	Name string

	mu     sync.Mutex
	fd     vnetns.NsHandle // open while the namespace is alive; -1 after cleanup
	handle *netlink.Handle
}

// TB is what the helpers need of a test: testing.TB has it, and so can a
// program that builds a topology outside a test (the demo) by keeping its own
// list of cleanups and turning Fatalf into an error.
type TB interface {
	Helper()
	Cleanup(func())
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
}

// New creates an empty namespace whose loopback is up and registers its
// removal with tb.Cleanup. Anything left inside (links, routes, addresses)
// disappears with it; sockets still open in it keep the kernel object alive,
// unnamed, until they are closed.
func New(tb TB) *NS {
	tb.Helper()
	var (
		n   *NS
		err error
	)
	// A name could already exist (left by a crashed run, or drawn twice);
	// the exclusive create in NewNamed detects it, and a new draw fixes it.
	for range 5 {
		n, err = create(namePrefix + randomHex(4))
		if !errors.Is(err, os.ErrExist) {
			break
		}
	}
	if err != nil {
		tb.Fatalf("netns: %v", err)
	}
	tb.Cleanup(func() {
		if err := n.close(); err != nil {
			tb.Errorf("netns: removing %s: %v", n.Name, err)
		}
	})
	return n
}

// create makes the namespace, its netlink handle and brings lo up. All of it
// happens on one thread that has moved into the new namespace, which is how
// Linux creates a namespace: unshare moves the caller.
func create(name string) (*NS, error) {
	n := &NS{Name: name, fd: -1}
	err := onThread(
		func() (err error) {
			n.fd, err = vnetns.NewNamed(name)
			if err != nil {
				// NewNamed may fail after the unshare, on the bind mount,
				// and leaves the name file behind in that case.
				if !errors.Is(err, os.ErrExist) {
					_ = vnetns.DeleteNamed(name)
					_ = os.Remove("/run/netns/" + name)
				}
				return fmt.Errorf("creating namespace %s: %w", name, err)
			}
			return nil
		},
		func() error {
			h, err := newHandle()
			if err != nil {
				return err
			}
			n.handle = h
			lo, err := h.LinkByName("lo")
			if err == nil {
				err = h.LinkSetUp(lo)
			}
			if err != nil {
				return fmt.Errorf("bringing up lo in %s: %w", name, err)
			}
			return nil
		})
	if err != nil && n.fd.IsOpen() {
		err = errors.Join(err, n.close())
	}
	if err != nil {
		return nil, err
	}
	return n, nil
}

// newHandle opens a netlink handle in the calling thread's namespace; the
// sockets stay bound to it afterwards. Kernels built without XFRM or
// netfilter netlink would refuse the full set, and routing is what tests
// need most, so it falls back to that alone.
func newHandle() (*netlink.Handle, error) {
	h, err := netlink.NewHandle()
	if err != nil {
		h, err = netlink.NewHandle(unix.NETLINK_ROUTE)
	}
	if err != nil {
		return nil, fmt.Errorf("opening netlink handle: %w", err)
	}
	return h, nil
}

// close undoes create. It is idempotent so that a failed create and the
// registered cleanup can both call it.
func (n *NS) close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.fd.IsOpen() {
		return nil
	}
	if n.handle != nil {
		n.handle.Close()
		n.handle = nil
	}
	err := vnetns.DeleteNamed(n.Name)
	if cerr := n.fd.Close(); err == nil {
		err = cerr
	}
	n.fd = -1
	return err
}

// Handle returns a netlink handle whose requests act inside n, for managing
// links, addresses, neighbours and routes there. It is opened with the
// namespace and closed by its cleanup; do not close it yourself. After the
// cleanup it returns nil.
func (n *NS) Handle() *netlink.Handle {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.handle
}

// Do runs fn on an OS thread that has been switched into n, then switches
// the thread back.
//
// This is how a test gets ordinary kernel sockets inside a namespace: a
// socket belongs to the namespace it was created in, for its whole life, so
// a net.Conn or net.Listener opened inside fn (net.ListenUDP, net.Dial, ...)
// keeps sending and receiving from n after Do returns and may then be used
// from any goroutine. Only creation has to happen inside.
//
// fn runs on its own goroutine and must not call t.FailNow, t.Fatal or
// t.Skip; return an error instead. Goroutines that fn starts run on other
// threads, outside n. A panic in fn is re-raised in the caller. If the thread
// cannot be switched back, it is kept locked so that the runtime discards it
// rather than reuse it in the wrong namespace.
func (n *NS) Do(fn func() error) error {
	// The descriptor could be closed by a concurrent cleanup while fn runs
	// and its number reused; a private duplicate keeps setns pointing at the
	// right namespace.
	n.mu.Lock()
	dup, err := -1, error(nil)
	if n.fd.IsOpen() {
		dup, err = unix.FcntlInt(uintptr(n.fd), unix.F_DUPFD_CLOEXEC, 0)
	}
	n.mu.Unlock()
	if dup < 0 && err == nil {
		return fmt.Errorf("netns: %s has already been removed", n.Name)
	}
	if err != nil {
		return fmt.Errorf("netns: %s: %w", n.Name, err)
	}
	defer unix.Close(dup)
	return onThread(func() error {
		if err := vnetns.Set(vnetns.NsHandle(dup)); err != nil {
			return fmt.Errorf("netns: entering %s: %w", n.Name, err)
		}
		return nil
	}, fn)
}

// errGoexit reports a fn that ended its goroutine instead of returning.
var errGoexit = errors.New("netns: function called runtime.Goexit (t.Fatal, t.FailNow or t.Skip?) inside Do; return an error instead")

// onThread runs enter and then, if it succeeded, fn on a fresh goroutine
// locked to its OS thread, and always moves that thread back to the
// namespace it started in, even if enter failed halfway, fn panicked or fn
// called runtime.Goexit. A fresh goroutine is used so that the caller's
// thread never changes namespace, and so that a thread which cannot be moved
// back can be thrown away by exiting while still locked.
func onThread(enter, fn func() error) error {
	type result struct {
		err      error
		panicked bool
		value    any
	}
	done := make(chan result, 1)
	go func() {
		res := result{err: errGoexit}
		defer func() { done <- res }()

		runtime.LockOSThread()
		home, err := vnetns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			res.err = fmt.Errorf("netns: opening current namespace: %w", err)
			return
		}
		defer home.Close()

		returned := false
		defer func() {
			if !returned {
				if v := recover(); v != nil {
					res.panicked, res.value = true, v
				}
			}
			if err := vnetns.Set(home); err != nil {
				// Stay locked: the runtime ends the thread with the goroutine.
				res.err = errors.Join(res.err, fmt.Errorf("netns: returning thread to its namespace: %w", err))
				return
			}
			runtime.UnlockOSThread()
		}()

		err = enter()
		if err == nil {
			err = fn()
		}
		res.err, returned = err, true
	}()
	res := <-done
	if res.panicked {
		panic(res.value)
	}
	return res.err
}

// Exec runs a command inside n with `ip netns exec` and returns its combined
// output. It is meant for inspection (`ip -d link`, `ss`, `tc`) and for
// tools that have no Go API; going through ip(8) also gives the command a
// /sys that shows n's devices. The error includes the output, so a failed
// command explains itself in the test log.
func (n *NS) Exec(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("netns: %s: %s: %w\n%s", n.Name, cmd.Args, err, out)
	}
	return out, nil
}

// randomHex returns 2*n random hex digits. Names are random rather than
// counted so that concurrent test binaries (go test ./... runs packages in
// parallel) do not collide.
func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails on Linux
	return hex.EncodeToString(b)
}
