// Package appliance is the fabricbridge daemon: it reads the configuration,
// opens the bridge on the configured interfaces, serves the control plane to
// applications, exports metrics and logs, reloads rules on SIGHUP without
// disturbing established flows, shuts down cleanly on SIGTERM, and clears
// what a crashed predecessor left behind before it starts.
//
// Applications on the bridge host get shared-memory streams, applications
// on other nodes GENEVE streams (the remote transport); the bridge serves
// both directly.
package appliance
