//go:build !race

package fabric

// raceEnabled is false in normal builds, where sync/atomic is sequentially
// consistent and the tripwire may use a plain load on the hot path.
const raceEnabled = false
