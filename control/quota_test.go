package control

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/fabricbridge/fabricbridge/fabric"
)

// tryRegister dials and registers app, returning the client (closed at
// the test's end) and the registration's error.
func (f *fixture) tryRegister(app string) (*Client, error) {
	f.t.Helper()
	c, err := DialLocal(ctx(f.t), f.path, app)
	if err != nil {
		return nil, err
	}
	f.t.Cleanup(func() { c.Close() })
	_, st, err := c.RegisterLocal(ctx(f.t), 0, 0)
	if err == nil {
		f.t.Cleanup(func() { st.Close() })
	}
	return c, err
}

// TestPortQuotaIsPerApplication: two control connections of one
// application hold its port quota together, not once each.
func TestPortQuotaIsPerApplication(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.Apps["web"] = Policy{MaxPorts: 2} })
	c1, _, _ := f.register("web")
	c2, _, _ := f.register("web")
	if _, err := c1.Listen(ctx(t), "tcp", netip.Addr{}, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c2.Connect(ctx(t), "tcp", boxA, peer4); err != nil {
		t.Fatal(err)
	}
	if _, err := c1.Listen(ctx(t), "udp", netip.Addr{}, 0); !errors.Is(err, ErrQuota) {
		t.Errorf("third port of a two-port application, first connection: %v", err)
	}
	if _, err := c1.Connect(ctx(t), "tcp", boxA, peer4); !errors.Is(err, ErrQuota) {
		t.Errorf("third port of a two-port application, first connection's flow: %v", err)
	}
	// At its quota, the second connection's flows share its port towards
	// other remotes, and take no new one.
	other := netip.AddrPortFrom(peer4.Addr(), peer4.Port()+1)
	if _, err := c2.Connect(ctx(t), "tcp", boxA, other); err != nil {
		t.Errorf("flow sharing the application's own port: %v", err)
	}
	if got := f.srv.Refusals()[ReasonQuotaPorts]; got != 2 {
		t.Errorf("refusals for quota_ports: %d, want 2", got)
	}
	// Another application is not bound by web's use.
	o, _, _ := f.register("other")
	if _, err := o.Listen(ctx(t), "tcp", netip.Addr{}, 0); err != nil {
		t.Errorf("another application: %v", err)
	}
}

// TestStreamQuota: the registration beyond an application's streams
// quota is refused, before its rings are made, and one that ends frees a
// place.
func TestStreamQuota(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.Apps["web"] = Policy{MaxStreams: 3} })
	var first *Client
	for i := range 3 {
		c, err := f.tryRegister("web")
		if err != nil {
			t.Fatalf("registration %d: %v", i+1, err)
		}
		if first == nil {
			first = c
		}
	}
	if _, err := f.tryRegister("web"); !errors.Is(err, ErrQuota) {
		t.Fatalf("fourth registration: %v", err)
	}
	if got := f.srv.Refusals()[ReasonQuotaStreams]; got != 1 {
		t.Errorf("refusals for quota_streams: %d, want 1", got)
	}
	first.Close()
	deadline := ctx(t)
	for {
		_, err := f.tryRegister("web")
		if err == nil {
			break
		}
		if !errors.Is(err, ErrQuota) || deadline.Err() != nil {
			t.Fatalf("registration after one ended: %v", err)
		}
	}
}

// TestRingBytesQuota: rings beyond an application's memory quota are
// refused.
func TestRingBytesQuota(t *testing.T) {
	one := 2 * fabric.RingBytes(64, 2048) // the fixture's stream
	f := newFixture(t, func(c *Config) { c.Apps["web"] = Policy{MaxRingBytes: one + one/2} })
	if _, err := f.tryRegister("web"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.tryRegister("web"); !errors.Is(err, ErrQuota) {
		t.Fatalf("second stream past ring_bytes: %v", err)
	}
	if got := f.srv.Refusals()[ReasonQuotaRingBytes]; got != 1 {
		t.Errorf("refusals for quota_ring_bytes: %d, want 1", got)
	}
}

// TestUnlistedShareTheDefault: applications the configuration does not
// name share one quota, so new names do not multiply it; listed ones do
// not count against it. With RefuseUnlisted they are refused, counted.
func TestUnlistedShareTheDefault(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.Default = Policy{MaxStreams: 2} })
	for _, name := range []string{"u1", "u2"} {
		if _, err := f.tryRegister(name); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if _, err := f.tryRegister("u3"); !errors.Is(err, ErrQuota) {
		t.Fatalf("third unlisted application past the shared quota: %v", err)
	}
	if _, err := f.tryRegister("other"); err != nil {
		t.Fatalf("listed application: %v", err)
	}

	g := newFixture(t, func(c *Config) { c.RefuseUnlisted = true })
	if _, err := g.tryRegister("u1"); !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("unlisted application with RefuseUnlisted: %v", err)
	}
	if got := g.srv.Refusals()[ReasonUnlisted]; got != 1 {
		t.Errorf("refusals for unlisted: %d, want 1", got)
	}
}
