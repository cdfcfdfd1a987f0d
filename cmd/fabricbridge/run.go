package main

import (
	"context"
	"errors"
	"flag"

	"github.com/fabricbridge/fabricbridge/appliance"
)

// DefaultConfig is where `run`, `check` and `stats` look without --config.
const DefaultConfig = "/etc/fabricbridge/fabricbridge.yaml"

// runCommand is the daemon: it runs until SIGTERM or SIGINT (ctx) and
// reloads its rules on SIGHUP.
func runCommand(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	path := fs.String("config", DefaultConfig, "configuration file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return errors.New("run: usage: fabricbridge run [--config FILE]")
	}
	return appliance.Run(ctx, *path, appliance.Options{})
}
