package main

import (
	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance"
)

// DefaultConfig is where `run`, `check` and `stats` look without --config.
const DefaultConfig = "/etc/fabricbridge/fabricbridge.yaml"

// newRunCommand is the daemon: it runs until SIGTERM or SIGINT (its
// context) and reloads its rules on SIGHUP.
func newRunCommand() *cobra.Command {
	var path string
	c := &cobra.Command{
		Use:   "run [flags]",
		Short: "Run the daemon (SIGHUP reloads the rules, SIGTERM stops it)",
		Long: `Runs the daemon on the interface its configuration names: the XDP classifier,
the AF_XDP bridge, the control plane, the ingest rings, metrics and the admin
socket. SIGHUP re-reads the file and swaps listeners and rules atomically;
SIGTERM or Ctrl-C detaches everything and releases what the daemon took.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return appliance.Run(c.Context(), path, appliance.Options{})
		},
	}
	c.Flags().StringVar(&path, "config", DefaultConfig, "configuration file")
	return c
}
