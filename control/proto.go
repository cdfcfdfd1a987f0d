package control

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// Version is the protocol version this package speaks.
const Version = 1

// MaxFrame is the largest message body either side accepts.
const MaxFrame = 64 << 10

// Operations.
const (
	OpHello    = "hello"
	OpAuth     = "auth"
	OpRegister = "register"
	OpListen   = "listen"
	OpConnect  = "connect"
	OpRelease  = "release"
	// OpDrain takes the registered instance out of the tables of the
	// listeners it shares: it gets no new connections and keeps its
	// established ones until they end or the drain deadline passes.
	OpDrain = "drain"
	// OpPing asks for an empty reply, which the server sends from the
	// connection's own goroutine without touching the registry: a client
	// learns that the bridge's process still runs, which a control
	// connection whose kernel keeps it open (a stopped or hung process)
	// does not tell.
	OpPing = "ping"
)

// Request is every message a client sends; which fields are meaningful
// depends on Op (see docs/control.md, Operations).
type Request struct {
	ID uint64 `json:"id"`
	Op string `json:"op"`

	// hello
	Version int    `json:"version,omitempty"`
	App     string `json:"app,omitempty"`
	Nonce   []byte `json:"nonce,omitempty"`
	// auth
	MAC []byte `json:"mac,omitempty"`
	// register
	RxSlots int            `json:"rx_slots,omitempty"`
	TxSlots int            `json:"tx_slots,omitempty"`
	Geneve  netip.AddrPort `json:"geneve,omitzero"`
	// Instance names this process among the instances of its application
	// that share listeners (classifier.Spread). It must be the same at
	// every bridge the instance registers with, since every bridge builds
	// the shared tables from the sorted names. Empty: a sole instance.
	Instance string `json:"instance,omitempty"`
	// listen, connect
	Proto  string         `json:"proto,omitempty"`
	Addr   netip.Addr     `json:"addr,omitzero"`
	Port   uint16         `json:"port,omitempty"`
	Remote netip.AddrPort `json:"remote,omitzero"`
	// Reclaim asks again for what this application held under its lease
	// with a bridge that has since restarted: exactly Port (for connect,
	// from Addr to Remote), a port of the reserved range included.
	Reclaim bool `json:"reclaim,omitempty"`
	// release
	Claim uint64 `json:"claim,omitempty"`
}

// Reply answers one Request.
type Reply struct {
	ID    uint64     `json:"id"`
	Error *WireError `json:"error,omitempty"`

	// hello
	Version int    `json:"version,omitempty"`
	Nonce   []byte `json:"nonce,omitempty"`
	MAC     []byte `json:"mac,omitempty"`
	// register
	Stream uint32               `json:"stream,omitempty"`
	Addrs  []netip.Addr         `json:"addrs,omitempty"`
	MTU    int                  `json:"mtu,omitempty"`
	Ports  classifier.PortRange `json:"ports,omitzero"`
	Geneve netip.AddrPort       `json:"geneve,omitzero"`
	// listen, connect
	Claim uint64     `json:"claim,omitempty"`
	Addr  netip.Addr `json:"addr,omitzero"`
	Port  uint16     `json:"port,omitempty"`
}

// WireError is an error as it travels in a Reply.
type WireError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Errors a client reports, one per error code (see the package
// documentation). Test with errors.Is.
var (
	ErrBadRequest    = errors.New("control: malformed request")
	ErrVersion       = errors.New("control: protocol version not supported")
	ErrAuth          = errors.New("control: authentication failed")
	ErrNotRegistered = errors.New("control: not registered")
	ErrNotPermitted  = errors.New("control: not permitted")
	ErrPortInUse     = errors.New("control: port held")
	ErrNameTaken     = errors.New("control: name already registered")
	ErrQuota         = errors.New("control: quota exceeded")
	ErrNoPorts       = errors.New("control: no free port in the reserved range")
	ErrUnknownClaim  = errors.New("control: unknown claim")
	ErrBridgeGone    = errors.New("control: bridge gone")
	ErrInternal      = errors.New("control: internal error")
)

var codes = []struct {
	code string
	err  error
}{
	{"bad_request", ErrBadRequest},
	{"version", ErrVersion},
	{"auth", ErrAuth},
	{"not_registered", ErrNotRegistered},
	{"not_permitted", ErrNotPermitted},
	{"port_in_use", ErrPortInUse},
	{"name_taken", ErrNameTaken},
	{"quota", ErrQuota},
	{"no_ports", ErrNoPorts},
	{"unknown_claim", ErrUnknownClaim},
	{"bridge_gone", ErrBridgeGone},
	{"internal", ErrInternal},
}

// wireError turns an error into its wire form; errors that wrap none of the
// sentinels are internal.
func wireError(err error) *WireError {
	for _, c := range codes {
		if errors.Is(err, c.err) {
			return &WireError{Code: c.code, Message: err.Error()}
		}
	}
	return &WireError{Code: "internal", Message: err.Error()}
}

// Err turns a wire error back into an error that wraps its sentinel.
func (w *WireError) Err() error {
	for _, c := range codes {
		if c.code == w.Code {
			return fmt.Errorf("%w (bridge said: %s)", c.err, w.Message)
		}
	}
	return fmt.Errorf("%w: unknown error code %q (bridge said: %s)", ErrInternal, w.Code, w.Message)
}

// errFrameTooBig means a peer announced a frame beyond MaxFrame; the
// stream cannot be resynchronised without reading it, so the connection
// ends.
var errFrameTooBig = fmt.Errorf("%w: frame longer than %d bytes", ErrBadRequest, MaxFrame)

// appendFrame appends v as one frame to b.
func appendFrame(b []byte, v any) ([]byte, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return b, err
	}
	if len(body) > MaxFrame {
		return b, errFrameTooBig
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...), nil
}

// readFrame reads one frame body from r into buf (grown as needed).
func readFrame(r io.Reader, buf []byte) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > MaxFrame {
		return nil, errFrameTooBig
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return buf, nil
}

// decodeStrict decodes exactly one JSON object, refusing unknown fields and
// trailing data.
func decodeStrict(body []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(body))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return errors.New("trailing data after the JSON object")
	}
	return nil
}
