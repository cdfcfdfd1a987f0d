package control

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// FuzzDecodeRequest feeds arbitrary bytes to the server's request path as
// a peer's stream of frames: framing, strict decoding, and what the server
// does with a decoded request before and after the handshake. Nothing may
// panic; a frame is never longer than MaxFrame; a decoded request
// re-encodes to a fixed point; every refusal travels as an error code
// that comes back as its own sentinel, and fits in a frame.
func FuzzDecodeRequest(f *testing.F) {
	frame := func(body string) []byte {
		return binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	}
	for _, body := range []string{
		`{"id":1,"op":"hello","version":1,"app":"web"}`,
		`{"id":1,"op":"hello","version":1,"app":"far","nonce":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}`,
		`{"id":2,"op":"auth","mac":"AAAA"}`,
		`{"id":3,"op":"register","rx_slots":1024,"tx_slots":1024,"geneve":"198.18.0.9:6081"}`,
		`{"id":4,"op":"listen","proto":"tcp","addr":"198.18.0.1","port":80}`,
		`{"id":5,"op":"connect","proto":"udp","remote":"[2001:db8::9]:53"}`,
		`{"id":6,"op":"release","claim":7}`,
		`{"id":7,"op":"listen","unknown":1}`,
		`{"id":8}{"id":9}`,
	} {
		f.Add(append(frame(body), body...))
	}
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	srv, err := NewServer(Config{
		Dataplane: newRecorder(),
		Addrs:     []netip.Addr{boxA, box6},
		Ephemeral: classifier.PortRange{Lo: 40000, Hi: 40099},
		Secret:    []byte("0123456789abcdef-fuzz"),
		Apps:      map[string]Policy{"web": {}},
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		var buf []byte
		for {
			body, err := readFrame(r, buf)
			if err != nil {
				return
			}
			if len(body) > MaxFrame {
				t.Fatalf("a frame of %d bytes passed readFrame", len(body))
			}
			buf = body[:0]
			var req Request
			if err := decodeStrict(body, &req); err != nil {
				bestEffortID(body)
				continue
			}
			again, err := json.Marshal(req)
			if err != nil {
				t.Fatalf("a decoded request does not encode: %v", err)
			}
			var req2 Request
			if err := decodeStrict(again, &req2); err != nil {
				t.Fatalf("a request's own encoding %s does not decode: %v", again, err)
			}
			if third, _ := json.Marshal(req2); !bytes.Equal(third, again) {
				t.Fatalf("encoding is no fixed point:\n%s\n%s", again, third)
			}
			// A peer before its handshake, and a remote one after it
			// (the server has no remote transport, so nothing reaches
			// the data plane).
			for _, ss := range []*session{
				{srv: srv, remote: true, handoverFD: -1},
				{srv: srv, remote: true, handoverFD: -1, name: "web", authed: true, helloDone: true},
			} {
				rep, rights, err := ss.handle(&req)
				if rights != nil {
					t.Fatalf("rights handed to a remote session for %s", body)
				}
				if err == nil {
					if _, ferr := appendFrame(nil, rep); ferr != nil {
						t.Fatalf("reply to %s does not fit a frame: %v", body, ferr)
					}
					continue
				}
				w := wireError(err)
				if _, ferr := appendFrame(nil, Reply{Error: w}); ferr != nil {
					t.Fatalf("refusal of %s does not fit a frame: %v", body, ferr)
				}
				if back := w.Err(); !errors.Is(back, sentinel(w.Code)) {
					t.Fatalf("error code %q comes back as %v", w.Code, back)
				}
				srv.refused.add(err)
				if refusalReason(err) == "" {
					t.Fatalf("refusal of %s has no reason", body)
				}
			}
		}
	})
}

// sentinel is the error of a wire code.
func sentinel(code string) error {
	for _, c := range codes {
		if c.code == code {
			return c.err
		}
	}
	return ErrInternal
}
