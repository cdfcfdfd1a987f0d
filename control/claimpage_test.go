package control

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
)

// TestClaimsPages pages through the claims of three applications with
// several page sizes: every claim once, in (stream, id) order, with more
// set on every page but the last; the app filter keeps one application's.
func TestClaimsPages(t *testing.T) {
	// Unlisted applications share one quota: let it hold all three's.
	f := newFixture(t, func(c *Config) { c.Default.MaxPorts = 100 })
	var all []string
	byApp := map[string][]string{}
	for _, app := range []string{"a", "b", "c"} {
		c, reg, _ := f.register(app)
		l, err := c.Listen(ctx(t), "udp", boxA, 0)
		if err != nil {
			t.Fatal(err)
		}
		byApp[app] = append(byApp[app], fmt.Sprintf("%s %d.%d L %v", app, reg.Stream, l.ID, netip.AddrPortFrom(boxA, l.Port)))
		for i := range 25 {
			fl, err := c.Connect(ctx(t), "tcp", boxA, netip.AddrPortFrom(peer4.Addr(), uint16(6000+i)))
			if err != nil {
				t.Fatal(err)
			}
			byApp[app] = append(byApp[app], fmt.Sprintf("%s %d.%d F %v", app, reg.Stream, fl.ID, netip.AddrPortFrom(fl.Addr, fl.Port)))
		}
		all = append(all, byApp[app]...)
	}
	show := func(c ClaimInfo) string {
		if c.Listener {
			return fmt.Sprintf("%s %d.%d L %v", c.App, c.Stream, c.ID, c.Local)
		}
		return fmt.Sprintf("%s %d.%d F %v", c.App, c.Stream, c.ID, c.Local)
	}
	for _, app := range []string{"", "b"} {
		want := all
		if app != "" {
			want = byApp[app]
		}
		for _, limit := range []int{1, 7, 26, 1000} {
			var got []string
			var at ClaimCursor
			for pages := 0; ; pages++ {
				page, more := f.srv.Claims(app, at, limit)
				if len(page) > limit || more && len(page) != limit {
					t.Fatalf("app %q limit %d: page of %d, more %v", app, limit, len(page), more)
				}
				for _, c := range page {
					got = append(got, show(c))
				}
				if !more {
					break
				}
				at = ClaimCursor{page[len(page)-1].Stream, page[len(page)-1].ID}
			}
			if !slices.Equal(got, want) {
				t.Errorf("app %q limit %d:\n got %q\nwant %q", app, limit, got, want)
			}
		}
	}
	if page, more := f.srv.Claims("nobody", ClaimCursor{}, 10); len(page) != 0 || more {
		t.Errorf("an unknown application's claims: %v, more %v", page, more)
	}
}
