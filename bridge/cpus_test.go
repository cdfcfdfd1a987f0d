package bridge

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestPinnedLoops: with Config.CPUs each loop's thread may run on its CPU
// and nowhere else, Stats says where, and after Close the thread is gone
// rather than back among the Go runtime's threads, still pinned.
func TestPinnedLoops(t *testing.T) {
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		t.Fatal(err)
	}
	cpu := -1
	for c := 0; c < cpuSetSize; c++ {
		if allowed.IsSet(c) {
			cpu = c // the last allowed CPU: not the default choice of anything
		}
	}
	forEachPath(t, func(t *testing.T, cfg Config) {
		cfg.CPUs = []int{cpu}
		r := newRig(t, cfg)
		var tids []int
		for i, q := range r.b.queues {
			tid := int(q.tid.Load())
			var set unix.CPUSet
			if err := unix.SchedGetaffinity(tid, &set); err != nil {
				t.Fatal(err)
			}
			if set.Count() != 1 || !set.IsSet(cpu) {
				t.Errorf("queue %d: loop thread %d may run on %s, want only %d", q.id, tid, cpuList(&set), cpu)
			}
			if got := r.b.Stats().Queues[i].CPU; got != cpu {
				t.Errorf("queue %d: Stats CPU %d, want %d", q.id, got, cpu)
			}
			tids = append(tids, tid)
		}
		if err := r.b.Close(); err != nil {
			t.Fatal(err)
		}
		for _, tid := range tids {
			if tid == os.Getpid() {
				// A goroutine that ends locked to the main thread wedges it
				// for good rather than ending it; it runs nothing more.
				t.Logf("loop thread %d is the main thread: not checked", tid)
				continue
			}
			task := fmt.Sprintf("/proc/self/task/%d", tid)
			deadline := time.Now().Add(2 * time.Second)
			for _, err := os.Stat(task); err == nil; _, err = os.Stat(task) {
				if time.Now().After(deadline) {
					t.Fatalf("loop thread %d still exists after Close: the runtime may run other goroutines on it, pinned to CPU %d", tid, cpu)
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	})
}

// An unpinned loop reports -1, and its thread may run wherever the process
// may.
func TestUnpinnedLoops(t *testing.T) {
	r := newRig(t, Config{})
	var allowed, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		t.Fatal(err)
	}
	for i, q := range r.b.queues {
		if err := unix.SchedGetaffinity(int(q.tid.Load()), &set); err != nil {
			t.Fatal(err)
		}
		if set != allowed {
			t.Errorf("queue %d: loop may run on %s, want %s", q.id, cpuList(&set), cpuList(&allowed))
		}
		if got := r.b.Stats().Queues[i].CPU; got != -1 {
			t.Errorf("queue %d: Stats CPU %d, want -1", q.id, got)
		}
	}
}

// A CPU the process may not use is refused before anything is opened, and
// the error names the ones it may.
func TestPinnedLoopsBadCPU(t *testing.T) {
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		t.Fatal(err)
	}
	bad := []int{-1, cpuSetSize}
	for c := 0; c < cpuSetSize; c++ {
		if !allowed.IsSet(c) {
			bad = append(bad, c) // offline, or outside this process's cpuset
			break
		}
	}
	for _, c := range bad {
		_, err := Open(Config{Interface: "fb-no-such-if", CPUs: []int{c}})
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("CPU %d is not one this process may run on (allowed: %s)", c, cpuList(&allowed))) {
			t.Errorf("CPUs [%d]: err %v, want it refused by name with the allowed list", c, err)
		}
	}
}

func TestCPUList(t *testing.T) {
	for _, tc := range []struct {
		cpus []int
		want string
	}{
		{nil, ""},
		{[]int{0}, "0"},
		{[]int{0, 1, 2, 3}, "0-3"},
		{[]int{0, 2, 3, 4, 7, 9, 10}, "0,2-4,7,9-10"},
		{[]int{cpuSetSize - 2, cpuSetSize - 1}, fmt.Sprintf("%d-%d", cpuSetSize-2, cpuSetSize-1)},
	} {
		var set unix.CPUSet
		for _, c := range tc.cpus {
			set.Set(c)
		}
		if got := cpuList(&set); got != tc.want {
			t.Errorf("cpuList(%v) = %q, want %q", tc.cpus, got, tc.want)
		}
	}
}
