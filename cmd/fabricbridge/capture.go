package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance/capture"
	"github.com/fabricbridge/fabricbridge/appliance/config"
)

type captureOptions struct {
	config, admin, stream, out string
	count, snaplen             int
}

func newCaptureCommand() *cobra.Command {
	var o captureOptions
	c := &cobra.Command{
		Use:   "capture --stream NAME -w FILE.pcap [flags] [filter]",
		Short: "Record both directions of one application's stream into a pcap file",
		Long: `Records both directions of one application's stream into a pcap file
(tcpdump, Wireshark), through the daemon's admin socket (root only), until
Ctrl-C, the count or the application's end.

The filter is a conjunction of terms joined by "and": tcp, udp, icmp or icmp6;
[src|dst] host ADDR; [src|dst] port N. For example:

    fabricbridge capture --stream web -w web.pcap tcp and dst port 80`,
		RunE: func(c *cobra.Command, args []string) error {
			return captureStream(c.Context(), o, strings.Join(args, " "), c.OutOrStdout(), c.ErrOrStderr())
		},
	}
	fs := c.Flags()
	fs.StringVar(&o.config, "config", "", "read the admin socket path from this configuration (default "+DefaultConfig+")")
	fs.StringVar(&o.admin, "admin", "", "the daemon's admin socket (overrides --config)")
	fs.StringVar(&o.stream, "stream", "", "the stream: an application name or a stream id")
	fs.StringVarP(&o.out, "write", "w", "", "pcap file to write (- for standard output)")
	fs.IntVarP(&o.count, "count", "c", 0, "stop after this many packets (0: until interrupted)")
	fs.IntVar(&o.snaplen, "snaplen", 0, "bytes kept of each packet (default 65535)")
	return c
}

// captureStream records both directions of one application stream into a
// pcap file, through the daemon's admin socket, until Ctrl-C, the count,
// or the application's end.
func captureStream(ctx context.Context, o captureOptions, filter string, stdout, stderr io.Writer) error {
	if o.stream == "" || o.out == "" || o.count < 0 || o.snaplen < 0 {
		return errors.New("capture: usage: fabricbridge capture --stream NAME -w FILE.pcap [-c N] [--snaplen N] [--config FILE | --admin PATH] [filter]")
	}
	if _, err := capture.ParseFilter(filter); err != nil {
		return fmt.Errorf("capture: %w", err)
	}
	sock, err := adminSocket(o.admin, o.config)
	if err != nil {
		return fmt.Errorf("capture: %w", err)
	}
	q := url.Values{"stream": {o.stream}, "filter": {filter}}
	if o.count > 0 {
		q.Set("count", strconv.Itoa(o.count))
	}
	if o.snaplen > 0 {
		q.Set("snaplen", strconv.Itoa(o.snaplen))
	}
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://fabricbridge/capture?"+q.Encode(), nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("capture: is the daemon running? %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("capture: %s", strings.TrimSpace(string(msg)))
	}
	w := stdout
	if o.out != "-" {
		f, err := os.Create(o.out)
		if err != nil {
			return fmt.Errorf("capture: %w", err)
		}
		defer f.Close()
		w = f
	}
	fmt.Fprintf(stderr, "capturing stream %s%s; Ctrl-C stops\n", o.stream, map[bool]string{true: " (" + filter + ")", false: ""}[filter != ""])
	cw := &pcapCounter{w: w}
	_, err = io.Copy(cw, resp.Body)
	if ctx.Err() != nil {
		err = nil // interrupted: what arrived is written
	}
	if err != nil {
		return fmt.Errorf("capture: %w", err)
	}
	if sum := resp.Trailer.Get("Fabricbridge-Capture-Summary"); sum != "" {
		fmt.Fprintf(stderr, "%s\n", sum)
	} else {
		fmt.Fprintf(stderr, "%d packets written\n", cw.records)
	}
	return nil
}

// adminSocket is the admin socket path from --admin or the configuration.
func adminSocket(admin, path string) (string, error) {
	if admin != "" {
		return admin, nil
	}
	if path == "" {
		path = DefaultConfig
		if _, err := os.Stat(path); err != nil {
			return filepath.Join(filepath.Dir(config.DefaultSocket), "admin.sock"), nil
		}
	}
	c, err := config.Load(path)
	if err != nil {
		return "", err
	}
	return c.Control.AdminSocket, nil
}

// pcapCounter passes a pcap stream through and counts its records.
type pcapCounter struct {
	w       io.Writer
	seen    int64 // bytes passed
	next    int64 // offset of the next record header
	hdr     []byte
	records int
}

func (c *pcapCounter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	for i := 0; i < n; {
		off := c.seen + int64(i)
		switch {
		case off < 24:
			i += int(min(24-off, int64(n-i)))
			c.next = 24
		case off < c.next:
			i += int(min(c.next-off, int64(n-i)))
		default: // inside a record header
			take := min(16-len(c.hdr), n-i)
			c.hdr = append(c.hdr, p[i:i+take]...)
			i += take
			if len(c.hdr) == 16 {
				c.next = off + int64(take) + int64(binary.LittleEndian.Uint32(c.hdr[8:]))
				c.hdr = c.hdr[:0]
				c.records++
			}
		}
	}
	c.seen += int64(n)
	return n, err
}
