package config

import (
	"fmt"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// AppEntries are the static listeners and steer rules bound to one
// application. Their Stream fields are 0: the control plane fills in the
// application's stream while it is registered.
type AppEntries struct {
	Listeners []classifier.Listener
	Rules     []classifier.Rule
}

// Classification splits the static classification into the rules bound to
// no application (pass, drop, ingest) and the entries of each application
// (listeners, steer rules).
func (c *Config) Classification() (rules []classifier.Rule, apps map[string]AppEntries) {
	apps = map[string]AppEntries{}
	for _, l := range c.Listeners {
		e := apps[l.App]
		e.Listeners = append(e.Listeners, c.listener(l, 0))
		apps[l.App] = e
	}
	for _, r := range c.Rules {
		cr := c.rule(r, 0)
		if cr.Action == classifier.ActionSteer {
			e := apps[r.App]
			e.Rules = append(e.Rules, cr)
			apps[r.App] = e
			continue
		}
		rules = append(rules, cr)
	}
	return rules, apps
}

func (c *Config) listener(l Listener, stream uint32) classifier.Listener {
	return classifier.Listener{ID: l.ID, Protocol: classifier.Protocol(l.Protocol), Addr: l.Address.Addr, Port: uint16(l.Port), Stream: stream}
}

func (c *Config) rule(r Rule, stream uint32) classifier.Rule {
	cr := classifier.Rule{
		ID: r.ID, Priority: r.Priority, VLAN: r.Match.VLAN, IPVersion: uint8(r.Match.IP),
		Protocol: classifier.Protocol(r.Match.Protocol), Src: r.Match.Src.Prefix, Dst: r.Match.Dst.Prefix,
		SrcPorts: r.Match.SrcPort.Classifier(), DstPorts: r.Match.DstPort.Classifier(),
		Action: classifier.Action(r.Action),
	}
	switch cr.Action {
	case classifier.ActionSteer:
		cr.Stream = stream
	case classifier.ActionIngest:
		cr.Stream = c.IngestID(r.Ingest)
	}
	return cr
}

// ruleSet is the whole static classification with every application
// given a stand-in stream, for validation by the classifier.
func (c *Config) ruleSet() *classifier.RuleSet {
	rs := &classifier.RuleSet{}
	for _, l := range c.Listeners {
		rs.Listeners = append(rs.Listeners, c.listener(l, 1))
	}
	for _, r := range c.Rules {
		rs.Rules = append(rs.Rules, c.rule(r, 1))
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
