// Command fabricbridge is the command-line tool of the fabricbridge
// appliance.
//
//	fabricbridge demo                  the whole appliance in a namespace topology, with
//	                                   real traffic and a summary
//	fabricbridge run --config FILE     the daemon (SIGHUP reloads, SIGTERM stops)
//	fabricbridge check --config FILE   validate a configuration file
//	fabricbridge stats                 a live table of the daemon's counters
//	fabricbridge capture --stream NAME -w FILE.pcap [filter]
//	fabricbridge drain                 withdraw this box from the routers (bgp)
//	fabricbridge app http|echo|sink    sample applications on a user-space stack
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/fabricbridge/fabricbridge/appliance/config"
)

const usage = `usage: fabricbridge <command> [flags]

commands:
  demo     build an outside host and a bridge host in network namespaces, run
           the daemon there with an embedded configuration, an HTTP application
           on a user-space stack and an ingest consumer; drive HTTP, UDP trigger
           bursts, blocked datagrams and pings through it, print a summary and
           clean up (needs root). Flags: -requests N, -triggers N, -attach MODE
  run      [--config FILE]: the daemon; SIGHUP reloads the rules, SIGTERM
           shuts down cleanly (default FILE /etc/fabricbridge/fabricbridge.yaml)
  check    --config FILE: validate a configuration file; every problem is
           reported with its file, line and field
  stats    [--config FILE | --metrics HOST:PORT | --admin PATH] [--once]:
           a live table of the daemon's counters and rates, refreshing like top
  capture  --stream NAME -w FILE.pcap [-c N] [filter]: both directions of
           one application's stream into a pcap file (tcpdump, Wireshark);
           filter: tcp|udp|icmp, [src|dst] host ADDR, [src|dst] port N, and
  drain    [--config FILE | --admin PATH]: withdraw this box's addresses from
           the BGP neighbours and keep serving what is established; returns
           after bgp.withdraw_delay (then stop the daemon at leisure)
  app      http|echo|sink [--name NAME] [--listen HOST:PORT] [--config FILE]:
           a sample application on its own user-space TCP/IP stack over the
           bridge (fabricbridge app for the flags)
  help     print this text
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	var err error
	if cmd == "check" {
		// Nothing to clean up: SIGTERM and Ctrl-C end it at once, as
		// they end any process that does not catch them.
		err = checkCommand(args, os.Stdout, os.Stderr)
	} else {
		err = dispatch(cmd, args)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "fabricbridge: %v\n", err)
		os.Exit(1)
	}
}

// dispatch runs a command that cleans up after itself when SIGTERM or
// Ctrl-C ends its context. A second signal ends the process at once,
// should the cleaning up hang.
func dispatch(cmd string, args []string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		stop()
	}()
	var err error
	switch cmd {
	case "demo":
		err = demoCommand(ctx, args)
	case "run":
		err = runCommand(ctx, args)
	case "app":
		err = appCommand(ctx, args, os.Stdout)
	case "capture":
		err = captureCommand(ctx, args, os.Stderr)
	case "stats":
		err = statsCommand(ctx, args, os.Stdout)
	case "drain":
		err = drainCommand(ctx, args, os.Stdout)
	case "help", "-h", "--help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "fabricbridge: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	return err
}

func demoCommand(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	opts := defaultDemo
	fs.IntVar(&opts.Requests, "requests", opts.Requests, "HTTP requests to send")
	fs.IntVar(&opts.TriggerPerPort, "triggers", opts.TriggerPerPort, "UDP trigger datagrams per source port")
	attach := fs.String("attach", "auto", "auto: the fastest data path the interface allows; strict: native zero-copy or fail")
	if err := fs.Parse(args); err != nil {
		return err
	}
	switch *attach {
	case "auto":
		opts.Attach = config.AttachAuto
	case "strict":
		opts.Attach = config.AttachStrict
	default:
		return fmt.Errorf("demo: -attach %q: want auto or strict", *attach)
	}
	if opts.Requests < 1 || opts.TriggerPerPort < 0 {
		return errors.New("demo: -requests must be at least 1 and -triggers not negative")
	}
	if os.Geteuid() != 0 {
		return errors.New("demo: needs root (it creates network namespaces, loads an XDP program and opens AF_XDP sockets)")
	}
	sum, err := runDemo(ctx, opts, os.Stdout)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	printSummary(os.Stdout, sum)
	return nil
}
