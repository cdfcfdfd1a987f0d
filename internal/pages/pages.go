// Package pages makes the first accesses to a new mapping happen when it is
// created rather than on the data path.
//
// Where a hypervisor backs guest memory lazily and shadows each mapping's
// page tables (this project's VM), the first access to a page through a new
// mapping costs microseconds that the guest never sees as a fault, and
// MAP_POPULATE does not spare it. Rings, UMEMs and stream regions therefore
// touch every page once when they are made; each caller's test
// (TestFirstPassCostsNoMore and its siblings) fails without it.
package pages

import (
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

var size = os.Getpagesize()

// WriteZero writes a zero byte at the start of every page of mem: for new
// memory that is all zeros and that nobody else writes yet.
func WriteZero(mem []byte) {
	for off := 0; off < len(mem); off += size {
		mem[off] = 0
	}
}

// AddZero adds zero atomically to the first word of every page of mem:
// a write that leaves a word another process or the kernel may be writing
// as it is.
func AddZero(mem []byte) {
	for off := 0; off+8 <= len(mem); off += size {
		atomic.AddUint64((*uint64)(unsafe.Pointer(&mem[off])), 0)
	}
}

// MapWritable maps every page of a shared mapping writable now, without
// changing its contents (MAP_POPULATE and mlock map a shared mapping for
// reading only, so each page's first write would still fault).
// MADV_POPULATE_WRITE is Linux 5.14; older kernels refuse it and nothing
// changes.
func MapWritable(mem []byte) { _ = unix.Madvise(mem, unix.MADV_POPULATE_WRITE) }
