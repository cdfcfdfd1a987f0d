package bridge

import (
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// checkCPUs rejects a CPU the process may not run on, naming the ones it
// may: pinning there would fail in the loop, or starve it on an offline
// CPU's empty run queue.
func checkCPUs(cpus []int) error {
	if len(cpus) == 0 {
		return nil
	}
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		return fmt.Errorf("bridge: sched_getaffinity: %w", err)
	}
	for _, c := range cpus {
		if c < 0 || c >= cpuSetSize || !allowed.IsSet(c) {
			return fmt.Errorf("bridge: CPU %d is not one this process may run on (allowed: %s)", c, cpuList(&allowed))
		}
	}
	return nil
}

// cpuSetSize is how many CPUs a unix.CPUSet holds.
const cpuSetSize = len(unix.CPUSet{}) * 64

// pinThread confines the calling (locked) thread to cpu.
func pinThread(cpu int) error {
	var set unix.CPUSet
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("pin the loop to CPU %d: %w", cpu, err)
	}
	return nil
}

// cpuList writes a CPU set the way the kernel's cpulist files do: 0-3,6.
func cpuList(set *unix.CPUSet) string {
	var parts []string
	for c := 0; c < cpuSetSize; c++ {
		if !set.IsSet(c) {
			continue
		}
		end := c
		for end+1 < cpuSetSize && set.IsSet(end+1) {
			end++
		}
		if end == c {
			parts = append(parts, strconv.Itoa(c))
		} else {
			parts = append(parts, strconv.Itoa(c)+"-"+strconv.Itoa(end))
		}
		c = end
	}
	return strings.Join(parts, ",")
}
