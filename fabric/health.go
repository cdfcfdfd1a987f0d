package fabric

import (
	"errors"
	"sync"
	"sync/atomic"
)

// Health is the state of one stream as the bridge's metrics report it.
type Health uint8

const (
	// Normal: no drops in the last interval and the peer is there.
	Normal Health = iota
	// Sick: packets were dropped in the last interval (the application
	// does not keep up); the stream still works.
	Sick
	// Broken: the peer is gone or corrupted shared state; the stream is
	// dead and will not recover.
	Broken
)

func (h Health) String() string {
	switch h {
	case Normal:
		return "normal"
	case Sick:
		return "sick"
	default:
		return "broken"
	}
}

// condition is what every stream end, of either transport, knows of its
// own life: closed by its owner, broken by a failure (the first reason
// kept), and the drop counts that make it sick for a health interval.
type condition struct {
	closed atomic.Bool
	broken atomic.Bool
	errMu  sync.Mutex
	err    error

	dropped            atomic.Uint64
	tickPrev, tickLast atomic.Uint64 // drop counts at the last two ticks
}

// breakWith marks the end broken, keeping err only if it is the first
// reason; waking whoever waits on the end is the caller's job.
func (c *condition) breakWith(err error) {
	c.errMu.Lock()
	if c.err == nil {
		c.err = errors.Join(ErrBroken, err)
	}
	c.errMu.Unlock()
	c.broken.Store(true)
}

// ended reports an end that is closed or broken.
func (c *condition) ended() bool { return c.closed.Load() || c.broken.Load() }

// failure is ErrClosed once closed, the first reason once broken, nil
// while alive.
func (c *condition) failure() error {
	if c.closed.Load() {
		return ErrClosed
	}
	if !c.broken.Load() {
		return nil
	}
	c.errMu.Lock()
	defer c.errMu.Unlock()
	return c.err
}

// health is Broken once ended, Sick if packets were dropped since the
// tick before last, Normal otherwise.
func (c *condition) health() Health {
	if c.ended() {
		return Broken
	}
	if c.dropped.Load() > c.tickPrev.Load() {
		return Sick
	}
	return Normal
}

// tick ends a health interval, so that Sick means "dropped recently".
func (c *condition) tick() {
	c.tickPrev.Store(c.tickLast.Load())
	c.tickLast.Store(c.dropped.Load())
}

// tenancy records the EventQueue a bridge end is registered with. While
// it is set, Close leaves the release of the end's memory and descriptors
// to the queue, which may still be looking at them (see EventQueue).
type tenancy struct {
	lifeMu      sync.Mutex
	queue       *EventQueue
	releaseLate bool // Close ran while queued: the queue releases
}

// leaveToQueue, called by Close, reports whether a queue holds the end
// and will release it when it lets go; if not, the caller releases.
func (t *tenancy) leaveToQueue() bool {
	t.lifeMu.Lock()
	defer t.lifeMu.Unlock()
	t.releaseLate = t.queue != nil
	return t.releaseLate
}
