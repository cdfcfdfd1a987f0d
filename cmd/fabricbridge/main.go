// Command fabricbridge is the command-line tool of the fabricbridge
// appliance: the daemon (run), its checks and tools (check, stats, capture),
// sample applications (app) and a self-contained demo (demo).
//
// `fabricbridge --help` lists the commands and `fabricbridge COMMAND --help`
// describes one; the same text makes the manual pages in docs/man.
package main

//go:generate go test -count=1 -run ^TestManPages$ . -args -update

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
)

// ownsProcess is set when the command line runs as the whole process
// (main), not inside a test's: only then may a command size the Go runtime.
var ownsProcess bool

func main() {
	ownsProcess = true
	err := execute(context.Background(), os.Args[1:], os.Stdout, os.Stderr)
	if err == nil {
		return
	}
	fmt.Fprintf(os.Stderr, "fabricbridge: %v\n", err)
	if errors.As(err, new(commandLineError)) {
		os.Exit(2)
	}
	os.Exit(1)
}

// execute runs one command line (args without the program's name) with
// its output in stdout and stderr.
func execute(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	stop := func() {}
	defer func() { stop() }()
	root := newRootCommand(func(c *cobra.Command) {
		// Nothing to clean up: SIGTERM and Ctrl-C end it at once, as
		// they end any process that does not catch them.
		if c.Annotations[diesOnSignal] != "" {
			return
		}
		var ctx context.Context
		ctx, stop = signal.NotifyContext(c.Context(), os.Interrupt, syscall.SIGTERM)
		// A second signal ends the process at once, should the
		// cleaning up hang.
		context.AfterFunc(ctx, stop)
		c.SetContext(ctx)
	})
	root.SetArgs(singleDashFlags(root, args))
	root.SetOut(stdout)
	root.SetErr(stderr)
	return root.ExecuteContext(ctx)
}

// diesOnSignal marks a command that leaves SIGTERM and SIGINT their default
// action; every other command gets a context that they end, and cleans up.
const diesOnSignal = "fabricbridge/dies-on-signal"

// commandLineError is a command line that names no command or an unknown
// one: exit status 2.
type commandLineError struct{ error }

// newRootCommand is the command tree; onStart runs before any command's
// own work, with the command that runs.
func newRootCommand(onStart func(*cobra.Command)) *cobra.Command {
	root := &cobra.Command{
		Use:   "fabricbridge",
		Short: "An XDP/AF_XDP edge appliance that bridges packets to user-space applications",
		Long: `fabricbridge classifies the packets of one interface in XDP and hands the
traffic of applications that registered with it to their own user-space
TCP/IP stacks over shared-memory streams, and trigger datagrams to ingest
rings, leaving everything else to the kernel.

The daemon (run) reads its configuration from ` + DefaultConfig + `
(fabricbridge.yaml(5)); check validates a file, stats and capture watch a running daemon, app runs
sample applications on a user-space stack and demo shows the whole appliance
in network namespaces of its own.`,
		Args: func(c *cobra.Command, args []string) error {
			if len(args) == 0 {
				return nil
			}
			msg := fmt.Sprintf("unknown command %q", args[0])
			if s := c.SuggestionsFor(args[0]); len(s) > 0 {
				msg += fmt.Sprintf(" (did you mean %s?)", strings.Join(s, ", "))
			}
			return commandLineError{fmt.Errorf("%s; fabricbridge --help lists the commands", msg)}
		},
		RunE: func(c *cobra.Command, _ []string) error {
			c.SetOut(c.ErrOrStderr())
			c.Usage()
			return commandLineError{errors.New("no command given")}
		},
		PersistentPreRun: func(c *cobra.Command, _ []string) { onStart(c) },
		SilenceErrors:    true,
		SilenceUsage:     true,
		// The manual pages are regenerated and compared in CI: no date
		// of generation in them.
		DisableAutoGenTag: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return fmt.Errorf("%s: %w (%s --help)", c.CommandPath(), err, c.CommandPath())
	})
	root.AddCommand(newDemoCommand(), newRunCommand(), newCheckCommand(), newStatsCommand(),
		newCaptureCommand(), newDrainCommand(), newReleaseCommand(), newAppCommand(), newVersionCommand())
	return root
}

// singleDashFlags turns -name and -name=value into --name and --name=value
// where name is a long flag of the command args run: the Go flag package,
// which fabricbridge used before, took both, and scripts and units written
// then keep working.
func singleDashFlags(root *cobra.Command, args []string) []string {
	c, _, err := root.Find(args)
	if err != nil {
		return args
	}
	c.InitDefaultHelpFlag()
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = a
		if a == "--" {
			copy(out[i:], args[i:])
			break
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "-"), "=")
		if len(name) > 1 && a[0] == '-' && a[1] != '-' && c.Flags().Lookup(name) != nil {
			out[i] = "-" + a
		}
	}
	return out
}
