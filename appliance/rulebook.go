package appliance

import (
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/classifier"
)

// ruleBook owns the classifier's complete rule set. It merges the static
// listeners and rules of the configuration with what the control plane
// installed for connected applications (their listeners and exact flows),
// and installs the merge whole, so that replacing either part — a reload,
// an application coming or going — is one atomic table swap in which
// nothing else changes: a reload never touches an application's flows.
type ruleBook struct {
	mu      sync.Mutex
	cfg     *config.Config
	streams map[string]uint32 // connected application name -> stream id
	dynamic classifier.RuleSet
	install func(*classifier.Tables) error
	current *classifier.Tables
}

func newRuleBook(cfg *config.Config, install func(*classifier.Tables) error) *ruleBook {
	return &ruleBook{cfg: cfg, streams: map[string]uint32{}, install: install}
}

// merged is the complete rule set; the caller holds mu.
func (b *ruleBook) merged(cfg *config.Config, streams map[string]uint32, dyn *classifier.RuleSet) *classifier.RuleSet {
	rs := cfg.RuleSet(streams)
	rs.Listeners = append(rs.Listeners, dyn.Listeners...)
	rs.Flows = append(rs.Flows, dyn.Flows...)
	rs.Rules = append(rs.Rules, dyn.Rules...)
	return rs
}

// apply compiles and installs a candidate state and adopts it only if both
// succeed, so a failure leaves the running tables and the book unchanged.
func (b *ruleBook) apply(cfg *config.Config, streams map[string]uint32, dyn classifier.RuleSet) error {
	t, err := classifier.Compile(b.merged(cfg, streams, &dyn))
	if err != nil {
		return err
	}
	if err := b.install(t); err != nil {
		return err
	}
	b.cfg, b.streams, b.dynamic, b.current = cfg, streams, dyn, t
	return nil
}

// load installs the book's initial state.
func (b *ruleBook) load() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.apply(b.cfg, b.streams, b.dynamic)
}

// setConfig replaces the static part (a reload).
func (b *ruleBook) setConfig(cfg *config.Config) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.apply(cfg, b.streams, b.dynamic)
}

// setDynamic replaces the control plane's part.
func (b *ruleBook) setDynamic(dyn classifier.RuleSet) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.apply(b.cfg, b.streams, dyn)
}

// connect records that the named application is on stream, so the static
// listeners and steer rules that name it start steering to it.
func (b *ruleBook) connect(app string, stream uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if s, ok := b.streams[app]; ok && s != stream {
		return fmt.Errorf("application %q is already connected on stream %d", app, s)
	}
	streams := maps.Clone(b.streams)
	streams[app] = stream
	return b.apply(b.cfg, streams, b.dynamic)
}

// disconnect removes the application's static entries again.
func (b *ruleBook) disconnect(app string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.streams[app]; !ok {
		return nil
	}
	streams := maps.Clone(b.streams)
	delete(streams, app)
	return b.apply(b.cfg, streams, b.dynamic)
}

// snapshot returns the installed rule set's parts, for metrics and tests.
func (b *ruleBook) snapshot() (cfg *config.Config, streams map[string]uint32, dyn classifier.RuleSet) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg, maps.Clone(b.streams), classifier.RuleSet{
		Flows: slices.Clone(b.dynamic.Flows), Listeners: slices.Clone(b.dynamic.Listeners), Rules: slices.Clone(b.dynamic.Rules),
	}
}
