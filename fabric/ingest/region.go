package ingest

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/pages"
)

// region is a mapped, sealed memfd.
type region struct {
	fd  int
	mem []byte
	// lockErr says why the region is not locked in memory, if it is not.
	// An unlocked region still works, only exposed to page faults and
	// swapping, so it is a warning in the stats, not an error.
	lockErr error
}

// newRegion creates the memfd for c, on hugetlb pages unless NoHugepages or
// the kernel has none to give, seals its size, maps it populated, locks it
// and writes the header. It returns the layout it used (hugetlb rounds the
// size up).
func newRegion(c Config, name string) (*region, layout, error) {
	if !c.NoHugepages {
		l := computeLayout(c, true)
		if r, err := mapNew(l, name, unix.MFD_HUGETLB); err == nil {
			r.lock(&l)
			writeHeader(r.mem, l)
			return r, l, nil
		}
	}
	l := computeLayout(c, false)
	r, err := mapNew(l, name, 0)
	if err != nil {
		return nil, l, err
	}
	// Transparent huge pages for shmem, where the system allows them.
	_ = unix.Madvise(r.mem, unix.MADV_HUGEPAGE)
	r.lock(&l)
	writeHeader(r.mem, l)
	return r, l, nil
}

func mapNew(l layout, name string, flags int) (*region, error) {
	fd, err := unix.MemfdCreate("fabricbridge-ingest-"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|flags)
	if err != nil {
		return nil, fmt.Errorf("ingest: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(l.size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ingest: ftruncate %d: %w", l.size, err)
	}
	// Sealed, the consumer cannot shrink the file under the producer's
	// mapping and kill it with SIGBUS.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ingest: sealing memfd: %w", err)
	}
	// MAP_POPULATE faults every page in now (and, for hugetlb, fails here
	// rather than with SIGBUS later when the pool is short).
	mem, err := unix.Mmap(fd, 0, int(l.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ingest: mmap %d bytes: %w", l.size, err)
	}
	pages.MapWritable(mem)
	// Write every page once, now. The memfd is new and all zeros, so
	// this changes nothing; but a page's first write costs far more than
	// later ones where the hypervisor backs guest memory lazily, and it
	// would otherwise fall on the data path: on this project's VM the
	// first pass over a ring of 256 × 256 KiB cost 13–20 times a later
	// one (170–235 ns against 12 ns per 64-byte append) with no fault the
	// guest could see (TestFirstPassCostsNoMore). Creating such a ring
	// takes about 0.2 s longer instead.
	pages.WriteZero(mem)
	return &region{fd: fd, mem: mem}, nil
}

func (r *region) lock(l *layout) {
	if err := unix.Mlock(r.mem); err != nil {
		r.lockErr = fmt.Errorf("ingest: mlock %d bytes: %w", len(r.mem), err)
		return
	}
	l.flags |= FlagLocked
}

// attachRegion maps a region received from a producer after checking that
// the memfd is sealed against shrinking and its size is the announced one.
func attachRegion(fd int, size uint64) (*region, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: F_GET_SEALS: %v", ErrBadLayout, err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("%w: region memfd is not sealed against shrinking", ErrBadLayout)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("ingest: fstat: %w", err)
	}
	if uint64(st.Size) != size || size < headerLen || size > maxRegionBytes {
		return nil, fmt.Errorf("%w: memfd holds %d bytes, producer announced %d", ErrBadLayout, st.Size, size)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("ingest: mmap: %w", err)
	}
	pages.MapWritable(mem)
	// Best effort: the consumer's view locked too.
	_ = unix.Mlock(mem)
	return &region{fd: fd, mem: mem}, nil
}

func (r *region) close() error {
	err := unix.Munmap(r.mem)
	r.mem = nil
	if cerr := unix.Close(r.fd); err == nil {
		err = cerr
	}
	return err
}

// DefaultDir is where named rings put their sockets unless FB_INGEST_DIR
// says otherwise.
const DefaultDir = "/run/fabricbridge/ingest"

// Dir is the directory of named rings' sockets: $FB_INGEST_DIR, or
// DefaultDir.
func Dir() string {
	if d := os.Getenv("FB_INGEST_DIR"); d != "" {
		return d
	}
	return DefaultDir
}

var plainName = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// socketPath turns a ring name into its socket's path: a name with a slash
// is the path itself, a plain name lives in Dir().
func socketPath(name string) (string, error) {
	if strings.ContainsRune(name, '/') {
		if len(name) > 100 { // sun_path is 108 bytes
			return "", fmt.Errorf("socket path %q longer than 100 bytes", name)
		}
		return name, nil
	}
	if !plainName.MatchString(name) || name == "." || name == ".." {
		return "", fmt.Errorf("ring name %q: want 1-64 of [A-Za-z0-9._-], or a socket path", name)
	}
	return filepath.Join(Dir(), name+".sock"), nil
}
