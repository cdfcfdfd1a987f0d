package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
)

// drainCommand asks the daemon, over its admin socket, to withdraw the
// box's addresses from the routers (docs/scale-out.md).
func drainCommand(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("drain", flag.ContinueOnError)
	path := fs.String("config", "", "read the admin socket path from this configuration (default "+DefaultConfig+")")
	admin := fs.String("admin", "", "the daemon's admin socket (overrides --config)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return errors.New("drain: usage: fabricbridge drain [--config FILE | --admin PATH]")
	}
	sock, err := adminSocket(*admin, *path)
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
