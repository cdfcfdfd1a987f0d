package topology

import (
	"errors"
	"os"
	"path/filepath"
	"time"

	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// runDir is where named namespaces are bind-mounted (by ip(8) and by
// vishvananda/netns alike).
const runDir = "/run/netns"

// Sweep removes namespaces that this package created and a killed or crashed
// test binary could not clean up: entries in /run/netns named fb plus eight
// hex digits whose namespace is older than olderThan. Removing the mount lets
// the kernel free the namespace, and the veths inside go with it; nothing of
// ours ever lives in the host namespace, so there is nothing else to sweep.
//
// Age is taken from the namespace's nsfs inode, which the kernel stamps when
// the namespace is first opened by path, that is, at creation here. Choose
// olderThan longer than any test run: Sweep cannot tell a leftover from a
// namespace that a slow, still running test binary is using. It returns the
// names it removed.
func Sweep(olderThan time.Duration) ([]string, error) {
	return sweep(olderThan, isOurName)
}

// sweep is Sweep with the name filter exposed, so that its test can confine
// itself to a namespace it made and never touch those of other test binaries
// running at the same time.
func sweep(olderThan time.Duration, match func(string) bool) ([]string, error) {
	entries, err := os.ReadDir(runDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	cutoff := time.Now().Add(-olderThan)
	var removed []string
	var errs []error
	for _, e := range entries {
		name := e.Name()
		if !isOurName(name) || !match(name) {
			continue
		}
		path := filepath.Join(runDir, name)
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			errs = append(errs, err)
			continue
		}
		if !time.Unix(st.Ctim.Unix()).Before(cutoff) {
			continue
		}
		var fs unix.Statfs_t
		if err := unix.Statfs(path, &fs); err != nil {
			errs = append(errs, err)
			continue
		}
		if fs.Type == unix.NSFS_MAGIC {
			err = vnetns.DeleteNamed(name)
		} else {
			// Only the empty placeholder file: creation died before the
			// bind mount.
			err = os.Remove(path)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, name)
	}
	return removed, errors.Join(errs...)
}

// isOurName reports whether name has the exact shape New gives names, so
// that Sweep leaves alone anything else that happens to start with "fb".
func isOurName(name string) bool {
	if len(name) != len(namePrefix)+8 || name[:len(namePrefix)] != namePrefix {
		return false
	}
	for _, c := range name[len(namePrefix):] {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
