package bridge

import (
	"github.com/fabricbridge/fabricbridge/classifier"
)

// vlanStripFeatures are the kernel's names of the receive VLAN stripping
// features (see docs/bridge.md, VLANs).
var vlanStripFeatures = []string{"rx-vlan-hw-parse", "rx-vlan-stag-hw-parse"}

// tablesMatchVLAN reports whether any rule matches on a VLAN id.
func tablesMatchVLAN(t *classifier.Tables) bool {
	for _, r := range t.Rules() {
		if r.VLAN != 0 {
			return true
		}
	}
	return false
}

// keepVLANTags makes sure the interface hands XDP its frames with their VLAN
// tags, once the tables need them. Called with b.mu held.
func (b *Bridge) keepVLANTags(t *classifier.Tables) {
	if b.prog == nil || b.vlanChecked || !tablesMatchVLAN(t) {
		return
	}
	b.vlanChecked = true
	if b.feats == nil {
		return // a device without ethtool features strips nothing
	}
	var off []string
	for _, name := range vlanStripFeatures {
		s, err := b.feats.Get(name)
		if err != nil || !s.Active {
			continue
		}
		if !s.Changeable {
			b.vlanBlind.Store(true)
			b.log.Warn("bridge: the interface strips VLAN tags and cannot stop: rules on VLAN ids will not match", "interface", b.cfg.Interface, "feature", name)
			continue
		}
		off = append(off, name)
	}
	if len(off) == 0 {
		return
	}
	if err := b.feats.Set(off, false); err != nil {
		b.vlanBlind.Store(true)
		b.log.Warn("bridge: cannot turn the interface's VLAN stripping off: rules on VLAN ids will not match", "interface", b.cfg.Interface, "features", off, "err", err)
		return
	}
	b.vlanRestore = off
	b.log.Info("bridge: turned VLAN stripping off so that XDP sees VLAN tags (restored at close)", "interface", b.cfg.Interface, "features", off)
}

// restoreVLANStripping turns back on what keepVLANTags turned off.
func (b *Bridge) restoreVLANStripping() error {
	if len(b.vlanRestore) == 0 {
		return nil
	}
	err := b.feats.Set(b.vlanRestore, true)
	b.vlanRestore = nil
	return err
}
