package appliance

import "log/slog"

// mtuFollower passes the served interface's MTU changes, as the bridge
// sees them, on to the control server, which tells the applications: their
// stacks must size packets by it as the kernel's sockets do.
type mtuFollower struct {
	last int
	tell func(mtu int) error
}

// check is called on every health tick (once a second), so an application
// learns of a change within about a second; until then the bridge refuses
// what it sends beyond the new MTU, and TCP retransmits it.
func (f *mtuFollower) check(mtu int, log *slog.Logger) {
	if f.tell == nil || mtu == f.last || mtu == 0 {
		return
	}
	if err := f.tell(mtu); err != nil {
		log.Warn("applications not told the interface's new MTU", "mtu", mtu, "error", err)
		return
	}
	log.Info("applications told the interface's new MTU", "from", f.last, "to", mtu)
	f.last = mtu
}

// followMTU has the plane tell server's applications of MTU changes from
// now on.
func (p *bridgePlane) followMTU(tell func(mtu int) error) {
	p.mu.Lock()
	p.mtu = mtuFollower{last: p.b.MTU(), tell: tell}
	p.mu.Unlock()
}
