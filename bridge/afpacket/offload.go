package afpacket

import (
	"fmt"

	"github.com/fabricbridge/fabricbridge/bridge/features"
)

// MergingOffloads are the receive offloads (the kernel's feature names;
// ethtool calls rx-lro large-receive-offload) that merge frames before packet
// taps see them: a tap on an interface with any of them on receives
// super-packets of up to 64 KiB that no stream slot holds, and that are not
// the frames on the wire.
var MergingOffloads = []string{"rx-gro", "rx-gro-hw", "rx-lro", "rx-gro-list", "rx-udp-gro-forwarding"}

// Offloads turns an interface's merging offloads off and can turn them back
// on.
type Offloads struct {
	f      *features.Interface // nil after Restore
	turned []string            // features turned off, to turn on again
}

// DisableMerging turns every feature of MergingOffloads that is on and
// changeable off on ifname, and reports which it turned off (Changed). A
// feature that is on but fixed is an error: the interface would hand the
// tap merged frames. Call it on a thread in the interface's network
// namespace; Restore may then be called from anywhere.
func DisableMerging(ifname string) (*Offloads, error) {
	f, err := features.Open(ifname)
	if err != nil {
		return nil, fmt.Errorf("afpacket: %w", err)
	}
	var off []string
	for _, name := range MergingOffloads {
		s, err := f.Get(name)
		if err != nil || !s.Active {
			continue // a feature the device does not have is off
		}
		if !s.Changeable {
			f.Close()
			return nil, fmt.Errorf("afpacket: %s has %s on and it cannot be turned off", ifname, name)
		}
		off = append(off, name)
	}
	if err := f.Set(off, false); err != nil {
		f.Close()
		return nil, fmt.Errorf("afpacket: %w", err)
	}
	return &Offloads{f: f, turned: off}, nil
}

// Changed lists the features DisableMerging turned off.
func (o *Offloads) Changed() []string { return append([]string(nil), o.turned...) }

// Active reports whether feature name is on now.
func (o *Offloads) Active(name string) (bool, error) {
	s, err := o.f.Get(name)
	return s.Active, err
}

// Restore turns back on what DisableMerging turned off, and releases the
// socket.
func (o *Offloads) Restore() error {
	if o.f == nil {
		return nil
	}
	err := o.f.Set(o.turned, true)
	o.f.Close()
	o.f = nil
	return err
}

// SetFeature turns one named feature on or off (tests use it to make an
// interface merge).
func (o *Offloads) SetFeature(name string, on bool) error { return o.f.Set([]string{name}, on) }
