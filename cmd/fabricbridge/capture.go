package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/fabricbridge/fabricbridge/appliance/capture"
	"github.com/fabricbridge/fabricbridge/appliance/config"
)

// captureCommand records both directions of one application stream into a
// pcap file, through the daemon's admin socket, until Ctrl-C, the count,
// or the application's end.
func captureCommand(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("capture", flag.ContinueOnError)
	path := fs.String("config", "", "read the admin socket path from this configuration (default "+DefaultConfig+")")
	admin := fs.String("admin", "", "the daemon's admin socket (overrides --config)")
	stream := fs.String("stream", "", "the stream: an application name or a stream id")
	out := fs.String("w", "", "pcap file to write (- for standard output)")
	count := fs.Int("c", 0, "stop after this many packets (0: until interrupted)")
	snaplen := fs.Int("snaplen", 0, "bytes kept of each packet (default 65535)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *stream == "" || *out == "" || *count < 0 || *snaplen < 0 {
		return errors.New("capture: usage: fabricbridge capture --stream NAME -w FILE.pcap [-c N] [--snaplen N] [--config FILE | --admin PATH] [filter]")
	}
	filter := strings.Join(fs.Args(), " ")
	if _, err := capture.ParseFilter(filter); err != nil {
		return fmt.Errorf("capture: %w", err)
	}
	sock, err := adminSocket(*admin, *path)
	if err != nil {
		return fmt.Errorf("capture: %w", err)
	}
	q := url.Values{"stream": {*stream}, "filter": {filter}}
	if *count > 0 {
		q.Set("count", strconv.Itoa(*count))
	}
	if *snaplen > 0 {
		q.Set("snaplen", strconv.Itoa(*snaplen))
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
	var w io.Writer = os.Stdout
	if *out != "-" {
		f, err := os.Create(*out)
		if err != nil {
			return fmt.Errorf("capture: %w", err)
		}
		defer f.Close()
		w = f
	}
	fmt.Fprintf(stderr, "capturing stream %s%s; Ctrl-C stops\n", *stream, map[bool]string{true: " (" + filter + ")", false: ""}[filter != ""])
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
