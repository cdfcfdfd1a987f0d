package topology

// XDPProgram is the id of the XDP program attached to interface name in n,
// 0 if none. A failed lookup fails tb.
func (n *NS) XDPProgram(tb TB, name string) uint32 {
	tb.Helper()
	l, err := n.Handle().LinkByName(name)
	if err != nil {
		tb.Fatalf("interface %s: %v", name, err)
		return 0
	}
	if x := l.Attrs().Xdp; x != nil && x.Attached {
		return x.ProgId
	}
	return 0
}

// DeleteLink deletes interface name in n (and, for a veth, its peer);
// a failure fails tb.
func (n *NS) DeleteLink(tb TB, name string) {
	tb.Helper()
	h := n.Handle()
	l, err := h.LinkByName(name)
	if err == nil {
		err = h.LinkDel(l)
	}
	if err != nil {
		tb.Fatalf("delete interface %s: %v", name, err)
	}
}
