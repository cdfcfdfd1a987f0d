//go:build armbe || arm64be || m68k || mips || mips64 || mips64p32 || ppc || ppc64 || s390 || s390x || shbe || sparc || sparc64

package fabric

// The shared-memory layout is defined in little-endian native order. A
// big-endian build would silently disagree with its peers, so it must not
// compile at all.
const fabricRequiresLittleEndian uint8 = -1
