package ingest

import (
	"sync/atomic"
	"unsafe"
)

// Shared words are accessed only through these, at offsets that readHeader
// and the layout keep aligned and inside the mapping. Go's sync/atomic is
// sequentially consistent, which the tripwire needs (see Consumer.Next).

func word32(mem []byte, off uint64) *uint32 {
	_ = mem[off+3]
	return (*uint32)(unsafe.Pointer(&mem[off]))
}

func word64(mem []byte, off uint64) *uint64 {
	_ = mem[off+7]
	return (*uint64)(unsafe.Pointer(&mem[off]))
}

func loadU32(mem []byte, off uint64) uint32     { return atomic.LoadUint32(word32(mem, off)) }
func storeU32(mem []byte, off uint64, v uint32) { atomic.StoreUint32(word32(mem, off), v) }
func loadU64(mem []byte, off uint64) uint64     { return atomic.LoadUint64(word64(mem, off)) }
func storeU64(mem []byte, off uint64, v uint64) { atomic.StoreUint64(word64(mem, off), v) }
