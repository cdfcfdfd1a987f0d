//go:build race

package control

// raceEnabled: the race detector slows the registry and the data planes
// several times over; tests that time them run in the plain pass only.
const raceEnabled = true
