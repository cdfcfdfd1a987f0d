package userstack

import (
	"context"
	"errors"
	"fmt"
)

// Drain asks every bridge of the stack to send it no new connections on
// the listeners it shares with the other instances of its application
// (control.Client.Drain), while its established connections keep reaching
// it until they end or the bridge's drain deadline passes. Only an
// instance (Options.Instance, or several Options.Bridges) can drain, and
// it listens no more.
//
// The stack drains for good: a bridge that is away now, or that comes
// back after a restart, is asked once it holds the stack's claims again,
// so that it too sends the stack nothing new.
//
// Drain fails only when no bridge drained the stack: none was attached
// (ErrBridgeUnavailable; each is asked when it is back) or every one
// refused. A bridge that refuses while another drained the stack is a
// DrainFailed event, counted in BridgeState.DrainFailures.
func (s *Stack) Drain(ctx context.Context) error {
	if err := s.checkOpen(); err != nil {
		return err
	}
	var atts []*attachment
	var names []string
	switch {
	case s.bridges != nil:
		atts, names = s.bridges.atts, s.bridges.names
	case s.single.a != nil:
		atts, names = []*attachment{s.single.a}, []string{s.single.name}
	default:
		return errors.New("userstack: the stack has no bridge to drain from")
	}
	refusals := make([]error, len(atts))
	drained := false
	for i, a := range atts {
		sent, err := a.drain(ctx)
		refusals[i] = err
		drained = drained || sent && err == nil
	}
	if drained {
		for i, err := range refusals {
			if err != nil {
				atts[i].emit(Event{Kind: DrainFailed, Err: err})
			}
		}
		return nil
	}
	var errs []error
	for i, err := range refusals {
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", names[i], err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("userstack: drain: %w", errors.Join(errs...))
	}
	return fmt.Errorf("%w: none of %d attached; each drains the stack when it is back", ErrBridgeUnavailable, len(atts))
}
