package appliance

import (
	"fmt"
	"io"
	"strings"
	"testing"
)

// A daemon started on a thread switched into a namespace other than its
// process's cannot take its BGP speaker along (GoBGP's goroutines open
// sockets on any thread): Start refuses with the reason, at the bgp
// section, and leaves nothing attached.
func TestBGPRefusedInAnotherNamespace(t *testing.T) {
	tp := newTopo(t)
	c := tp.config(t, fmt.Sprintf("bgp:\n  asn: 65001\n  router_id: %s\n  neighbors: [{address: %s, asn: 65000}]\n  announce: [%s]\n",
		tp.v.A.Addr4.Addr(), tp.v.B.Addr4.Addr(), tp.v.A.Addr4.Addr()))
	err := tp.bridge.Do(func() error {
		d, err := Start(c, Options{Log: io.Discard})
		if err == nil {
			d.Close()
		}
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "bgp: the daemon runs in another network namespace") {
		t.Fatalf("Start: %v", err)
	}
	if xdpAttached(t, tp) {
		t.Error("the data plane stayed attached after the refusal")
	}
}
