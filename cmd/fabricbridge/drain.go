package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"

	"github.com/spf13/cobra"
)

// newDrainCommand asks the daemon, over its admin socket, to withdraw the
// box's addresses from the routers, or to drain one instance of an
// application (docs/scale-out.md).
func newDrainCommand() *cobra.Command {
	var path, admin, app, instance string
	c := &cobra.Command{
		Use:   "drain [flags]",
		Short: "Withdraw this box's addresses from the BGP neighbours, or drain one instance",
		Long: `Asks the daemon, over its admin socket, to withdraw the service addresses it
announces to its BGP neighbours (the bgp section of its configuration), so
the routers send new connections to the other boxes, and to go on serving
what is established. It returns after bgp.withdraw_delay; then stop the
daemon at leisure.

With --app and --instance it drains that instance of the application
instead: on the listeners it shares with the other instances it takes no
new connections, and keeps its established ones until they end or
spread.drain_deadline passes. The box goes on announcing. Drain the
instance on every box, since each box spreads the connections it receives.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if (app == "") != (instance == "") {
				return errors.New("drain: --app and --instance go together: name the instance of the application to drain")
			}
			return drain(c.Context(), path, admin, app, instance, c.OutOrStdout())
		},
	}
	fs := c.Flags()
	fs.StringVar(&path, "config", "", "read the admin socket path from this configuration (default "+DefaultConfig+")")
	fs.StringVar(&admin, "admin", "", "the daemon's admin socket (overrides --config)")
	fs.StringVar(&app, "app", "", "drain an instance of this application rather than the box (with --instance)")
	fs.StringVar(&instance, "instance", "", "the instance of --app to drain, as it registered")
	return c
}

// drain posts /drain to the daemon's admin socket, with the instance to
// drain if one is given, and prints its answer.
func drain(ctx context.Context, path, admin, app, instance string, stdout io.Writer) error {
	sock, err := adminSocket(admin, path)
	if err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	target := "http://fabricbridge/drain"
	if app != "" {
		target += "?" + url.Values{"app": {app}, "instance": {instance}}.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("drain: is the daemon running? %w", err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return errors.New(strings.TrimSpace(string(msg)))
	}
	_, err = stdout.Write(msg)
	return err
}
