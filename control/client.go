package control

import (
	"bufio"
	"context"
	"crypto/hmac"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// Client is an application's control connection. Its methods may be called
// concurrently. When the connection is lost every call fails with
// ErrBridgeGone and Done is closed.
type Client struct {
	conn net.Conn
	unix *net.UnixConn // local only
	app  string
	// instance is sent with register (SetInstance).
	instance string

	wmu  sync.Mutex
	wbuf []byte

	mu      sync.Mutex
	next    uint64
	pending map[uint64]*pendingCall
	fds     []int // descriptors that arrived (with the register reply)
	err     error // why the connection ended
	done    chan struct{}
	onMTU   mtuHook // push.go
}

type pendingCall struct {
	ch        chan Reply
	abandoned bool // the caller gave up: release whatever the reply grants
}

// Registration is what register returned: the application's stream id,
// the source addresses its stack should use, the MTU of the path behind
// the bridge, the reserved range its ephemeral ports come from and, for a
// remote application, the bridge's GENEVE endpoint.
type Registration struct {
	Stream uint32
	Addrs  []netip.Addr
	MTU    int
	Ports  classifier.PortRange
	Geneve netip.AddrPort
}

// Claim is a listener or flow the bridge granted: release it by ID. Addr
// and Port are the local address and port it covers (for connect, the
// source to bind to).
type Claim struct {
	ID   uint64
	Addr netip.Addr
	Port uint16
}

// Unreachable is the error for a control socket (a path or a TCP address)
// that dialling failed with err: ErrBridgeGone to errors.Is, and, when
// nothing listens there, "no fabricbridge daemon at ADDR (is it running?)".
func Unreachable(addr string, err error) error { return &unreachableError{addr: addr, err: err} }

// unreachableError is a control socket no daemon answers on. It is
// ErrBridgeGone to errors.Is, but says what a user needs to know first.
type unreachableError struct {
	addr string
	err  error
}

func (e *unreachableError) Error() string {
	if errors.Is(e.err, unix.ENOENT) || errors.Is(e.err, unix.ECONNREFUSED) {
		return fmt.Sprintf("no fabricbridge daemon at %s (is it running?)", e.addr)
	}
	return fmt.Sprintf("cannot reach the fabricbridge daemon at %s: %v", e.addr, e.err)
}

func (e *unreachableError) Is(target error) bool { return target == ErrBridgeGone }
func (e *unreachableError) Unwrap() error        { return e.err }

// DialLocal connects to a bridge's control socket at path and says hello.
func DialLocal(ctx context.Context, path, app string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, &unreachableError{addr: path, err: err}
	}
	c := newClient(conn, app)
	if _, err := c.call(ctx, &Request{Op: OpHello, Version: Version, App: app}); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// DialRemote connects to a bridge's control port over TCP and runs the
// mutual challenge-response with secret (see docs/control.md).
func DialRemote(ctx context.Context, addr, app string, secret []byte) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, &unreachableError{addr: addr, err: err}
	}
	return DialRemoteConn(ctx, conn, app, secret)
}

// DialRemoteConn is DialRemote over a connection the caller made, for
// example a *tls.Conn to a bridge that wants mutual TLS as well. The
// client owns conn afterwards (it is closed on error too).
func DialRemoteConn(ctx context.Context, conn net.Conn, app string, secret []byte) (*Client, error) {
	if len(secret) < MinSecretSize {
		conn.Close()
		return nil, fmt.Errorf("%w: secret shorter than %d bytes", ErrAuth, MinSecretSize)
	}
	c := newClient(conn, app)
	fail := func(err error) (*Client, error) {
		c.Close()
		return nil, err
	}
	cn := nonce()
	rep, err := c.call(ctx, &Request{Op: OpHello, Version: Version, App: app, Nonce: cn})
	if err != nil {
		return fail(err)
	}
	if len(rep.Nonce) != NonceSize || !hmac.Equal(rep.MAC, proof(secret, labelBridge, app, cn, rep.Nonce)) {
		return fail(fmt.Errorf("%w: the bridge could not prove it knows the secret", ErrAuth))
	}
	if _, err := c.call(ctx, &Request{Op: OpAuth, MAC: proof(secret, labelApp, app, cn, rep.Nonce)}); err != nil {
		return fail(err)
	}
	return c, nil
}

func newClient(conn net.Conn, app string) *Client {
	c := &Client{conn: conn, app: app, pending: make(map[uint64]*pendingCall), done: make(chan struct{})}
	c.unix, _ = conn.(*net.UnixConn)
	go c.readLoop()
	return c
}

// Done is closed when the control connection has ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err says why the connection ended (nil while it is up).
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close ends the connection, and with it the lease: the bridge releases
// everything this application held.
func (c *Client) Close() error {
	err := c.conn.Close()
	<-c.done
	c.mu.Lock()
	for _, fd := range c.fds {
		unix.Close(fd)
	}
	c.fds = nil
	c.mu.Unlock()
	return err
}

// fdReader reads the Unix socket and keeps any descriptors that come with
// the bytes.
type fdReader struct {
	c   *Client
	oob []byte
}

func (r *fdReader) Read(p []byte) (int, error) {
	n, oobn, _, _, err := r.c.unix.ReadMsgUnix(p, r.oob)
	n = max(n, 0) // -1 on some errors
	if oobn > 0 {
		msgs, _ := unix.ParseSocketControlMessage(r.oob[:oobn])
		for i := range msgs {
			fds, _ := unix.ParseUnixRights(&msgs[i])
			r.c.mu.Lock()
			r.c.fds = append(r.c.fds, fds...)
			r.c.mu.Unlock()
		}
	}
	return n, err
}

func (c *Client) readLoop() {
	var r *bufio.Reader
	if c.unix != nil {
		r = bufio.NewReader(&fdReader{c: c, oob: make([]byte, unix.CmsgSpace(8*4))})
	} else {
		r = bufio.NewReader(c.conn)
	}
	var buf []byte
	var err error
	for {
		var body []byte
		body, err = readFrame(r, buf)
		if err != nil {
			break
		}
		buf = body[:0]
		var rep Reply
		if err = json.Unmarshal(body, &rep); err != nil {
			err = fmt.Errorf("bridge sent a malformed reply: %v", err)
			break
		}
		c.mu.Lock()
		p := c.pending[rep.ID]
		delete(c.pending, rep.ID)
		c.mu.Unlock()
		switch {
		case p == nil && rep.ID == 0:
			c.pushed(rep)
		case p == nil:
			// An answer to nothing we asked: ignore it.
		case p.abandoned:
			if rep.Error == nil && rep.Claim != 0 {
				go c.Release(context.Background(), rep.Claim)
			}
		default:
			p.ch <- rep
		}
	}
	c.mu.Lock()
	c.err = fmt.Errorf("%w: control connection: %v", ErrBridgeGone, err)
	c.pending = nil
	c.mu.Unlock()
	close(c.done)
	c.conn.Close()
}

// call sends req and waits for its reply; an error reply becomes an error
// wrapping its sentinel.
func (c *Client) call(ctx context.Context, req *Request) (Reply, error) {
	p := &pendingCall{ch: make(chan Reply, 1)}
	c.mu.Lock()
	if c.pending == nil {
		err := c.err
		c.mu.Unlock()
		return Reply{}, err
	}
	c.next++
	req.ID = c.next
	c.pending[req.ID] = p
	c.mu.Unlock()

	c.wmu.Lock()
	var err error
	c.wbuf, err = appendFrame(c.wbuf[:0], req)
	if err == nil {
		if dl, ok := ctx.Deadline(); ok {
			c.conn.SetWriteDeadline(dl)
		} else {
			c.conn.SetWriteDeadline(time.Time{})
		}
		_, err = c.conn.Write(c.wbuf)
	}
	c.wmu.Unlock()
	if err != nil {
		c.conn.Close() // a half-written frame cannot be taken back
		<-c.done
		return Reply{}, c.Err()
	}
	select {
	case rep := <-p.ch:
		return result(rep)
	case <-ctx.Done():
		c.mu.Lock()
		if c.pending != nil && c.pending[req.ID] == p {
			p.abandoned = true
		}
		c.mu.Unlock()
		// The reply may have arrived meanwhile; then honour it.
		select {
		case rep := <-p.ch:
			return result(rep)
		default:
		}
		return Reply{}, ctx.Err()
	case <-c.done:
		// A reply that came just before the end (an error the server
		// closed the connection after) still counts.
		select {
		case rep := <-p.ch:
			return result(rep)
		default:
		}
		return Reply{}, c.Err()
	}
}

// result turns an error reply into its error.
func result(rep Reply) (Reply, error) {
	if rep.Error != nil {
		return rep, rep.Error.Err()
	}
	return rep, nil
}

func registration(rep Reply) Registration {
	return Registration{Stream: rep.Stream, Addrs: rep.Addrs, MTU: rep.MTU, Ports: rep.Ports, Geneve: rep.Geneve}
}

// SetInstance names this process among its application's instances for the
// registration that follows (see Request.Instance); call it before
// RegisterLocal or RegisterRemote, with the same name at every bridge.
func (c *Client) SetInstance(name string) { c.instance = name }

// RegisterLocal asks for the application's shared-memory stream (ring
// depths 0: the bridge's default) and attaches it.
func (c *Client) RegisterLocal(ctx context.Context, rxSlots, txSlots int) (Registration, *fabric.Stream, error) {
	if c.unix == nil {
		return Registration{}, nil, fmt.Errorf("%w: a shared-memory stream needs the local control socket", ErrBadRequest)
	}
	rep, err := c.call(ctx, &Request{Op: OpRegister, RxSlots: rxSlots, TxSlots: txSlots, Instance: c.instance})
	if err != nil {
		return Registration{}, nil, err
	}
	c.mu.Lock()
	fds := c.fds
	c.fds = nil
	c.mu.Unlock()
	if len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return Registration{}, nil, fmt.Errorf("%w: register reply carried %d descriptors, want 1", ErrInternal, len(fds))
	}
	f := os.NewFile(uintptr(fds[0]), "fabric-handover")
	conn, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return Registration{}, nil, fmt.Errorf("%w: handover socket: %v", ErrInternal, err)
	}
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		conn.Close()
		return Registration{}, nil, fmt.Errorf("%w: handover socket is not a Unix socket", ErrInternal)
	}
	st, err := fabric.AttachShm(uc)
	if err != nil {
		return Registration{}, nil, err
	}
	return registration(rep), st, nil
}

// RegisterRemote tells the bridge where this application's GENEVE endpoint
// is (an unspecified address means the control connection's source) and
// returns, among the rest, the bridge's GENEVE endpoint. Register the stream
// on the local fabric.Remote with VNI = Registration.Stream afterwards.
func (c *Client) RegisterRemote(ctx context.Context, geneve netip.AddrPort) (Registration, error) {
	rep, err := c.call(ctx, &Request{Op: OpRegister, Geneve: geneve, Instance: c.instance})
	if err != nil {
		return Registration{}, err
	}
	if !rep.Geneve.IsValid() {
		return Registration{}, fmt.Errorf("%w: bridge named no GENEVE endpoint", ErrInternal)
	}
	return registration(rep), nil
}

// LocalAddr is the control connection's local address (for a remote
// application: the address the bridge sees it from).
func (c *Client) LocalAddr() net.Addr { return c.conn.LocalAddr() }

// Listen claims proto ("tcp" or "udp") packets to addr:port; an invalid
// addr means any address of either family, port 0 a free port of the
// reserved range.
func (c *Client) Listen(ctx context.Context, proto string, addr netip.Addr, port uint16) (Claim, error) {
	rep, err := c.call(ctx, &Request{Op: OpListen, Proto: proto, Addr: addr, Port: port})
	if err != nil {
		return Claim{}, err
	}
	return Claim{ID: rep.Claim, Addr: rep.Addr, Port: rep.Port}, nil
}

// Connect gets a port of the reserved range for a conversation from local
// (invalid: the bridge picks) to remote; the flow is steered to this
// application when it returns.
func (c *Client) Connect(ctx context.Context, proto string, local netip.Addr, remote netip.AddrPort) (Claim, error) {
	rep, err := c.call(ctx, &Request{Op: OpConnect, Proto: proto, Addr: local, Remote: remote})
	if err != nil {
		return Claim{}, err
	}
	if rep.Claim == 0 || rep.Port == 0 || !rep.Addr.IsValid() {
		return Claim{}, fmt.Errorf("%w: incomplete connect reply", ErrInternal)
	}
	return Claim{ID: rep.Claim, Addr: rep.Addr, Port: rep.Port}, nil
}

// Reclaim asks again for a listener (remote invalid) or flow that this
// application held under an earlier lease, before the bridge restarted:
// exactly proto, addr and port (for a flow: local address addr and port
// to remote), ports of the reserved range included. A port another
// application took meanwhile is refused with ErrPortInUse.
func (c *Client) Reclaim(ctx context.Context, proto string, addr netip.Addr, port uint16, remote netip.AddrPort) (Claim, error) {
	op := OpListen
	if remote.IsValid() {
		op = OpConnect
	}
	rep, err := c.call(ctx, &Request{Op: op, Proto: proto, Addr: addr, Port: port, Remote: remote, Reclaim: true})
	if err != nil {
		return Claim{}, err
	}
	return Claim{ID: rep.Claim, Addr: rep.Addr, Port: rep.Port}, nil
}

// Release gives a claim back.
func (c *Client) Release(ctx context.Context, id uint64) error {
	_, err := c.call(ctx, &Request{Op: OpRelease, Claim: id})
	return err
}

// Drain asks the bridge to send this instance no new connections on the
// listeners it shares with other instances of its application, while its
// established ones keep reaching it until they end or the bridge's drain
// deadline passes; then it no longer holds those listeners. Only an
// instance (SetInstance) can drain.
func (c *Client) Drain(ctx context.Context) error {
	_, err := c.call(ctx, &Request{Op: OpDrain})
	return err
}

// Ping waits for the bridge to answer an empty request (OpPing) within
// ctx. Any reply, an error too (a bridge older than the op answers
// bad_request), means the bridge's process reads its control connection;
// only ctx's error or the connection's end mean it does not.
func (c *Client) Ping(ctx context.Context) error {
	rep, err := c.call(ctx, &Request{Op: OpPing})
	if rep.Error != nil {
		return nil
	}
	return err
}

// ErrorCode returns the wire code of an error from this package ("" if it
// is none of them), for logs and metrics.
func ErrorCode(err error) string {
	for _, c := range codes {
		if errors.Is(err, c.err) {
			return c.code
		}
	}
	return ""
}
