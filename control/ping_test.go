package control

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"
)

// TestPing: a bridge answers a ping at once, before and after register;
// a peer that reads nothing (a stopped process whose kernel keeps the
// connection open) lets it run into its context; a bridge that does not
// know the op (its bad_request reply) still counts as answering.
func TestPing(t *testing.T) {
	f := newFixture(t, nil)
	c, err := DialLocal(ctx(t), f.path, "web")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Ping(ctx(t)); err != nil {
		t.Fatalf("ping before register: %v", err)
	}
	if _, st, err := c.RegisterLocal(ctx(t), 0, 0); err != nil {
		t.Fatal(err)
	} else {
		defer st.Close()
	}
	if err := c.Ping(ctx(t)); err != nil {
		t.Fatalf("ping after register: %v", err)
	}

	for _, tc := range []struct {
		name   string
		answer string // the frame a fake bridge answers with; "": none
		want   error
	}{
		{"hung", "", context.DeadlineExceeded},
		{"older bridge", `{"id":1,"error":{"code":"bad_request","message":"unknown operation \"ping\""}}`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mine, bridge := net.Pipe()
			defer bridge.Close()
			go func() {
				if _, err := readFrame(bridge, nil); err != nil || tc.answer == "" {
					return
				}
				b := append([]byte{0, 0, 0, byte(len(tc.answer))}, tc.answer...)
				bridge.Write(b)
			}()
			c := newClient(mine, "web")
			defer c.Close()
			pctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			if err := c.Ping(pctx); !errors.Is(err, tc.want) {
				t.Fatalf("ping: %v, want %v", err, tc.want)
			}
		})
	}
}
