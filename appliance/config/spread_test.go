package config

import (
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
)

func TestSpreadSection(t *testing.T) {
	c, err := Parse("t.yaml", []byte(base))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Spread.Control(); got != (control.SpreadConfig{Seed: control.DefaultSpreadSeed, DrainDeadline: control.DefaultDrainDeadline, Settle: control.DefaultSettle}) {
		t.Errorf("defaults %+v", got)
	}
	c, err = Parse("t.yaml", []byte(base+"spread: {seed: 42, drain_deadline: 2m, settle: 0s}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Spread.Control(); got != (control.SpreadConfig{Seed: 42, DrainDeadline: 2 * time.Minute, Settle: -1}) {
		t.Errorf("spread %+v", got)
	}
	_, err = Parse("t.yaml", []byte(base+"spread:\n  seed: 0\n  drain_deadline: 10ms\n  settle: 2m\n"))
	want := []string{
		"t.yaml:4:3: spread.seed: 0 is no seed: leave it out for the default, or pick another number (the same on every box)",
		"t.yaml:5:3: spread.drain_deadline: must be from 1s to 24h0m0s, not 10ms",
		"t.yaml:6:3: spread.settle: must be from 0 to 1m0s, not 2m0s",
	}
	if err == nil || err.Error() != strings.Join(want, "\n") {
		t.Errorf("errors:\n%v\nwant:\n%s", err, strings.Join(want, "\n"))
	}
}
