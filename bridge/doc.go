// Package bridge is fabricbridge's data plane in user space.
package bridge
