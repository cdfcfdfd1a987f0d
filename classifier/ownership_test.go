package classifier

import "testing"

// TestPortSet: ranges go in whole, both ends included, up to port 65535,
// and print in the kernel's list syntax.
func TestPortSet(t *testing.T) {
	var s PortSet
	if s.String() != "" {
		t.Fatalf("empty set prints %q", s.String())
	}
	s.Add(0, 0)
	s.Add(1000, 1999)
	s.Add(8080, 8080)
	s.Add(65534, 65535)
	for p, want := range map[uint16]bool{0: true, 1: false, 999: false, 1000: true, 1999: true, 2000: false, 8080: true, 65533: false, 65535: true} {
		if s.Has(p) != want {
			t.Errorf("Has(%d) = %v", p, !want)
		}
	}
	if got := s.String(); got != "0,1000-1999,8080,65534-65535" {
		t.Errorf("String() = %q", got)
	}
}
