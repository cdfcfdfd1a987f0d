package config

import (
	"fmt"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// RuleSet builds the classifier's rule set from the static listeners and
// rules. streams maps the names of connected applications to their stream
// ids; a listener or steer rule whose application is not connected is left
// out, so its packets reach the kernel as unclaimed packets do, until the
// application connects and the daemon rebuilds the set.
func (c *Config) RuleSet(streams map[string]uint32) *classifier.RuleSet {
	return c.staticRuleSet(streams, false)
}

// staticRuleSet is RuleSet; with allApps every application gets a stand-in
// stream so that validation sees every rule.
func (c *Config) staticRuleSet(streams map[string]uint32, allApps bool) *classifier.RuleSet {
	stream := func(app string) (uint32, bool) {
		if allApps {
			return 1, true
		}
		s, ok := streams[app]
		return s, ok
	}
	rs := &classifier.RuleSet{}
	for _, l := range c.Listeners {
		s, ok := stream(l.App)
		if !ok {
			continue
		}
		rs.Listeners = append(rs.Listeners, classifier.Listener{
			ID: l.ID, Protocol: classifier.Protocol(l.Protocol), Addr: l.Address.Addr, Port: uint16(l.Port), Stream: s,
		})
	}
	for _, r := range c.Rules {
		cr := classifier.Rule{
			ID: r.ID, Priority: r.Priority, VLAN: r.Match.VLAN, IPVersion: uint8(r.Match.IP),
			Protocol: classifier.Protocol(r.Match.Protocol), Src: r.Match.Src.Prefix, Dst: r.Match.Dst.Prefix,
			SrcPorts: r.Match.SrcPort.Classifier(), DstPorts: r.Match.DstPort.Classifier(),
			Action: classifier.Action(r.Action),
		}
		switch cr.Action {
		case classifier.ActionSteer:
			s, ok := stream(r.App)
			if !ok {
				continue
			}
			cr.Stream = s
		case classifier.ActionIngest:
			cr.Stream = c.IngestID(r.Ingest)
		}
		rs.Rules = append(rs.Rules, cr)
	}
	return rs
}

// RuleNames maps the id of every static listener and rule to the name that
// metrics and stats show: its name, or "listener N" / "rule N".
func (c *Config) RuleNames() map[uint32]string {
	names := map[uint32]string{}
	for _, l := range c.Listeners {
		names[l.ID] = l.Name
		if l.Name == "" {
			names[l.ID] = fmt.Sprintf("listener %d", l.ID)
		}
	}
	for _, r := range c.Rules {
		names[r.ID] = r.Name
		if r.Name == "" {
			names[r.ID] = fmt.Sprintf("rule %d", r.ID)
		}
	}
	return names
}
