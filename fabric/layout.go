package fabric

import (
	"errors"
	"fmt"
	"unsafe"
)

// Layout constants. They are the wire contract between the bridge and an
// application (the protocol over them is in docs/fabric.md); changing any
// of them means bumping Version so that mismatched peers refuse each other
// instead of misreading memory.
//
// All integers are little-endian (the host's order; big-endian builds are
// refused at compile time), offsets are bytes from the start of the region.
// The bridge zeroes the region, writes the header and writes the magic
// last. A region is laid out as: the header at 0, RX's control block at
// 128, TX's at 512, the RX data area at 4096 and TX's right after it, the
// whole rounded up to a page (computeLayout); a reader takes the offsets
// from the ring descriptors, not from this placement.
const (
	// Magic is the first word of a stream region: the bytes "FBST".
	Magic uint32 = 0x54534246
	// Version is the layout version this package writes and accepts.
	Version uint32 = 2

	// Sizes. A record sits at an offset of the data area that is a multiple
	// of recAlign:
	//
	//	0  u32  len   payload bytes, at most max_record-8; or skipMark: a skip record
	//	4  u32  meta  producer-defined (the bridge: the classifier's rule id)
	//	8  len bytes of packet (an IP packet, from its IP header), then 0-7
	//	   bytes of padding: the record takes 8 + (len rounded up to 8) bytes
	//
	// A skip record (only its len word matters) stands for the bytes from
	// its offset to the end of the data area; the next record is at 0.
	headerLen = 128 // bytes of the region header
	ctlLen    = 384 // bytes of one ring control block (three 128-byte lines, the last reserved)
	recHdr    = 8   // bytes of record header: u32 length, u32 meta
	recAlign  = 8   // records start at multiples of 8 bytes
	skipMark  = ^uint32(0)

	// Header, at offset 0, headerLen bytes:
	//
	//	0   u32  magic         Magic
	//	4   u32  version       Version
	//	8   u32  header_len    128
	//	12  u32  flags         0
	//	16  u64  region_len    total bytes, = the memfd's size (a multiple of 4096)
	//	24  u32  bridge_state  stateInit, stateOpen, stateClosed (written by the bridge)
	//	28  u32  app_state     the same states (written by the application)
	//	32  ring descriptor of RX (bridge to application), 32 bytes
	//	64  ring descriptor of TX (application to bridge), 32 bytes
	//	96  32 bytes zero
	offMagic       = 0
	offVersion     = 4
	offHeaderLen   = 8
	offFlags       = 12
	offRegionLen   = 16
	offBridgeState = 24
	offAppState    = 28
	offRxDesc      = 32
	offTxDesc      = 64

	// Ring descriptor, 32 bytes, offsets relative to the descriptor:
	//
	//	0   u64  ctl_off     control block offset, a multiple of 128
	//	8   u64  data_off    data area offset, a multiple of 64
	//	16  u32  depth       largest records it always has room for; a power of two, 2..1<<20
	//	20  u32  max_record  largest record in bytes (largest packet: max_record-8),
	//	                     a multiple of 64 in 64..65536
	//	24  u32  data_len    data area bytes, exactly (depth+1) × max_record, at most 1<<30
	//	28  u32  reserved, 0
	descCtl     = 0
	descData    = 8
	descDepth   = 16
	descMaxRec  = 20
	descDataLen = 24

	// Ring control block, ctlLen bytes, offsets relative to the block.
	// Each group sits on its own 128-byte line pair so that the producer's
	// and consumer's stores never share a cache line (nor an adjacent-line
	// prefetch pair):
	//
	//	0    u32  write_pos       producer's byte position after its last published record
	//	4    u32  lazy_read_pos   producer's last-seen read_pos (informational)
	//	8    u64  drops           packets the producer dropped (informational)
	//	16   u32  cons_armed      1: the consumer sleeps, signal it on new data
	//	128  u32  read_pos        consumer's byte position after its last released record
	//	132  u32  read_count      records (not skip records) released so far; read_pos and
	//	                          read_count are one u64, accessed with single 64-bit atomics
	//	136  u32  lazy_write_pos  consumer's last-seen write_pos (informational)
	//	140  u32  prod_armed      1: the producer sleeps, signal it on free space
	//	256  128 bytes reserved, 0
	//
	// Each armed flag lives on the line of the side that tests and clears
	// it after every batch, so a busy ring moves no extra cache line; the
	// sleeper writes it only when it is about to sleep. The lazy words
	// mirror what each side last saw of the other; nobody reads them back.
	ctlProd      = 0   // producer line: write index
	ctlProdLazy  = 4   // producer line: producer's lazy copy of read index
	ctlDrops     = 8   // producer line: u64 packets dropped by producer
	ctlConsArmed = 16  // producer line: consumer sleeps, wants a signal on data
	ctlRead      = 128 // consumer line: u64 = read position | records consumed << 32
	ctlCons      = 128 // consumer line: read position (low half of ctlRead)
	ctlConsN     = 132 // consumer line: records consumed (high half of ctlRead)
	ctlConsLazy  = 136 // consumer line: consumer's lazy copy of write position
	ctlProdArmed = 140 // consumer line: producer sleeps, wants a signal on space

	// Side states stored in the header.
	stateInit   = 0
	stateOpen   = 1
	stateClosed = 2

	pageSize = 4096

	// Limits that keep every computed offset far from overflow and every
	// byte distance between two ring positions below 2^31, so that u32
	// modular arithmetic on free-running positions is exact.
	minSlots   = 2
	maxSlots   = 1 << 20
	minStride  = 64
	maxStride  = 1 << 16
	maxDataLen = MaxRingBytes
)

// MaxRingBytes bounds a ring's data area, RingBytes of its depth and slot
// size (see Config).
const MaxRingBytes = 1 << 30

// RingBytes is the data area a ring of slots packets of up to slotSize
// bytes each (record header included) needs: one record of the largest
// size more than slots of them, which is what guarantees room for a
// largest packet whenever fewer than slots packets are queued, whatever
// padding the no-wrap rule left at the end (the proof is in the package
// documentation). It must not exceed MaxRingBytes.
func RingBytes(slots, slotSize int) int64 { return (int64(slots) + 1) * int64(slotSize) }

// Errors returned when a region cannot be attached.
var (
	ErrBadMagic   = errors.New("fabric: not a fabric stream region (bad magic)")
	ErrVersion    = errors.New("fabric: stream layout version mismatch")
	ErrBadLayout  = errors.New("fabric: malformed stream region layout")
	ErrBadConfig  = errors.New("fabric: invalid stream configuration")
	ErrTooBig     = errors.New("fabric: packet larger than the stream's maximum payload")
	ErrBroken     = errors.New("fabric: stream broken")
	ErrClosed     = errors.New("fabric: stream closed")
	ErrTimeout    = errors.New("fabric: timeout")
	ErrPeerGone   = errors.New("fabric: peer gone")
	ErrCorruption = errors.New("fabric: peer corrupted shared ring state")
)

// Config sizes a stream. Zero fields take defaults.
//
// The rings hold variable-length records (see the layout constants) and
// are bounded by their bytes: a ring always has room for RxSlots
// (TxSlots) packets of the largest size, and holds as many smaller ones
// as its data area of (slots+1) × SlotSize bytes fits, at most 1 GiB.
type Config struct {
	// RxSlots and TxSlots are the ring depths in full-size packets
	// (powers of two, 2..1<<20). Default 1024.
	RxSlots, TxSlots int
	// SlotSize is the largest record including its 8-byte header, a
	// multiple of 64 in 64..65536: packets up to SlotSize-8 bytes fit.
	// Default 2048, which holds a 1500-byte packet plus room for
	// encapsulation.
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
	ctl, data              uint64
	depth, maxRec, dataLen uint32
}

// layout is the validated shape of a whole region.
type layout struct {
	size   uint64
	rx, tx ringDesc
}

func isPow2(n uint64) bool { return n != 0 && n&(n-1) == 0 }

// checkRing validates a depth and a largest record size and returns the
// size of the data area they need.
func checkRing(depth, maxRec uint64) (uint64, error) {
	if depth < minSlots || depth > maxSlots || !isPow2(depth) {
		return 0, fmt.Errorf("%w: ring depth %d is not a power of two in [%d,%d]", ErrBadConfig, depth, minSlots, maxSlots)
	}
	if maxRec < minStride || maxRec > maxStride || maxRec%64 != 0 {
		return 0, fmt.Errorf("%w: slot size %d is not a multiple of 64 in [%d,%d]", ErrBadConfig, maxRec, minStride, maxStride)
	}
	n := uint64(RingBytes(int(depth), int(maxRec))) // both validated: no overflow
	if n > maxDataLen {
		return 0, fmt.Errorf("%w: %d slots of %d bytes need a ring of %d bytes, more than %d", ErrBadConfig, depth, maxRec, n, maxDataLen)
	}
	return n, nil
}

// computeLayout places the header and both control blocks in the first
// page, the RX data area at the second page and the TX data area right
// after it (64-byte aligned, as every data length is a multiple of 64).
func computeLayout(c Config) (layout, error) {
	c = c.withDefaults()
	if c.RxSlots < 0 || c.TxSlots < 0 || c.SlotSize < 0 {
		return layout{}, fmt.Errorf("%w: negative size", ErrBadConfig)
	}
	rxLen, err := checkRing(uint64(c.RxSlots), uint64(c.SlotSize))
	if err != nil {
		return layout{}, err
	}
	txLen, err := checkRing(uint64(c.TxSlots), uint64(c.SlotSize))
	if err != nil {
		return layout{}, err
	}
	var l layout
	l.rx = ringDesc{ctl: 128, data: pageSize, depth: uint32(c.RxSlots), maxRec: uint32(c.SlotSize), dataLen: uint32(rxLen)}
	l.tx = ringDesc{ctl: 512, data: pageSize + rxLen, depth: uint32(c.TxSlots), maxRec: uint32(c.SlotSize), dataLen: uint32(txLen)}
	end := l.tx.data + txLen
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
	*u64at(mem, off+descData) = d.data
	*u32at(mem, off+descDepth) = d.depth
	*u32at(mem, off+descMaxRec) = d.maxRec
	*u32at(mem, off+descDataLen) = d.dataLen
}

func readDesc(mem []byte, off uint64) ringDesc {
	return ringDesc{
		ctl:     *u64at(mem, off+descCtl),
		data:    *u64at(mem, off+descData),
		depth:   *u32at(mem, off+descDepth),
		maxRec:  *u32at(mem, off+descMaxRec),
		dataLen: *u32at(mem, off+descDataLen),
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

// versionHint names what an older peer speaks, so that the error says
// which side needs upgrading rather than only that two numbers differ.
func versionHint(v uint32) string {
	if v == 1 {
		return " (version 1 is the fixed-slot ring layout; version 2 carries variable-length records: rebuild the peer against this fabric)"
	}
	return ""
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
		return layout{}, fmt.Errorf("%w: region has version %d, this build speaks version %d%s", ErrVersion, v, Version, versionHint(v))
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
		want, err := checkRing(uint64(d.depth), uint64(d.maxRec))
		if err != nil {
			return layout{}, fmt.Errorf("%w: %v", ErrBadLayout, err)
		}
		if uint64(d.dataLen) != want {
			return layout{}, fmt.Errorf("%w: data length %d, want (depth+1)*max_record = %d", ErrBadLayout, d.dataLen, want)
		}
		if d.ctl%128 != 0 || d.ctl > n || n-d.ctl < ctlLen {
			return layout{}, fmt.Errorf("%w: control block at %d out of bounds", ErrBadLayout, d.ctl)
		}
		if d.data%64 != 0 || d.data > n || n-d.data < want {
			return layout{}, fmt.Errorf("%w: data area at %d+%d out of bounds", ErrBadLayout, d.data, want)
		}
		spans = append(spans, span{d.ctl, d.ctl + ctlLen}, span{d.data, d.data + want})
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
