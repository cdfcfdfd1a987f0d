package control

import (
	"crypto/hmac"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Policy is what one application may do. Zero fields take the defaults
// noted.
type Policy struct {
	// Addrs are the source addresses the application may use; they are
	// the addresses its stack is given. Empty: Config.Addrs.
	Addrs []netip.Addr
	// ListenPorts are the ports it may listen on by number. Empty: any port
	// outside the reserved range. (Ports of the reserved range are only
	// ever handed out by the server, for port 0 and for connect.)
	ListenPorts []classifier.PortRange
	// MaxPorts bounds the distinct ports (listeners' and connections')
	// that all the application's streams hold at once. At the bound its new
	// connections share ports its connections hold, towards other remotes.
	// Default: a quarter of the reserved range (Config.Ephemeral), so that
	// no application can take every reserved port.
	MaxPorts int
	// MaxFlows bounds the connections all its streams hold at once.
	// Default DefaultMaxFlows.
	MaxFlows int
	// MaxStreams bounds its streams (registrations) at once. Default
	// DefaultMaxStreams.
	MaxStreams int
	// MaxRingBytes bounds the memory of all its local streams' rings.
	// Default DefaultMaxRingBytes.
	MaxRingBytes int64
	// MaxSlots bounds the depth of each of the stream's rings. Default
	// 4096.
	MaxSlots int
	// UIDs, if not empty, are the only local users (by the control
	// socket's peer credentials) that may register under this name.
	UIDs []uint32
}

func (p *Policy) mayListen(port uint16) bool {
	if len(p.ListenPorts) == 0 {
		return true
	}
	for _, r := range p.ListenPorts {
		if r.Contains(port) {
			return true
		}
	}
	return false
}

// Config is everything the server needs. The daemon fills it from its
// configuration file.
type Config struct {
	// Dataplane is the bridge.
	Dataplane Dataplane
	// Addrs are the box's addresses that applications may use (the
	// default for Policy.Addrs).
	Addrs []netip.Addr
	// Ephemeral is the port range reserved from the kernel
	// (ip_local_reserved_ports) from which connect and listen-on-port-0
	// allocate.
	Ephemeral classifier.PortRange
	// MTU is that of the wire behind the bridge; applications size their
	// packets by it. Default 1500.
	MTU int
	// Stream is the default shape of a local application's stream; an
	// application may ask for other ring depths within its MaxSlots.
	Stream fabric.Config
	// Static is the configured classification; SetStatic replaces it.
	Static Static
	// FirstDynamicID is the lowest counter id the server gives to
	// listeners and flows. Keep the static entries' ids below it, so that
	// a reload adding one never finds its id taken. Default 1.
	FirstDynamicID uint32
	// Default applies to applications not named in Apps, and bounds them
	// together: their ports, connections, streams and ring memory count
	// against one quota, so that new names cannot multiply it.
	Default Policy
	// RefuseUnlisted refuses applications not named in Apps.
	RefuseUnlisted bool
	// Apps holds per-application policies by name.
	Apps map[string]Policy
	// Secret is the secret remote applications share with the bridge (at
	// least MinSecretSize bytes); Secrets overrides it per application.
	// A remote application with neither cannot connect.
	Secret  []byte
	Secrets map[string][]byte
	// Remote is the bridge's GENEVE endpoint for remote applications; nil
	// refuses them.
	Remote *fabric.Remote
	// RemoteAdvertise is the address remote applications send GENEVE to.
	// Default Remote.LocalAddr().
	RemoteAdvertise netip.AddrPort
	// Spread shapes the listeners that several instances of one
	// application share, and their port slices; it must be the same on
	// every box of a cluster.
	Spread SpreadConfig
	// HandshakeTimeout bounds hello and auth. Default 10 s.
	HandshakeTimeout time.Duration
	// Logger receives one line per session start, end and refusal.
	// Default slog.Default().
	Logger *slog.Logger
}

// Server is the control plane's server side. Serve it on a Unix listener
// for local applications and on a TCP listener for remote ones.
type Server struct {
	cfg     Config
	reg     *registry
	log     *slog.Logger
	refused *refusals
	mtu     atomic.Int32 // the wire's: Config.MTU, then SetMTU's

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	sessions  map[*session]struct{}
	closed    bool
	wg        sync.WaitGroup
}

// NewServer checks cfg, installs the static rules and returns a server.
func NewServer(cfg Config) (*Server, error) {
	if cfg.Dataplane == nil {
		return nil, errors.New("control: no data plane")
	}
	if cfg.MTU == 0 {
		cfg.MTU = 1500
	}
	if cfg.MTU < 1280 || cfg.MTU > 65535 {
		return nil, fmt.Errorf("control: MTU %d outside 1280..65535", cfg.MTU)
	}
	if cfg.Ephemeral.Lo > cfg.Ephemeral.Hi || (cfg.Ephemeral.Lo == 0 && cfg.Ephemeral.Hi != 0) {
		return nil, fmt.Errorf("control: reserved port range %d-%d is empty or includes port 0", cfg.Ephemeral.Lo, cfg.Ephemeral.Hi)
	}
	if cfg.HandshakeTimeout == 0 {
		cfg.HandshakeTimeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Remote != nil && !cfg.RemoteAdvertise.IsValid() {
		cfg.RemoteAdvertise = cfg.Remote.LocalAddr()
	}
	if cfg.Secret != nil && len(cfg.Secret) < MinSecretSize {
		return nil, fmt.Errorf("control: the shared secret is %d bytes, at least %d needed", len(cfg.Secret), MinSecretSize)
	}
	for name, s := range cfg.Secrets {
		if len(s) < MinSecretSize {
			return nil, fmt.Errorf("control: secret of application %q is %d bytes, at least %d needed", name, len(s), MinSecretSize)
		}
	}
	for _, a := range cfg.Addrs {
		if !a.IsValid() || a.IsUnspecified() || a.Is4In6() {
			return nil, fmt.Errorf("control: %v is not a usable application address", a)
		}
	}
	if cfg.Spread.DrainDeadline < 0 {
		return nil, fmt.Errorf("control: drain deadline %v is negative", cfg.Spread.DrainDeadline)
	}
	reg, err := newRegistry(cfg.Dataplane, cfg.Ephemeral, cfg.FirstDynamicID, cfg.Static, cfg.Spread, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("control: static rules: %w", err)
	}
	srv := &Server{
		cfg:       cfg,
		reg:       reg,
		log:       cfg.Logger,
		refused:   newRefusals(),
		listeners: make(map[net.Listener]struct{}),
		sessions:  make(map[*session]struct{}),
	}
	srv.mtu.Store(int32(cfg.MTU))
	return srv, nil
}

// policy returns name's policy with defaults filled in.
func (s *Server) policy(name string) Policy {
	p, ok := s.cfg.Apps[name]
	if !ok {
		p = s.cfg.Default
	}
	if len(p.Addrs) == 0 {
		p.Addrs = s.cfg.Addrs
	}
	p.Addrs = slices.Clone(p.Addrs)
	if p.MaxPorts == 0 {
		p.MaxPorts = DefaultMaxPorts
		if e := s.cfg.Ephemeral; !e.IsAny() {
			p.MaxPorts = max(1, (int(e.Hi)-int(e.Lo)+1)/4)
		}
	}
	if p.MaxFlows == 0 {
		p.MaxFlows = DefaultMaxFlows
	}
	if p.MaxStreams == 0 {
		p.MaxStreams = DefaultMaxStreams
	}
	if p.MaxRingBytes == 0 {
		p.MaxRingBytes = DefaultMaxRingBytes
	}
	if p.MaxSlots == 0 {
		p.MaxSlots = 4096
	}
	return p
}

// quotaKey names whose quota name's streams count against.
func (s *Server) quotaKey(name string) string {
	if _, listed := s.cfg.Apps[name]; listed {
		return name
	}
	return unlistedKey
}

// SetStatic replaces the configured classification (a reload). What
// applications asked for is kept, so established connections survive; if
// the new entries do not fit with it, or the data plane refuses, nothing
// changes.
func (s *Server) SetStatic(st Static) error {
	return s.reg.setStatic(st)
}

// Apps lists the registered applications.
func (s *Server) Apps() []AppInfo { return s.reg.snapshot() }

// Groups lists the listeners that several instances of one application
// share, with the instances that take new connections and those that
// drain.
func (s *Server) Groups() []GroupInfo { return s.reg.groupsInfo() }

// Settling reports whether the server is within its settle time
// (SpreadConfig.Settle): the instances that come back to a box that has
// just started are still arriving, and the box should not ask for traffic.
func (s *Server) Settling() bool {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	return s.reg.settling()
}

// Drain drains instance instance of application app, as if it had asked
// itself (Client.Drain): an operator's way to retire one instance without
// stopping it. An unknown instance is ErrNotRegistered.
func (s *Server) Drain(app, instance string) error {
	s.reg.mu.Lock()
	a := s.reg.instances[app+"/"+instance]
	s.reg.mu.Unlock()
	if a == nil || instance == "" {
		return fmt.Errorf("%w: no instance %q of application %q is registered", ErrNotRegistered, instance, app)
	}
	return s.reg.drain(a)
}

// DrainStats counts the drains so far.
func (s *Server) DrainStats() DrainStats {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	return s.reg.drains
}

// ServeLocal accepts local applications on l until l is closed or the
// server is. It returns nil after Close.
func (s *Server) ServeLocal(l *net.UnixListener) error { return s.serve(l, false) }

// ServeRemote accepts remote applications on l (normally TCP), which must
// authenticate, until l is closed or the server is.
func (s *Server) ServeRemote(l net.Listener) error { return s.serve(l, true) }

func (s *Server) serve(l net.Listener, remote bool) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return net.ErrClosed
	}
	s.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()
	for {
		conn, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		ss := &session{srv: s, conn: conn, remote: remote, handoverFD: -1}
		if uc, ok := conn.(*net.UnixConn); ok && !remote {
			ss.unix = uc
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			conn.Close()
			return nil
		}
		s.sessions[ss] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			ss.run()
			s.mu.Lock()
			delete(s.sessions, ss)
			s.mu.Unlock()
		}()
	}
}

// Close stops accepting, ends every session (each application loses what
// it held, as if it had disconnected) and waits for them.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	for l := range s.listeners {
		l.Close()
	}
	for ss := range s.sessions {
		ss.conn.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	s.reg.stopDrains()
	return nil
}

// session is one control connection: one application, one lease.
type session struct {
	srv    *Server
	conn   net.Conn
	unix   *net.UnixConn // local sessions: for SCM_RIGHTS
	remote bool

	wmu sync.Mutex
	out []byte

	// handshake
	helloDone bool
	authed    bool
	name      string
	cnonce    []byte
	snonce    []byte
	secret    []byte

	app        *app
	pushable   atomic.Bool          // registered: pushes may go out
	stream     *fabric.BridgeStream // local
	handoverFD int                  // local: the bridge's end of the handover pair until used; -1 otherwise
	rs         *fabric.RemoteStream // remote
}

// errEnd ends a session after its reply is sent.
type errEnd struct{ error }

func (e errEnd) Unwrap() error { return e.error }

func (ss *session) run() {
	log := ss.srv.log.With("peer", ss.conn.RemoteAddr().String(), "remote", ss.remote)
	defer ss.conn.Close()
	defer ss.end(log)
	ss.conn.SetDeadline(time.Now().Add(ss.srv.cfg.HandshakeTimeout))
	var buf []byte
	for {
		body, err := readFrame(ss.conn, buf)
		if err != nil {
			if errors.Is(err, errFrameTooBig) {
				ss.srv.refused.add(err)
				ss.send(Reply{Error: wireError(err)}, nil)
			}
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				log.Info("control session ends", "app", ss.name, "reason", err)
			}
			return
		}
		buf = body[:0]
		var req Request
		if err := decodeStrict(body, &req); err != nil {
			ss.srv.refused.add(ErrBadRequest)
			ss.send(Reply{ID: bestEffortID(body), Error: wireError(fmt.Errorf("%w: %v", ErrBadRequest, err))}, nil)
			if !ss.authed {
				return // a peer that cannot say hello properly gets no second try
			}
			continue
		}
		rep, rights, err := ss.handle(&req)
		rep.ID = req.ID
		if err != nil {
			ss.srv.refused.add(err)
			rep = Reply{ID: req.ID, Error: wireError(err)}
			log.Debug("control request refused", "app", ss.name, "op", req.Op, "error", err)
		}
		if werr := ss.send(rep, rights); werr != nil {
			return
		}
		if rights != nil {
			unix.Close(rights[0])
			if herr := ss.finishHandover(); herr != nil {
				log.Warn("stream handover failed", "app", ss.name, "error", herr)
				return
			}
		}
		var end errEnd
		if errors.As(err, &end) {
			log.Info("control session refused", "app", ss.name, "reason", end.error)
			return
		}
		if ss.authed && !ss.helloDone {
			ss.helloDone = true
			ss.conn.SetDeadline(time.Time{})
		}
	}
}

// bestEffortID fishes the id out of a request that failed strict decoding,
// so that the client can match the error to its request.
func bestEffortID(body []byte) uint64 {
	var v struct {
		ID uint64 `json:"id"`
	}
	json.Unmarshal(body, &v)
	return v.ID
}

func (ss *session) send(rep Reply, rights []int) error {
	ss.wmu.Lock()
	defer ss.wmu.Unlock()
	var err error
	ss.out, err = appendFrame(ss.out[:0], rep)
	if err != nil {
		return err
	}
	if rights != nil {
		_, _, err = ss.unix.WriteMsgUnix(ss.out, unix.UnixRights(rights...), nil)
		return err
	}
	_, err = ss.conn.Write(ss.out)
	return err
}

func (ss *session) handle(req *Request) (Reply, []int, error) {
	if req.Op == OpHello {
		return ss.hello(req)
	}
	if ss.name == "" {
		return Reply{}, nil, errEnd{fmt.Errorf("%w: hello first", ErrBadRequest)}
	}
	if req.Op == OpAuth {
		return ss.auth(req)
	}
	if !ss.authed {
		return Reply{}, nil, errEnd{fmt.Errorf("%w: authenticate first", ErrAuth)}
	}
	switch req.Op {
	case OpPing:
		return Reply{}, nil, nil
	case OpRegister:
		return ss.register(req)
	case OpListen, OpConnect, OpRelease, OpDrain:
		if ss.app == nil {
			return Reply{}, nil, fmt.Errorf("%w: register first", ErrNotRegistered)
		}
	default:
		return Reply{}, nil, fmt.Errorf("%w: unknown operation %q", ErrBadRequest, req.Op)
	}
	switch req.Op {
	case OpListen:
		proto, err := parseProto(req.Proto)
		if err != nil {
			return Reply{}, nil, err
		}
		if req.Addr.Is4In6() {
			return Reply{}, nil, fmt.Errorf("%w: write IPv4 addresses in dotted form", ErrBadRequest)
		}
		listen := ss.srv.reg.listen
		if req.Reclaim {
			listen = ss.srv.reg.reclaimListener
		}
		c, err := listen(ss.app, proto, req.Addr, req.Port)
		if err != nil {
			return Reply{}, nil, err
		}
		return Reply{Claim: c.id, Port: c.port, Addr: c.addr.ip()}, nil, nil
	case OpConnect:
		proto, err := parseProto(req.Proto)
		if err != nil {
			return Reply{}, nil, err
		}
		var c *claim
		if req.Reclaim {
			c, err = ss.srv.reg.reclaimFlow(ss.app, proto, req.Addr, req.Port, req.Remote)
		} else {
			c, err = ss.srv.reg.connect(ss.app, proto, req.Addr, req.Remote)
		}
		if err != nil {
			return Reply{}, nil, err
		}
		return Reply{Claim: c.id, Port: c.port, Addr: c.addr.ip()}, nil, nil
	case OpDrain:
		return Reply{}, nil, ss.srv.reg.drain(ss.app)
	default: // OpRelease
		if req.Claim == 0 {
			return Reply{}, nil, fmt.Errorf("%w: release needs a claim", ErrBadRequest)
		}
		return Reply{}, nil, ss.srv.reg.release(ss.app, req.Claim)
	}
}

func parseProto(s string) (classifier.Protocol, error) {
	switch s {
	case "tcp":
		return classifier.ProtoTCP, nil
	case "udp":
		return classifier.ProtoUDP, nil
	}
	return 0, fmt.Errorf("%w: proto must be \"tcp\" or \"udp\", not %q", ErrBadRequest, s)
}

// validName keeps application names printable and short, since they end up
// in logs and metrics labels.
func validName(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

func (ss *session) hello(req *Request) (Reply, []int, error) {
	if ss.name != "" {
		return Reply{}, nil, fmt.Errorf("%w: hello twice", ErrBadRequest)
	}
	if req.Version < 1 {
		return Reply{}, nil, errEnd{fmt.Errorf("%w: client speaks version %d, this bridge speaks %d", ErrVersion, req.Version, Version)}
	}
	if !validName(req.App) {
		return Reply{}, nil, errEnd{fmt.Errorf("%w: application name must be 1-64 characters of [A-Za-z0-9._-]", ErrBadRequest)}
	}
	if _, listed := ss.srv.cfg.Apps[req.App]; !listed && ss.srv.cfg.RefuseUnlisted {
		return Reply{}, nil, errEnd{&reasonError{ReasonUnlisted, fmt.Errorf("%w: application %q is not configured on this bridge", ErrNotPermitted, req.App)}}
	}
	if !ss.remote {
		if uids := ss.srv.policy(req.App).UIDs; len(uids) > 0 {
			uid, err := peerUID(ss.unix)
			if err != nil || !slices.Contains(uids, uid) {
				return Reply{}, nil, errEnd{fmt.Errorf("%w: this user may not register as %q", ErrNotPermitted, req.App)}
			}
		}
		ss.name = req.App
		ss.authed = true
		return Reply{Version: Version}, nil, nil
	}
	if len(req.Nonce) != NonceSize {
		return Reply{}, nil, errEnd{fmt.Errorf("%w: a remote hello needs a %d-byte nonce", ErrBadRequest, NonceSize)}
	}
	ss.name = req.App
	ss.cnonce = req.Nonce
	ss.snonce = nonce()
	ss.secret = ss.srv.cfg.Secret
	if s, ok := ss.srv.cfg.Secrets[req.App]; ok {
		ss.secret = s
	}
	key := ss.secret
	if key == nil {
		key = nonce() // unknown name: a MAC nobody can check, same shape
	}
	return Reply{Version: Version, Nonce: ss.snonce, MAC: proof(key, labelBridge, ss.name, ss.cnonce, ss.snonce)}, nil, nil
}

// peerUID is the user at the other end of a Unix socket.
func peerUID(c *net.UnixConn) (uint32, error) {
	if c == nil {
		return 0, errors.New("not a Unix socket")
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if gerr != nil {
		return 0, gerr
	}
	return cred.Uid, nil
}

func (ss *session) auth(req *Request) (Reply, []int, error) {
	if !ss.remote || ss.authed {
		return Reply{}, nil, fmt.Errorf("%w: nothing to authenticate", ErrBadRequest)
	}
	if ss.secret == nil || !hmac.Equal(req.MAC, proof(ss.secret, labelApp, ss.name, ss.cnonce, ss.snonce)) {
		return Reply{}, nil, errEnd{ErrAuth}
	}
	ss.authed = true
	return Reply{}, nil, nil
}

func (ss *session) register(req *Request) (Reply, []int, error) {
	if ss.app != nil {
		return Reply{}, nil, fmt.Errorf("%w: already registered", ErrBadRequest)
	}
	if req.Instance != "" && !validName(req.Instance) {
		return Reply{}, nil, fmt.Errorf("%w: instance name must be 1-64 characters of [A-Za-z0-9._-]", ErrBadRequest)
	}
	pol := ss.srv.policy(ss.name)
	if ss.remote {
		return ss.registerRemote(req, pol)
	}
	if req.Geneve.IsValid() {
		return Reply{}, nil, fmt.Errorf("%w: a local application gets a shared-memory stream, not GENEVE", ErrBadRequest)
	}
	cfg := ss.srv.cfg.Stream
	for _, v := range []struct {
		asked int
		field *int
	}{{req.RxSlots, &cfg.RxSlots}, {req.TxSlots, &cfg.TxSlots}} {
		switch {
		case v.asked < 0 || v.asked&(v.asked-1) != 0:
			return Reply{}, nil, fmt.Errorf("%w: ring depth %d is not a power of two", ErrBadRequest, v.asked)
		case v.asked > pol.MaxSlots:
			return Reply{}, nil, quotaErr(ReasonQuotaSlots, "ring depth %d beyond this application's %d", v.asked, pol.MaxSlots)
		case v.asked > 0:
			*v.field = v.asked
		}
	}
	// The quota is checked before the rings are made, so that a refused
	// registration costs no memory; register checks it again atomically.
	key, rings := ss.srv.quotaKey(ss.name), ringBytes(cfg)
	if err := ss.srv.reg.admit(key, pol, rings); err != nil {
		return Reply{}, nil, err
	}
	st, err := fabric.NewShm(cfg)
	if err != nil {
		return Reply{}, nil, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		st.Close()
		return Reply{}, nil, fmt.Errorf("%w: socketpair: %v", ErrInternal, err)
	}
	a, err := ss.srv.reg.register(ss.name, req.Instance, key, pol, rings, func(id uint32, own classifier.Ownership) error {
		if err := ss.srv.cfg.Dataplane.AddStream(id, st, own); err != nil {
			return dataplaneErr(err)
		}
		return nil
	})
	if err != nil {
		st.Close()
		unix.Close(pair[0])
		unix.Close(pair[1])
		return Reply{}, nil, err
	}
	ss.app = a
	ss.stream = st
	ss.handoverFD = pair[0]
	ss.srv.log.Info("application registered", "app", ss.name, "instance", a.instance, "stream", a.stream, "transport", "shm")
	return ss.registered(a, pol), []int{pair[1]}, nil
}

func (ss *session) registered(a *app, pol Policy) Reply {
	ss.pushable.Store(true)
	return Reply{Stream: a.stream, Addrs: pol.Addrs, MTU: ss.srv.MTU(), Ports: ss.srv.cfg.Ephemeral}
}

// finishHandover runs fabric's handshake over the bridge's end of the pair
// whose other end went out with the register reply.
func (ss *session) finishHandover() error {
	f := os.NewFile(uintptr(ss.handoverFD), "fabric-handover")
	ss.handoverFD = -1
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return errors.New("handover socket is not a Unix socket")
	}
	return ss.stream.Handover(uc)
}

func (ss *session) registerRemote(req *Request, pol Policy) (Reply, []int, error) {
	r := ss.srv.cfg.Remote
	if r == nil {
		return Reply{}, nil, fmt.Errorf("%w: this bridge serves no remote applications", ErrNotPermitted)
	}
	if req.RxSlots != 0 || req.TxSlots != 0 {
		return Reply{}, nil, fmt.Errorf("%w: ring depths are the remote transport's", ErrBadRequest)
	}
	peer := req.Geneve
	if !peer.IsValid() || peer.Port() == 0 {
		return Reply{}, nil, fmt.Errorf("%w: register needs the application's GENEVE address and port", ErrBadRequest)
	}
	ctl, err := netip.ParseAddrPort(ss.conn.RemoteAddr().String())
	if err != nil {
		return Reply{}, nil, fmt.Errorf("%w: control peer %v: %v", ErrInternal, ss.conn.RemoteAddr(), err)
	}
	src := ctl.Addr().Unmap()
	switch pa := peer.Addr().Unmap(); {
	case pa.IsUnspecified():
		peer = netip.AddrPortFrom(src, peer.Port())
	case pa != src:
		return Reply{}, nil, fmt.Errorf("%w: GENEVE address %v is not this connection's source %v", ErrNotPermitted, pa, src)
	}
	// A remote stream's buffers are the remote transport's, bounded by it;
	// it counts as a stream, with no ring memory of its own here.
	a, err := ss.srv.reg.register(ss.name, req.Instance, ss.srv.quotaKey(ss.name), pol, 0, func(id uint32, own classifier.Ownership) error {
		rs, err := r.Register(id, peer)
		if err != nil {
			return fmt.Errorf("%w: %v", ErrInternal, err)
		}
		if err := ss.srv.cfg.Dataplane.AddRemoteStream(id, rs, own); err != nil {
			rs.Close()
			return dataplaneErr(err)
		}
		ss.rs = rs
		return nil
	})
	if err != nil {
		return Reply{}, nil, err
	}
	ss.app = a
	ss.srv.log.Info("application registered", "app", ss.name, "instance", a.instance, "stream", a.stream, "transport", "geneve", "peer", peer)
	rep := ss.registered(a, pol)
	rep.Geneve = ss.srv.cfg.RemoteAdvertise
	return rep, nil, nil
}

// end is the lease running out: everything the application held goes.
func (ss *session) end(log *slog.Logger) {
	if ss.handoverFD >= 0 {
		unix.Close(ss.handoverFD)
	}
	if ss.app == nil {
		return
	}
	if err := ss.srv.reg.unregister(ss.app); err != nil {
		log.Warn("data plane refused part of an application's removal", "app", ss.name, "stream", ss.app.stream, "error", err)
	}
	if ss.stream != nil {
		ss.stream.Close()
	}
	if ss.rs != nil {
		ss.rs.Close()
	}
	log.Info("application gone", "app", ss.name, "stream", ss.app.stream)
}
