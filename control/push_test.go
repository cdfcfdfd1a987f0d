package control

import (
	"testing"
	"time"
)

// TestSetMTUReachesApplications: a registered application hears of the
// wire's new MTU, even when it asks to after the change; one that
// registers later reads it in its registration; nonsense is refused.
func TestSetMTUReachesApplications(t *testing.T) {
	f := newFixture(t, nil)
	c, reg, _ := f.register("web")
	if reg.MTU != 1500 {
		t.Fatalf("registration MTU %d", reg.MTU)
	}
	heard := make(chan int, 4)
	c.OnMTU(func(mtu int) { heard <- mtu })
	if err := f.srv.SetMTU(1400); err != nil {
		t.Fatal(err)
	}
	select {
	case mtu := <-heard:
		if mtu != 1400 {
			t.Fatalf("heard MTU %d, want 1400", mtu)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the application never heard of the new MTU")
	}
	// A hook set after the push still hears of it.
	late := make(chan int, 1)
	c.OnMTU(func(mtu int) { late <- mtu })
	if mtu := <-late; mtu != 1400 {
		t.Fatalf("late hook heard %d", mtu)
	}
	// Requests still work: the push took no request's place.
	if _, err := c.Listen(ctx(t), "tcp", boxA, 80); err != nil {
		t.Fatal(err)
	}
	if _, reg2, _ := f.register("other"); reg2.MTU != 1400 {
		t.Errorf("a later registration's MTU %d, want 1400", reg2.MTU)
	}
	if err := f.srv.SetMTU(100); err == nil {
		t.Error("an MTU of 100 was taken")
	}
}
