package appliance

import (
	"fmt"
	"runtime"

	vnetns "github.com/vishvananda/netns"
)

// home is the network namespace the daemon was started in. Everything the
// daemon touches later that is per namespace — the reserved-ports sysctl,
// netlink — must be touched there, also when the goroutine that does it
// (a signal handler, Close) runs on a thread in another namespace, as in
// tests and the demo, which start the daemon inside a namespace they made.
type home struct{ ns vnetns.NsHandle }

func captureHome() (home, error) {
	h, err := vnetns.Get()
	if err != nil {
		return home{}, fmt.Errorf("network namespace: %w", err)
	}
	return home{h}, nil
}

// do runs fn on a thread switched into the home namespace. It uses a
// goroutine of its own so that, if the thread cannot be switched back, the
// goroutine can end with the thread locked and the runtime discards the
// thread instead of reusing it in the wrong namespace.
func (h home) do(fn func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		cur, err := vnetns.Get()
		if err != nil {
			done <- err
			return // locked: discarded
		}
		defer cur.Close()
		if err := vnetns.Set(h.ns); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("network namespace: %w", err)
			return
		}
		ferr := fn()
		if err := vnetns.Set(cur); err != nil {
			done <- fmt.Errorf("network namespace: switch back: %w (after: %v)", err, ferr)
			return // locked: discarded
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}

func (h home) close() { h.ns.Close() }
