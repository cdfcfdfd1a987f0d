package appliance

import (
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/ebpf"
)

// The file's spin, cpus and flow_capacity reach the bridge; 0s means what
// it says (sleep at once), not the bridge's default.
func TestBridgeConfigSpinAndCPUs(t *testing.T) {
	for _, tc := range []struct {
		iface string
		spin  time.Duration
		cpus  []int
		flows int
	}{
		{"", 20 * time.Microsecond, nil, ebpf.DefaultFlowCapacity},
		{", spin: 0s", -1, nil, ebpf.DefaultFlowCapacity},
		{", spin: 150us, cpus: [1, 0], flow_capacity: 1048576", 150 * time.Microsecond, []int{1, 0}, 1 << 20},
	} {
		c, err := config.Parse("t.yaml", []byte("interfaces: [{name: eth1"+tc.iface+"}]\naddresses: [198.18.0.1]\n"))
		if err != nil {
			t.Fatal(err)
		}
		bc, err := bridgeConfig(c.Interfaces[0], slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		if bc.Spin != tc.spin || !slices.Equal(bc.CPUs, tc.cpus) || bc.FlowCapacity != tc.flows {
			t.Errorf("%q: bridge spin %v cpus %v flow capacity %d, want %v %v %d", tc.iface, bc.Spin, bc.CPUs, bc.FlowCapacity, tc.spin, tc.cpus, tc.flows)
		}
	}
}

// A daemon told to pin its loop does, and says so in its metrics; one told
// to use a CPU it may not run on refuses to start and names the CPU.
func TestPinnedLoopThroughDaemon(t *testing.T) {
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		t.Fatal(err)
	}
	cpu, bad := -1, -1
	for c := range 1024 {
		if allowed.IsSet(c) {
			cpu = c
		} else if bad < 0 {
			bad = c
		}
	}
	tp := newTopo(t)
	tp.iface = fmt.Sprintf(", cpus: [%d], spin: 0s", cpu)
	d := tp.start(t, tp.config(t, ""), io.Discard)
	defer d.Close()
	s := tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_queue_cpu", "interface", tp.v.A.Name, "queue", "0"); v != float64(cpu) {
		t.Errorf("fabricbridge_queue_cpu = %v, want %d", v, cpu)
	}
	value(t, s, "fabricbridge_queue_sleeps_total", "interface", tp.v.A.Name, "queue", "0")
	d.Close()

	tp.iface = fmt.Sprintf(", cpus: [%d]", bad)
	c := tp.config(t, "")
	var err error
	if e := tp.bridge.Do(func() error {
		d2, err2 := Start(c, Options{Log: io.Discard})
		if err2 == nil {
			d2.Close()
		}
		err = err2
		return nil
	}); e != nil {
		t.Fatal(e)
	}
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("CPU %d is not one this process may run on", bad)) {
		t.Errorf("start with cpus [%d]: %v, want a refusal naming the CPU", bad, err)
	}
}
