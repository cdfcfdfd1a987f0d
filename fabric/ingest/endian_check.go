//go:build armbe || arm64be || m68k || mips || mips64 || mips64p32 || ppc || ppc64 || s390 || s390x || shbe || sparc || sparc64

package ingest

// The region's layout is little-endian, read in place by C and CUDA
// consumers; a big-endian build would disagree with them, so it must not
// compile.
const ingestRequiresLittleEndian uint8 = -1
