package control

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// TestReclaimGrantsExactlyWhatWasHeld: after a restart an application
// asks for its listener on a port of the reserved range and its flow's
// source port by number, which listen and connect refuse or ignore; a port
// another application took is refused, naming it.
func TestReclaimGrantsExactlyWhatWasHeld(t *testing.T) {
	f := newFixture(t, nil)
	c, reg, _ := f.register("web")
	if _, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 40010); !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("listen on a reserved port by number: %v", err)
	}
	l, err := c.Reclaim(ctx(t), "tcp", netip.Addr{}, 40010, netip.AddrPort{})
	if err != nil || l.Port != 40010 {
		t.Fatalf("reclaim of a listener on reserved port 40010: %+v, %v", l, err)
	}
	flow, err := c.Reclaim(ctx(t), "tcp", boxA, 40020, peer4)
	if err != nil || flow.Port != 40020 || flow.Addr != boxA {
		t.Fatalf("reclaim of a flow from port 40020: %+v, %v", flow, err)
	}
	s := reg.Stream
	for _, want := range []string{
		fmt.Sprintf("L 4 6 0.0.0.0:40010 -> %d", s),
		fmt.Sprintf("F 6 %v -> %v:40020 -> %d", peer4, boxA, s),
	} {
		if got := f.dp.entries(); !slices.Contains(got, want) {
			t.Fatalf("tables %q lack %q", got, want)
		}
	}

	other, _, _ := f.register("other")
	for _, tc := range []struct {
		name   string
		addr   netip.Addr
		port   uint16
		remote netip.AddrPort
		want   error
		says   string
	}{
		{"a listener's port held", netip.Addr{}, 40010, netip.AddrPort{}, ErrPortInUse, `application "web"`},
		{"a flow's port held", boxB, 40020, peer4, ErrPortInUse, `application "web"`},
		{"a flow outside the range", boxB, 80, peer4, ErrNotPermitted, "outside the reserved range"},
		{"a flow from another's address", boxA, 40030, peer4, ErrNotPermitted, "may use"},
	} {
		_, err := other.Reclaim(ctx(t), "tcp", tc.addr, tc.port, tc.remote)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, err, tc.want, tc.says)
		}
	}
	if err := c.Release(ctx(t), flow.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Reclaim(ctx(t), "tcp", boxB, 40020, peer4); err != nil {
		t.Fatalf("a released port reclaimed by another: %v", err)
	}
}
