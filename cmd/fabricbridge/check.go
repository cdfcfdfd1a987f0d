package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance/config"
)

func newCheckCommand() *cobra.Command {
	var path string
	c := &cobra.Command{
		Use:   "check --config FILE",
		Short: "Validate a configuration file",
		Long: `Validates a configuration file without touching the machine and prints what it
configures, or every problem with its file, line, column and field.`,
		Args:        cobra.NoArgs,
		Annotations: map[string]string{diesOnSignal: "yes"},
		RunE: func(c *cobra.Command, _ []string) error {
			if path == "" {
				return errors.New("check: usage: fabricbridge check --config FILE")
			}
			return checkConfig(path, c.OutOrStdout(), c.ErrOrStderr())
		},
	}
	c.Flags().StringVar(&path, "config", "", "configuration file to check")
	return c
}

// checkConfig validates a configuration file and prints what it
// configures, or every problem with its line and field.
func checkConfig(path string, stdout, stderr io.Writer) error {
	c, err := config.Load(path)
	if err != nil {
		var es config.Errors
		if errors.As(err, &es) {
			fmt.Fprintln(stderr, err)
			return fmt.Errorf("check: %d problem(s) in %s", len(es), path)
		}
		return fmt.Errorf("check: %w", err)
	}
	for _, w := range c.Warnings {
		fmt.Fprintln(stderr, "warning:", w)
	}
	fmt.Fprintf(stdout, "%s: ok: %d interface(s), %d address(es), %d listener(s), %d rule(s), %d ingest ring(s), %d application(s)\n",
		path, len(c.Interfaces), len(c.Addresses), len(c.Listeners), len(c.Rules), len(c.Ingest), len(c.Applications))
	return nil
}
