package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/fabricbridge/fabricbridge/appliance/config"
)

// checkCommand validates a configuration file and prints what it
// configures, or every problem with its line and field.
func checkCommand(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	path := fs.String("config", "", "configuration file to check")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *path == "" || fs.NArg() > 0 {
		return errors.New("check: usage: fabricbridge check --config FILE")
	}
	c, err := config.Load(*path)
	if err != nil {
		var es config.Errors
		if errors.As(err, &es) {
			fmt.Fprintln(stderr, err)
			return fmt.Errorf("check: %d problem(s) in %s", len(es), *path)
		}
		return fmt.Errorf("check: %w", err)
	}
	fmt.Fprintf(stdout, "%s: ok: %d interface(s), %d address(es), %d listener(s), %d rule(s), %d ingest ring(s), %d application(s)\n",
		*path, len(c.Interfaces), len(c.Addresses), len(c.Listeners), len(c.Rules), len(c.Ingest), len(c.Applications))
	return nil
}
