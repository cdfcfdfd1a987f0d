// Package appliance is the fabricbridge daemon: it reads the configuration,
// opens the bridge on the configured interfaces, serves the control plane to
// applications, exports metrics and logs, reloads rules on SIGHUP without
// disturbing established flows, shuts down cleanly on SIGTERM, and clears
// what a crashed predecessor left behind before it starts.
//
// Applications on the bridge host get shared-memory streams that the bridge
// serves directly. Applications on other nodes get GENEVE streams (the
// remote transport); the bridge serves shared-memory streams only, so the
// daemon relays each remote stream into a local stream pair, one goroutine
// per direction (see relay).
package appliance
