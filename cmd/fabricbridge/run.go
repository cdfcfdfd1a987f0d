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
	var (
		path string
		opts appliance.Options
	)
	c := &cobra.Command{
		Use:   "run [flags]",
		Short: "Run the daemon (SIGHUP reloads the rules, SIGTERM stops it)",
		Long: `Runs the daemon on the interface its configuration names: the XDP classifier,
the AF_XDP bridge, the control plane, the ingest rings, metrics and the admin
socket. SIGHUP re-reads the file and swaps listeners and rules atomically.

SIGTERM or Ctrl-C stops it for a restart: the XDP program stays attached,
pinned under the bpf file system (--bpffs) with every application's flows
and listeners, and drops their packets while no daemon runs, so that their
peers retransmit instead of being reset; the next daemon takes the program
over and the applications claim their flows again. With --release, or
without a bpf file system, it detaches everything and releases what it
took instead; after a final stop, fabricbridge release does that.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return appliance.Run(c.Context(), path, opts)
		},
	}
	c.Flags().StringVar(&path, "config", DefaultConfig, "configuration file")
	c.Flags().StringVar(&opts.BPFFS, "bpffs", appliance.DefaultBPFFS, "where a bpf file system is mounted, to pin the data path in")
	c.Flags().BoolVar(&opts.Release, "release", false, "on SIGTERM, detach and release everything instead of leaving the data path for the next daemon")
	return c
}
