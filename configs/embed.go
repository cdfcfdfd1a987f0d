// Package configs holds fabricbridge's example configuration files. They are
// embedded so that the demo runs from its own file and so that a test checks
// every example the way `fabricbridge check` does.
package configs

import "embed"

// Files are the *.yaml examples of this directory.
//
//go:embed *.yaml
var Files embed.FS

// Demo is the file the demo runs with; it substitutes the interface and
// address of the topology it builds.
const Demo = "demo.yaml"
