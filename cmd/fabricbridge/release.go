package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
)

// newReleaseCommand gives back what a stopped daemon left for its
// successor: the final shutdown after `run`'s SIGTERM.
func newReleaseCommand() *cobra.Command {
	var path, bpffs string
	c := &cobra.Command{
		Use:   "release [flags]",
		Short: "Give the interface back after the daemon stopped for good",
		Long: `A daemon stopped with SIGTERM leaves its XDP program attached, pinned in the
bpf file system with its tables, and its reserved ports reserved, so that
the applications' traffic keeps being steered (and dropped, not reset,
while no daemon runs) until the next daemon takes over. After a final stop,
release detaches that program, removes its pins and returns the reserved
ports. Run it in the daemon's network namespace with the daemon's
configuration; it refuses while the daemon runs. (run --release stops for
good at once.)`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cfg, err := config.LoadContext(c.Context(), path)
			if err != nil {
				return err
			}
			r, err := appliance.Release(cfg, appliance.Options{BPFFS: bpffs})
			if err != nil {
				return fmt.Errorf("release: %w", err)
			}
			out := c.OutOrStdout()
			switch {
			case r.Detached:
				fmt.Fprintf(out, "detached the XDP program pinned in %s and removed its pins\n", r.Pins)
			case r.Pins != "":
				fmt.Fprintf(out, "removed the pins in %s (no program was attached through them)\n", r.Pins)
			default:
				fmt.Fprintln(out, "no pinned XDP program")
			}
			fmt.Fprintf(out, "returned reserved ports: %s\n", r.Ports)
			return nil
		},
	}
	c.Flags().StringVar(&path, "config", DefaultConfig, "the daemon's configuration file")
	c.Flags().StringVar(&bpffs, "bpffs", appliance.DefaultBPFFS, "where the bpf file system the daemon pinned in is mounted")
	return c
}
