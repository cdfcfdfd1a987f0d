package topology

import (
	"os"
	"syscall"
)

// inodeOf returns the inode number behind st; for a namespace it is the
// number in "net:[N]".
func inodeOf(st os.FileInfo) uint64 {
	return st.Sys().(*syscall.Stat_t).Ino
}
