package bridge

// MTU is the served interface's MTU now: the bridge follows its changes
// through netlink and refuses what an application sends beyond it.
func (b *Bridge) MTU() int {
	if b.res != nil {
		return int(b.res.mtu.Load())
	}
	return b.mtu
}
