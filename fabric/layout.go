package fabric

import (
	"errors"
	"fmt"
	"unsafe"
)

// Layout constants. They are the wire contract between the bridge and an
// application (see the package documentation); changing any of them means
// bumping Version so that mismatched peers refuse each other instead of
// misreading memory.
const (
	// Magic is the first word of a stream region: the bytes "FBST".
	Magic uint32 = 0x54534246
	// Version is the layout version this package writes and accepts.
	Version uint32 = 1

	headerLen = 128 // bytes of the region header
	ctlLen    = 384 // bytes of one ring control block (three 128-byte lines, the last reserved)
	slotHdr   = 8   // bytes of slot header: u32 length, u32 meta

	// Header field offsets.
	offMagic       = 0
	offVersion     = 4
	offHeaderLen   = 8
	offFlags       = 12
	offRegionLen   = 16
	offBridgeState = 24
	offAppState    = 28
	offRxDesc      = 32
	offTxDesc      = 64

	// Ring descriptor field offsets (relative to the descriptor).
	descCtl    = 0
	descSlots  = 8
	descCount  = 16
	descStride = 20

	// Ring control block offsets (relative to the block). Each group sits
	// on its own 128-byte line pair so that the producer's and consumer's
	// stores never share a cache line (nor an adjacent-line prefetch pair).
	//
	// Each armed flag lives on the line of the side that tests and clears
	// it after every batch, so a busy ring moves no extra cache line; the
	// sleeper writes it only when it is about to sleep.
	ctlProd      = 0   // producer line: write index
	ctlProdLazy  = 4   // producer line: producer's lazy copy of read index
	ctlDrops     = 8   // producer line: u64 packets dropped by producer
	ctlConsArmed = 16  // producer line: consumer sleeps, wants a signal on data
	ctlCons      = 128 // consumer line: read index
	ctlConsLazy  = 132 // consumer line: consumer's lazy copy of write index
	ctlProdArmed = 136 // consumer line: producer sleeps, wants a signal on space

	// Side states stored in the header.
	stateInit   = 0
	stateOpen   = 1
	stateClosed = 2

	pageSize = 4096

	// Limits that keep every computed offset far from overflow.
	minSlots  = 2
	maxSlots  = 1 << 20
	minStride = 64
	maxStride = 1 << 16
)

// Errors returned when a region cannot be attached.
var (
	ErrBadMagic   = errors.New("fabric: not a fabric stream region (bad magic)")
	ErrVersion    = errors.New("fabric: stream layout version mismatch")
	ErrBadLayout  = errors.New("fabric: malformed stream region layout")
	ErrBadConfig  = errors.New("fabric: invalid stream configuration")
	ErrTooBig     = errors.New("fabric: packet larger than slot payload")
	ErrBroken     = errors.New("fabric: stream broken")
	ErrClosed     = errors.New("fabric: stream closed")
	ErrTimeout    = errors.New("fabric: timeout")
	ErrPeerGone   = errors.New("fabric: peer gone")
	ErrCorruption = errors.New("fabric: peer corrupted shared ring state")
)

// Config sizes a stream. Zero fields take defaults.
type Config struct {
	// RxSlots and TxSlots are the ring depths (powers of two, 2..1<<20).
	// Default 1024.
	RxSlots, TxSlots int
	// SlotSize is the stride of one slot including its 8-byte header, a
	// multiple of 64 in 64..65536. Default 2048, which holds a 1500-byte
	// packet plus room for encapsulation.
	SlotSize int
}

func (c Config) withDefaults() Config {
	if c.RxSlots == 0 {
		c.RxSlots = 1024
	}
	if c.TxSlots == 0 {
		c.TxSlots = 1024
	}
	if c.SlotSize == 0 {
		c.SlotSize = 2048
	}
	return c
}

// ringDesc locates one ring inside a region.
type ringDesc struct {
	ctl, slots    uint64
	count, stride uint32
}

// layout is the validated shape of a whole region.
type layout struct {
	size   uint64
	rx, tx ringDesc
}

func isPow2(n uint64) bool { return n != 0 && n&(n-1) == 0 }

func checkRing(count, stride uint64) error {
	if count < minSlots || count > maxSlots || !isPow2(count) {
		return fmt.Errorf("%w: ring depth %d is not a power of two in [%d,%d]", ErrBadConfig, count, minSlots, maxSlots)
	}
	if stride < minStride || stride > maxStride || stride%64 != 0 {
		return fmt.Errorf("%w: slot size %d is not a multiple of 64 in [%d,%d]", ErrBadConfig, stride, minStride, maxStride)
	}
	return nil
}

// computeLayout places the header and both control blocks in the first
// page and the slot arrays page-aligned after it.
func computeLayout(c Config) (layout, error) {
	c = c.withDefaults()
	if c.RxSlots < 0 || c.TxSlots < 0 || c.SlotSize < 0 {
		return layout{}, fmt.Errorf("%w: negative size", ErrBadConfig)
	}
	if err := checkRing(uint64(c.RxSlots), uint64(c.SlotSize)); err != nil {
		return layout{}, err
	}
	if err := checkRing(uint64(c.TxSlots), uint64(c.SlotSize)); err != nil {
		return layout{}, err
	}
	var l layout
	l.rx = ringDesc{ctl: 128, slots: pageSize, count: uint32(c.RxSlots), stride: uint32(c.SlotSize)}
	l.tx = ringDesc{ctl: 512, count: uint32(c.TxSlots), stride: uint32(c.SlotSize)}
	l.tx.slots = l.rx.slots + uint64(l.rx.count)*uint64(l.rx.stride)
	end := l.tx.slots + uint64(l.tx.count)*uint64(l.tx.stride)
	l.size = (end + pageSize - 1) &^ (pageSize - 1)
	return l, nil
}

// Native little-endian accessors. The region is shared with a peer on the
// same host, so native order is the contract; fabric refuses to build on
// big-endian hosts (see endian_check.go) rather than silently differ.

func u32at(mem []byte, off uint64) *uint32 {
	_ = mem[off+3] // bounds check once, panics on programming errors only
	return (*uint32)(unsafe.Pointer(&mem[off]))
}

func u64at(mem []byte, off uint64) *uint64 {
	_ = mem[off+7]
	return (*uint64)(unsafe.Pointer(&mem[off]))
}

func writeDesc(mem []byte, off uint64, d ringDesc) {
	*u64at(mem, off+descCtl) = d.ctl
	*u64at(mem, off+descSlots) = d.slots
	*u32at(mem, off+descCount) = d.count
	*u32at(mem, off+descStride) = d.stride
}

func readDesc(mem []byte, off uint64) ringDesc {
	return ringDesc{
		ctl:    *u64at(mem, off+descCtl),
		slots:  *u64at(mem, off+descSlots),
		count:  *u32at(mem, off+descCount),
		stride: *u32at(mem, off+descStride),
	}
}

// writeHeader initialises a zeroed region. The magic is written last so a
// reader that sees it sees a complete header.
func writeHeader(mem []byte, l layout) {
	*u32at(mem, offVersion) = Version
	*u32at(mem, offHeaderLen) = headerLen
	*u32at(mem, offFlags) = 0
	*u64at(mem, offRegionLen) = l.size
	writeDesc(mem, offRxDesc, l.rx)
	writeDesc(mem, offTxDesc, l.tx)
	*u32at(mem, offMagic) = Magic
}

type span struct{ lo, hi uint64 }

func (a span) overlaps(b span) bool { return a.lo < b.hi && b.lo < a.hi }

// readHeader validates a region written by someone else. Every offset and
// size is checked against the actual mapping length, so whatever the
// header says, later accesses derived from it stay inside the mapping.
func readHeader(mem []byte) (layout, error) {
	n := uint64(len(mem))
	if n < headerLen {
		return layout{}, fmt.Errorf("%w: region of %d bytes is smaller than the header", ErrBadLayout, n)
	}
	if m := *u32at(mem, offMagic); m != Magic {
		return layout{}, fmt.Errorf("%w: got %#08x, want %#08x", ErrBadMagic, m, Magic)
	}
	if v := *u32at(mem, offVersion); v != Version {
		return layout{}, fmt.Errorf("%w: region has version %d, this build speaks version %d", ErrVersion, v, Version)
	}
	if h := *u32at(mem, offHeaderLen); h != headerLen {
		return layout{}, fmt.Errorf("%w: header length %d, want %d", ErrBadLayout, h, headerLen)
	}
	l := layout{size: *u64at(mem, offRegionLen), rx: readDesc(mem, offRxDesc), tx: readDesc(mem, offTxDesc)}
	if l.size != n {
		return layout{}, fmt.Errorf("%w: header says %d bytes, mapping has %d", ErrBadLayout, l.size, n)
	}
	spans := []span{{0, headerLen}}
	for _, d := range []ringDesc{l.rx, l.tx} {
		if err := checkRing(uint64(d.count), uint64(d.stride)); err != nil {
			return layout{}, fmt.Errorf("%w: %v", ErrBadLayout, err)
		}
		if d.ctl%128 != 0 || d.ctl > n || n-d.ctl < ctlLen {
			return layout{}, fmt.Errorf("%w: control block at %d out of bounds", ErrBadLayout, d.ctl)
		}
		slotsLen := uint64(d.count) * uint64(d.stride)
		if d.slots%64 != 0 || d.slots > n || n-d.slots < slotsLen {
			return layout{}, fmt.Errorf("%w: slots at %d+%d out of bounds", ErrBadLayout, d.slots, slotsLen)
		}
		spans = append(spans, span{d.ctl, d.ctl + ctlLen}, span{d.slots, d.slots + slotsLen})
	}
	for i := range spans {
		for j := i + 1; j < len(spans); j++ {
			if spans[i].overlaps(spans[j]) {
				return layout{}, fmt.Errorf("%w: areas [%d,%d) and [%d,%d) overlap", ErrBadLayout, spans[i].lo, spans[i].hi, spans[j].lo, spans[j].hi)
			}
		}
	}
	return l, nil
}
