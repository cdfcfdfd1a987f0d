package topology

// XDPProgram is the id of the XDP program attached to interface name in n,
// 0 if none.
func (n *NS) XDPProgram(name string) (uint32, error) {
	l, err := n.Handle().LinkByName(name)
	if err != nil {
		return 0, err
	}
	if x := l.Attrs().Xdp; x != nil && x.Attached {
		return x.ProgId, nil
	}
	return 0, nil
}
