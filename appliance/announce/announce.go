// Package announce tells the routers upstream of a box, over BGP, that the
// box can serve the service addresses, and takes it back before the box
// stops being able to.
//
// Routers spread packets over every box that announces an address (ECMP),
// so an announcement is a promise: a box announces only while a readiness
// predicate holds, withdraws as soon as it stops holding, and withdraws
// before it stops. The BGP speaker is GoBGP, embedded as a library; with
// BFD enabled, a router notices a box that died without a word within the
// BFD detection time instead of the BGP hold time.
//
//	a, err := announce.Start(ctx, announce.Config{
//		ASN: 65001, RouterID: netip.MustParseAddr("198.18.0.2"),
//		Neighbors: []announce.Neighbor{{Address: netip.MustParseAddr("198.18.0.1"), ASN: 65000}},
//		Addresses: []netip.Addr{netip.MustParseAddr("198.18.100.1")},
//		Ready:     func() bool { return attached() && instances() > 0 },
//	})
//	...
//	a.Stop(ctx) // withdraws, lets the routers converge, closes the sessions
package announce

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/google/uuid"
	api "github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"
)

// Defaults for the zero fields of Config.
const (
	DefaultHoldTime      = 9 * time.Second
	DefaultConnectRetry  = 5 * time.Second
	DefaultCheckInterval = 100 * time.Millisecond
	DefaultWithdrawDelay = time.Second
)

// Neighbor is a BGP peer: an upstream router.
type Neighbor struct {
	Address netip.Addr
	ASN     uint32
}

// BFD sets the Bidirectional Forwarding Detection timers of every session.
// A peer that misses Multiplier packets in a row, sent every MinRx at the
// least, is declared down: 3 × 100 ms detects a dead box in 300 ms.
type BFD struct {
	MinTx, MinRx time.Duration
	Multiplier   uint8
}

// Config is what an Announcer announces, to whom and when.
type Config struct {
	// ASN and RouterID identify this box's BGP speaker. RouterID must be
	// an IPv4 address (BGP's identifier is 32 bits even on IPv6 sessions).
	ASN      uint32
	RouterID netip.Addr
	// ListenPort is the TCP port to accept sessions on; 0 does not listen,
	// and the box opens every session itself. Not listening keeps port 179
	// free for a routing daemon on the box.
	ListenPort uint16
	Neighbors  []Neighbor
	// HoldTime is BGP's hold time (keepalives go every third of it).
	HoldTime time.Duration
	// ConnectRetry is how long to wait before reopening a failed session.
	ConnectRetry time.Duration
	// BFD, if not nil, runs BFD with every neighbour; the router must run
	// it too (bfd on, in BIRD's bgp protocol), or the session stays down.
	BFD *BFD

	// Addresses are announced as host routes (/32, /128), with this box
	// as the next hop. An IPv4 address goes to the IPv4 neighbours, an
	// IPv6 one to the IPv6 neighbours.
	Addresses []netip.Addr
	// Ready says whether the box can serve the addresses now. It is called
	// every CheckInterval and must be quick; nil means always ready.
	Ready         func() bool
	CheckInterval time.Duration
	// WithdrawDelay is how long Stop waits between withdrawing the routes
	// and closing the sessions, so that routers have moved the traffic
	// away before the box stops serving it.
	WithdrawDelay time.Duration

	Logger *slog.Logger
}

// Announcer runs one BGP speaker that announces Config.Addresses while
// Config.Ready holds.
type Announcer struct {
	cfg Config
	bgp *server.BgpServer
	log *slog.Logger

	recheck chan struct{}
	stop    chan struct{}
	done    chan struct{}

	mu        sync.Mutex
	announced []uuid.UUID // nil while withdrawn
	drained   bool        // withdrawn for good (Withdraw or Stop)
	stopOnce  sync.Once
	stopErr   error
}

// Check reports everything wrong with cfg at once.
func (cfg *Config) Check() error {
	var errs []error
	if cfg.ASN == 0 {
		errs = append(errs, errors.New("asn is missing"))
	}
	if !cfg.RouterID.Is4() {
		errs = append(errs, fmt.Errorf("router_id %v is not an IPv4 address", cfg.RouterID))
	}
	if len(cfg.Neighbors) == 0 {
		errs = append(errs, errors.New("no neighbours"))
	}
	has := map[bool]bool{} // is4 -> a neighbour of that family exists
	seen := map[netip.Addr]bool{}
	for _, n := range cfg.Neighbors {
		switch {
		case !n.Address.IsValid():
			errs = append(errs, errors.New("a neighbour has no address"))
		case seen[n.Address]:
			errs = append(errs, fmt.Errorf("neighbour %v is listed twice", n.Address))
		case n.ASN == 0:
			errs = append(errs, fmt.Errorf("neighbour %v has no asn", n.Address))
		}
		seen[n.Address] = true
		has[n.Address.Unmap().Is4()] = true
	}
	for _, a := range cfg.Addresses {
		if !has[a.Unmap().Is4()] {
			errs = append(errs, fmt.Errorf("address %v has no neighbour of its family to be announced to", a))
		}
	}
	if b := cfg.BFD; b != nil && (b.MinTx <= 0 || b.MinRx <= 0 || b.Multiplier == 0) {
		errs = append(errs, errors.New("bfd needs positive intervals and multiplier"))
	}
	return errors.Join(errs...)
}

func (cfg *Config) withDefaults() Config {
	c := *cfg
	if c.HoldTime == 0 {
		c.HoldTime = DefaultHoldTime
	}
	if c.ConnectRetry == 0 {
		c.ConnectRetry = DefaultConnectRetry
	}
	if c.CheckInterval == 0 {
		c.CheckInterval = DefaultCheckInterval
	}
	if c.WithdrawDelay == 0 {
		c.WithdrawDelay = DefaultWithdrawDelay
	}
	if c.Ready == nil {
		c.Ready = func() bool { return true }
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Start starts the BGP speaker, opens the sessions and begins announcing as
// soon as Ready holds. The speaker's sockets live in the network namespace
// of the calling process.
func Start(ctx context.Context, cfg Config) (*Announcer, error) {
	if err := cfg.Check(); err != nil {
		return nil, fmt.Errorf("announce: %w", err)
	}
	c := cfg.withDefaults()
	// GoBGP logs every step of every session at info; its level variable
	// only serves its own API, so the filter goes on the handler.
	level := new(slog.LevelVar)
	level.Set(slog.LevelWarn)
	bgpLog := slog.New(minLevel{c.Logger.Handler(), level}).With("component", "bgp")
	s := server.NewBgpServer(server.LoggerOption(bgpLog, level))
	go s.Serve()

	listen := int32(-1)
	if c.ListenPort != 0 {
		listen = int32(c.ListenPort)
	}
	if err := s.StartBgp(ctx, &api.StartBgpRequest{Global: &api.Global{
		Asn: c.ASN, RouterId: c.RouterID.String(), ListenPort: listen,
	}}); err != nil {
		s.Stop()
		return nil, fmt.Errorf("announce: starting BGP: %w", err)
	}
	// The routers' routes are not filtered out: GoBGP's global import
	// policy would also reject the box's own paths. They stay in GoBGP's
	// table and go nowhere (it installs nothing in the kernel); the router
	// side exports nothing to the boxes (docs/scale-out.md).
	for _, n := range c.Neighbors {
		if err := s.AddPeer(ctx, &api.AddPeerRequest{Peer: peer(&c, n)}); err != nil {
			s.Stop()
			return nil, fmt.Errorf("announce: neighbour %v: %w", n.Address, err)
		}
	}
	a := &Announcer{
		cfg: c, bgp: s, log: c.Logger,
		recheck: make(chan struct{}, 1),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	go a.run()
	return a, nil
}

func peer(c *Config, n Neighbor) *api.Peer {
	p := &api.Peer{
		Conf: &api.PeerConf{NeighborAddress: n.Address.String(), PeerAsn: n.ASN},
		Timers: &api.Timers{Config: &api.TimersConfig{
			ConnectRetry:      uint64(c.ConnectRetry / time.Second),
			HoldTime:          uint64(c.HoldTime / time.Second),
			KeepaliveInterval: uint64(max(c.HoldTime/3/time.Second, 1)),
		}},
	}
	if b := c.BFD; b != nil {
		p.Bfd = &api.BfdPeerConfig{
			Enabled:                  true,
			DesiredMinimumTxInterval: uint32(b.MinTx / time.Microsecond),
			RequiredMinimumReceive:   uint32(b.MinRx / time.Microsecond),
			DetectionMultiplier:      uint32(b.Multiplier),
		}
	}
	return p
}

// run follows Ready until Stop.
func (a *Announcer) run() {
	defer close(a.done)
	tick := time.NewTicker(a.cfg.CheckInterval)
	defer tick.Stop()
	for {
		a.mu.Lock()
		if !a.drained {
			if err := a.setLocked(a.cfg.Ready()); err != nil {
				a.log.Error("announce: updating the routes", "err", err)
			}
		}
		a.mu.Unlock()
		select {
		case <-a.stop:
			return
		case <-tick.C:
		case <-a.recheck:
		}
	}
}

// setLocked announces or withdraws all the addresses.
func (a *Announcer) setLocked(ready bool) error {
	switch {
	case ready && a.announced == nil:
		paths, err := hostPaths(a.cfg.Addresses)
		if err != nil {
			return err
		}
		rsp, err := a.bgp.AddPath(apiutil.AddPathRequest{Paths: paths})
		if err != nil {
			return err
		}
		ids := make([]uuid.UUID, 0, len(rsp))
		for _, r := range rsp {
			if r.Error != nil {
				err = errors.Join(err, r.Error)
				continue
			}
			ids = append(ids, r.UUID)
		}
		a.announced = ids
		a.log.Info("announce: announced", "addresses", a.cfg.Addresses)
		return err
	case !ready && a.announced != nil:
		err := a.bgp.DeletePath(apiutil.DeletePathRequest{UUIDs: a.announced})
		if err == nil {
			a.announced = nil
			a.log.Info("announce: withdrawn", "addresses", a.cfg.Addresses)
		}
		return err
	}
	return nil
}

// hostPaths builds a host route per address with an unspecified next hop,
// which GoBGP replaces with the session's local address: each router
// learns the box's address on the link it shares with it.
func hostPaths(addrs []netip.Addr) ([]*apiutil.Path, error) {
	paths := make([]*apiutil.Path, 0, len(addrs))
	for _, addr := range addrs {
		addr = addr.Unmap()
		nlri, err := bgp.NewIPAddrPrefix(netip.PrefixFrom(addr, addr.BitLen()))
		if err != nil {
			return nil, err
		}
		attrs := []bgp.PathAttributeInterface{bgp.NewPathAttributeOrigin(bgp.BGP_ORIGIN_ATTR_TYPE_IGP)}
		family := bgp.RF_IPv4_UC
		if addr.Is4() {
			nh, err := bgp.NewPathAttributeNextHop(netip.IPv4Unspecified())
			if err != nil {
				return nil, err
			}
			attrs = append(attrs, nh)
		} else {
			family = bgp.RF_IPv6_UC
			mp, err := bgp.NewPathAttributeMpReachNLRI(family, []bgp.PathNLRI{{NLRI: nlri}}, netip.IPv6Unspecified())
			if err != nil {
				return nil, err
			}
			attrs = append(attrs, mp)
		}
		paths = append(paths, &apiutil.Path{Family: family, Nlri: nlri, Attrs: attrs})
	}
	return paths, nil
}

// Recheck calls Ready now rather than at the next tick: for a caller that
// knows readiness has just changed (the data plane detached).
func (a *Announcer) Recheck() {
	select {
	case a.recheck <- struct{}{}:
	default:
	}
}

// Announced reports whether the addresses are announced now.
func (a *Announcer) Announced() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.announced != nil
}

// Withdraw withdraws the addresses for good, whatever Ready says, and waits
// WithdrawDelay (or until ctx ends) for the routers to move the traffic;
// the sessions stay up. It is the first step of a drain; Stop follows.
func (a *Announcer) Withdraw(ctx context.Context) error {
	a.mu.Lock()
	wasAnnounced := a.announced != nil
	a.drained = true
	err := a.setLocked(false)
	a.mu.Unlock()
	if err != nil || !wasAnnounced {
		return err
	}
	select {
	case <-time.After(a.cfg.WithdrawDelay):
	case <-ctx.Done():
	}
	return nil
}

// Stop withdraws the addresses (as Withdraw), then closes every session
// with a BGP Cease and stops the speaker. Once it returns, no router has
// been told this box can serve; it is safe to detach the data plane.
func (a *Announcer) Stop(ctx context.Context) error {
	a.stopOnce.Do(func() {
		err := a.Withdraw(ctx)
		close(a.stop)
		<-a.done
		a.bgp.Stop() // Cease to every neighbour, then the BFD sessions
		a.stopErr = err
	})
	return a.stopErr
}

// PeerState is one session as the speaker sees it.
type PeerState struct {
	Address     netip.Addr
	Established bool
	BFDUp       bool // false where BFD is off
}

// Peers returns the state of every session.
func (a *Announcer) Peers(ctx context.Context) ([]PeerState, error) {
	var out []PeerState
	err := a.bgp.ListPeer(ctx, &api.ListPeerRequest{}, func(p *api.Peer) {
		addr, _ := netip.ParseAddr(p.GetConf().GetNeighborAddress())
		st := p.GetState()
		out = append(out, PeerState{
			Address:     addr,
			Established: st.GetSessionState() == api.PeerState_SESSION_STATE_ESTABLISHED,
			BFDUp:       st.GetBfdState().GetSessionState() == api.BfdSessionState_BFD_SESSION_STATE_UP,
		})
	})
	return out, err
}

// minLevel passes on the records of at least its level.
type minLevel struct {
	slog.Handler
	level slog.Leveler
}

func (h minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.level.Level() && h.Handler.Enabled(ctx, l)
}

func (h minLevel) WithAttrs(attrs []slog.Attr) slog.Handler {
	return minLevel{h.Handler.WithAttrs(attrs), h.level}
}

func (h minLevel) WithGroup(name string) slog.Handler {
	return minLevel{h.Handler.WithGroup(name), h.level}
}
