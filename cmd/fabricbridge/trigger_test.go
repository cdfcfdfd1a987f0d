package main

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	fingest "github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/fabric/ingest/gpu"
)

// TestAppTrigger runs `app trigger` on the CPU over a ring fed here, and
// with --gpu where there is no GPU it says so.
func TestAppTrigger(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ring")
	r, err := fingest.Create(fingest.Config{Name: path, Buffers: 8, BufferSize: 4096, Window: time.Second, NoHugepages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var out bytes.Buffer
	done := make(chan error, 1)
	go func() {
		done <- triggerCommand(context.Background(), []string{"--ring", path, "--threshold", "100", "--every", "1h"}, &out)
	}()
	for !r.Stats().Attached {
		time.Sleep(time.Millisecond)
	}
	src := fingest.SourceOf(netip.MustParseAddr("198.18.0.1"), 5000, 4000)
	payload := make([]byte, 8)
	for i := range 1000 {
		fingest.PutTriggerPayload(payload, uint32(i), []uint16{1, 2})
		for !r.Writable() {
			time.Sleep(10 * time.Microsecond)
		}
		r.Append(src, fingest.Now(), payload)
	}
	r.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	t.Log(out.String())
	// 1000 records of 32 bytes: 128 to a 4 KiB buffer, each its own window.
	if !strings.Contains(out.String(), "trigger total: ") || !strings.Contains(out.String(), "; 8 windows, 8 triggered") {
		t.Errorf("no totals, or not 8 windows all triggered:\n%s", out.String())
	}

	if err := triggerCommand(context.Background(), []string{"--ring", path, "--mode", "sideways"}, &out); err == nil || !strings.Contains(err.Error(), "sideways") {
		t.Error("--mode sideways accepted")
	}
	path2 := filepath.Join(t.TempDir(), "ring")
	r2, err := fingest.Create(fingest.Config{Name: path2, NoHugepages: true, Buffers: 2, BufferSize: 4096})
	if err != nil {
		t.Fatal(err)
	}
	// With a GPU the run ends when the producer closes.
	go func() { time.Sleep(200 * time.Millisecond); r2.Close() }()
	err = triggerCommand(context.Background(), []string{"--ring", path2, "--gpu"}, &out)
	var ce *gpu.CUDAError
	switch {
	case err == nil:
		t.Log("a GPU is here: --gpu ran")
	case errors.Is(err, gpu.ErrNoDriver), errors.As(err, &ce):
		t.Logf("--gpu without a GPU: %v", err)
	default:
		t.Errorf("--gpu: %v", err)
	}
}
