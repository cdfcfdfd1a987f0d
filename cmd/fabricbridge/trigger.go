package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	fingest "github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/fabric/ingest/gpu"
)

type triggerOptions struct {
	ring, config, modeName string

	path      string // the ring's socket, found by resolve
	gpu       bool
	mode      gpu.Mode
	blocks    int
	threshold uint64
	every     time.Duration
}

func newTriggerCommand() *cobra.Command {
	var o triggerOptions
	c := &cobra.Command{
		Use:   "trigger [flags]",
		Short: "Consume an ingest ring and run the trigger on it, on the CPU or the GPU",
		Long: `Attaches to an ingest ring as its consumer and runs the trigger on it (the
CPU reference, or the GPU with --gpu), printing records/s, buffers/s and the
publish-to-result latency every --every, and the totals at the end.`,
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := o.resolve(); err != nil {
				return err
			}
			return runTrigger(c.Context(), o, c.OutOrStdout())
		},
	}
	fs := c.Flags()
	fs.StringVar(&o.ring, "ring", "trigger", "the ring: an ingest entry's name, or a socket path")
	fs.StringVar(&o.config, "config", "", "the bridge's configuration, to find the ring's socket (default "+DefaultConfig+")")
	fs.BoolVar(&o.gpu, "gpu", false, "run the trigger on the GPU (CUDA driver API, libcuda.so.1)")
	fs.StringVar(&o.modeName, "mode", "persistent", "with --gpu: persistent or host-driven")
	fs.IntVar(&o.blocks, "blocks", 0, "with --gpu: persistent blocks, or buffers per launch")
	fs.Uint64Var(&o.threshold, "threshold", 1_000_000, "summed window energy that triggers")
	fs.DurationVar(&o.every, "every", 5*time.Second, "how often to print")
	return c
}

// resolve checks the flags and finds the ring's socket.
func (o *triggerOptions) resolve() error {
	if o.every <= 0 || o.blocks < 0 {
		return errors.New("app trigger: --every must be positive and --blocks not negative")
	}
	switch o.modeName {
	case "persistent":
		o.mode = gpu.Persistent
	case "host-driven", "host":
		o.mode = gpu.HostDriven
	default:
		return fmt.Errorf("app trigger: --mode %q: persistent or host-driven", o.modeName)
	}
	o.path = o.ring
	if !strings.ContainsRune(o.ring, '/') {
		path := o.config
		if path == "" {
			path = DefaultConfig
		}
		if cfg, err := config.Load(path); err == nil {
			o.path = appliance.IngestPath(cfg, o.ring)
		} else if o.config != "" {
			return err
		}
	}
	return nil
}

// runTrigger is `app trigger`: the consumer of an ingest ring.
func runTrigger(ctx context.Context, o triggerOptions, stdout io.Writer) error {
	cons, err := fingest.Open(o.path, fingest.ConsumerOptions{})
	if err != nil {
		return fmt.Errorf("app trigger: %w", err)
	}
	defer cons.Close()
	info := cons.Info()
	fmt.Fprintf(stdout, "trigger: attached to %s (%d buffers of %d bytes, window %v)\n", o.path, info.Buffers, info.BufferSize, info.Window)
	var latency fingest.Histogram
	var records, buffers uint64
	var windows, triggers atomic.Uint64 // the GPU's are counted on Run's goroutine
	report := func(final bool, elapsed time.Duration, recs, bufs uint64, lat fingest.HistogramSnapshot) {
		s := elapsed.Seconds()
		what := "every"
		if final {
			what = "total"
		}
		fmt.Fprintf(stdout, "trigger %s: %.0f records/s, %.0f buffers/s, publish to result p50 < %v p99 < %v p99.9 < %v; %d windows, %d triggered\n",
			what, float64(recs)/s, float64(bufs)/s, time.Duration(lat.Quantile(0.5)), time.Duration(lat.Quantile(0.99)),
			time.Duration(lat.Quantile(0.999)), windows.Load(), triggers.Load())
	}
	start := time.Now()
	if !o.gpu {
		ref := &fingest.Reference{Threshold: o.threshold}
		last, lastRecs, lastBufs := start, uint64(0), uint64(0)
		for ctx.Err() == nil {
			b, err := cons.Next(100 * time.Millisecond)
			if errors.Is(err, fingest.ErrTimeout) {
				continue
			}
			if errors.Is(err, fingest.ErrClosed) {
				break
			}
			if err != nil {
				return err
			}
			if err := ref.Process(&b); err != nil {
				return err
			}
			if now := fingest.Now(); now > b.PublishNs {
				latency.Observe(now - b.PublishNs)
			}
			records += uint64(b.Records)
			buffers++
			windows.Store(ref.Windows)
			triggers.Store(ref.Triggers)
			cons.Release(&b)
			if time.Since(last) >= o.every {
				report(false, time.Since(last), records-lastRecs, buffers-lastBufs, latency.Snapshot())
				last, lastRecs, lastBufs = time.Now(), records, buffers
			}
		}
		report(true, time.Since(start), records, buffers, latency.Snapshot())
		return nil
	}
	g, err := gpu.Open(cons, gpu.Options{Mode: o.mode, Threshold: o.threshold, Blocks: o.blocks,
		OnResult: func(r gpu.Result) {
			if r.Closed {
				windows.Add(1)
				if r.Triggered {
					triggers.Add(1)
				}
			}
		}})
	if err != nil {
		return fmt.Errorf("app trigger: %w", err)
	}
	defer g.Close()
	fmt.Fprintf(stdout, "trigger: on %s, %s\n", g.Device(), o.mode)
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	tick := time.NewTicker(o.every)
	defer tick.Stop()
	last, prev := start, g.Stats()
	for {
		select {
		case err := <-done:
			st := g.Stats()
			report(true, time.Since(start), st.Records, st.Buffers, st.Latency)
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		case now := <-tick.C:
			st := g.Stats()
			report(false, now.Sub(last), st.Records-prev.Records, st.Buffers-prev.Buffers, st.Latency)
			last, prev = now, st
		}
	}
}
