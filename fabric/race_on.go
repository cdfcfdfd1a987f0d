//go:build race

package fabric

// raceEnabled: under the race detector, sync/atomic loads and stores are
// only acquire/release (golang/go#58020), which breaks the store-then-load
// tripwire handshake; the code then uses read-modify-write operations,
// which stay full barriers.
const raceEnabled = true
