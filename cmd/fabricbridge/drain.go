package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"

	"github.com/spf13/cobra"
)

// newDrainCommand asks the daemon, over its admin socket, to withdraw the
// box's addresses from the routers (docs/scale-out.md).
func newDrainCommand() *cobra.Command {
	var path, admin string
	c := &cobra.Command{
		Use:   "drain [flags]",
		Short: "Withdraw this box's addresses from the BGP neighbours",
		Long: `Asks the daemon, over its admin socket, to withdraw the service addresses it
announces to its BGP neighbours (the bgp section of its configuration), so
the routers send new connections to the other boxes, and to go on serving
what is established. It returns after bgp.withdraw_delay; then stop the
daemon at leisure.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			return drain(c.Context(), path, admin, c.OutOrStdout())
		},
	}
	fs := c.Flags()
	fs.StringVar(&path, "config", "", "read the admin socket path from this configuration (default "+DefaultConfig+")")
	fs.StringVar(&admin, "admin", "", "the daemon's admin socket (overrides --config)")
	return c
}

// drain posts /drain to the daemon's admin socket and prints its answer.
func drain(ctx context.Context, path, admin string, stdout io.Writer) error {
	sock, err := adminSocket(admin, path)
	if err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://fabricbridge/drain", nil)
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
