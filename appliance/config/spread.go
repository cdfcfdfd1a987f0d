package config

import (
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

// Spread shapes the listeners that several instances of one application
// share (docs/scale-out.md): the seed of their Maglev tables, flow hash and
// port blocks, how long a draining instance keeps its connections, and how
// long after a start the instances that come back make one set.
// Every box of a cluster must have the same seed, or a connection that
// ECMP moves to another box lands on another instance.
type Spread struct {
	Seed          uint64   `yaml:"seed"`
	DrainDeadline Duration `yaml:"drain_deadline"`
	Settle        Duration `yaml:"settle"`
}

// Bounds of spread.drain_deadline and spread.settle.
const (
	MinDrainDeadline = time.Second
	MaxDrainDeadline = 24 * time.Hour
	MaxSettle        = time.Minute
)

func defaultSpread() Spread {
	return Spread{Seed: control.DefaultSpreadSeed, DrainDeadline: Duration(control.DefaultDrainDeadline), Settle: Duration(control.DefaultSettle)}
}

func (c *Config) checkSpread(d *decoder) {
	if c.Spread.Seed == 0 {
		d.errorAt("spread.seed", "0 is no seed: leave it out for the default, or pick another number (the same on every box)")
	}
	if dd := time.Duration(c.Spread.DrainDeadline); dd < MinDrainDeadline || dd > MaxDrainDeadline {
		d.errorAt("spread.drain_deadline", "must be from %s to %s, not %s", MinDrainDeadline, MaxDrainDeadline, dd)
	}
	if st := time.Duration(c.Spread.Settle); st < 0 || st > MaxSettle {
		d.errorAt("spread.settle", "must be from 0 to %s, not %s", MaxSettle, st)
	}
}

// Control is the section as the control server takes it.
func (s Spread) Control() control.SpreadConfig {
	settle := time.Duration(s.Settle)
	if settle == 0 {
		settle = -1 // none: the control plane's zero is its default
	}
	return control.SpreadConfig{Seed: s.Seed, DrainDeadline: time.Duration(s.DrainDeadline), Settle: settle}
}
