package ingest

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"
)

// TestMain lets the test binary play a consumer process: with
// FB_INGEST_CHILD set to a ring name it opens the ring by that name, runs
// the reference consumer until the producer closes, prints its results as
// JSON and exits. With FB_INGEST_CHILD_HOLD it takes one buffer, says so
// and waits to be killed while holding it.
func TestMain(m *testing.M) {
	if name := os.Getenv("FB_INGEST_CHILD"); name != "" {
		os.Exit(childConsumer(name, os.Getenv("FB_INGEST_CHILD_HOLD") != ""))
	}
	os.Exit(m.Run())
}

type childResult struct {
	Sources []SourceCounts
	Names   []string
	Buffers uint64
	Err     string
}

func childConsumer(name string, hold bool) int {
	c, err := Open(name, ConsumerOptions{Spin: 10 * time.Microsecond})
	if err != nil {
		fmt.Println(`{"Err":` + fmt.Sprintf("%q", err.Error()) + `}`)
		return 1
	}
	if hold {
		if _, err := c.Next(10 * time.Second); err != nil {
			return 1
		}
		fmt.Println("holding")
		time.Sleep(time.Minute)
		return 1
	}
	var ref Reference
	res := childResult{}
	for {
		b, err := c.Next(10 * time.Second)
		if errors.Is(err, ErrClosed) {
			break
		}
		if err != nil {
			res.Err = err.Error()
			break
		}
		if err := ref.Process(&b); err != nil {
			res.Err = err.Error()
			break
		}
		c.Release(&b)
	}
	res.Sources = ref.Sources
	for i := range ref.Sources {
		s, _ := c.Source(uint16(i))
		res.Names = append(res.Names, s.String())
	}
	res.Buffers = c.Stats().Buffers
	json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

func startChild(t *testing.T, name string, hold bool) (*exec.Cmd, *bufio.Reader) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FB_INGEST_CHILD="+name)
	if hold {
		cmd.Env = append(cmd.Env, "FB_INGEST_CHILD_HOLD=1")
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, bufio.NewReader(out)
}

// TestConsumerProcess: a consumer in another process opens the ring by
// name, survives a predecessor that was killed holding a buffer, and
// reads every record of three sources in order, with the one sender gap
// reported.
func TestConsumerProcess(t *testing.T) {
	r, err := Create(testConfig(t, Config{Buffers: 8, Window: 50 * time.Microsecond}))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()

	// A first consumer takes a buffer and dies holding it.
	doomed, out := startChild(t, r.Name(), true)
	waitAttached(t, r)
	r.Append(srcA, Now(), []byte("held"))
	r.Flush()
	if line, err := out.ReadString('\n'); err != nil || line != "holding\n" {
		t.Fatalf("first consumer: %q %v", line, err)
	}
	doomed.Process.Kill()
	doomed.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for r.Stats().Attached {
		if time.Now().After(deadline) {
			t.Fatal("the producer never saw the killed consumer go")
		}
		time.Sleep(time.Millisecond)
	}

	child, out := startChild(t, r.Name(), false)
	waitAttached(t, r)
	srcs := []Source{srcA, srcB, srcC}
	const perSource = 3000
	var p [4 + 2*20]byte
	energies := make([]uint16, 20)
	for i := range perSource {
		for s := range srcs {
			seq := uint32(i)
			if s == 1 && i >= 1000 {
				seq += 5 // source B skips five numbers once
			}
			n := PutTriggerPayload(p[:], seq, energies)
			for !r.Writable() {
				// The consumer is behind: the engine would drop,
				// this test waits so that nothing is lost.
				time.Sleep(10 * time.Microsecond)
			}
			if !r.Append(srcs[s], Now(), p[:n]) {
				t.Fatal("a writable ring dropped a record")
			}
		}
		r.Tick(Now())
	}
	r.Close()
	var res childResult
	if err := json.NewDecoder(out).Decode(&res); err != nil {
		t.Fatal(err)
	}
	child.Wait()
	if res.Err != "" {
		t.Fatal(res.Err)
	}
	if len(res.Sources) != 3 {
		t.Fatalf("%d sources", len(res.Sources))
	}
	// Source 0 (A) also sent the held record first; the new consumer
	// released that buffer as stale, so A's ring sequence starts at 1.
	for i, s := range res.Sources {
		wantGaps := uint64(0)
		if i == 1 {
			wantGaps = 5
		}
		if s.Records != perSource || s.SenderGaps != wantGaps || s.SenderBackwards != 0 || s.DroppedHere != 0 {
			t.Errorf("source %d (%s): %+v", i, res.Names[i], s)
		}
	}
	if res.Names[1] != srcB.String() {
		t.Errorf("source 1 is %s, want %s", res.Names[1], srcB)
	}
}
