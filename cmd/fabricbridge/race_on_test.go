//go:build race

package main

// raceEnabled: tests that time a daemon restart against TCP run in the
// plain pass only; the race detector stretches the gap past what a
// peer's retransmissions cover.
const raceEnabled = true
