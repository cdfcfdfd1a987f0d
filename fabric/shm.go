package fabric

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/pages"
)

// helloLen is the size of the handshake messages on the Unix socket:
//
//	0   u32  magic              Magic
//	4   u32  version            Version
//	8   u32  descriptor count   4 (0 in the application's reply)
//	12  u32  reserved, 0
//	16  u64  region length      bytes of the memfd (0 in the application's reply)
//
// The bridge's message carries, as SCM_RIGHTS and in this order, the
// region's memfd, the RX-data eventfd (the bridge signals, the application
// sleeps), the TX-data eventfd (the application signals, the bridge
// sleeps) and the TX-space eventfd (the bridge signals, the application
// sleeps for room). A signal is a write of the 8-byte value 1.
const helloLen = 24

// handshakeTimeout bounds how long either side waits for the other's
// handshake message, so a silent peer cannot hang the bridge's accept loop.
var handshakeTimeout = 5 * time.Second

// NewShm creates the bridge side of a stream: a sealed memfd holding the
// region, and three eventfds. Hand it to an application with Handover.
func NewShm(cfg Config) (*BridgeStream, error) {
	l, err := computeLayout(cfg)
	if err != nil {
		return nil, err
	}
	fd, err := unix.MemfdCreate("fabric-stream", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("fabric: memfd_create: %w", err)
	}
	fail := func(err error) (*BridgeStream, error) {
		unix.Close(fd)
		return nil, err
	}
	if err := unix.Ftruncate(fd, int64(l.size)); err != nil {
		return fail(fmt.Errorf("fabric: ftruncate: %w", err))
	}
	// Sealing the size means a hostile application cannot truncate the
	// file under our mapping and make the bridge die of SIGBUS.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail(fmt.Errorf("fabric: sealing memfd: %w", err))
	}
	mem, err := unix.Mmap(fd, 0, int(l.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fail(fmt.Errorf("fabric: mmap: %w", err))
	}
	// Both sides write every page of their mapping once, now: on this
	// project's VM the first pass of 1500-byte packets through a new stream
	// cost 3–13 µs a packet against 0.2 µs later (package pages,
	// TestFirstPassCostsNoMore). A side's share is about 5–10 ms for the
	// default 4 MiB region.
	pages.MapWritable(mem)
	pages.WriteZero(mem) // the fresh region is all zeros
	writeHeader(mem, l)
	fds := make([]int, 3)
	for i := range fds {
		if fds[i], err = newEventfd(); err != nil {
			for _, f := range fds[:i] {
				unix.Close(f)
			}
			unix.Munmap(mem)
			return fail(fmt.Errorf("fabric: eventfd: %w", err))
		}
	}
	s := &BridgeStream{}
	newEnd(&s.end, true, mem, l, fds)
	s.memfd = fd
	return s, nil
}

func putHello(b []byte, nfds uint32, size uint64) {
	binary.LittleEndian.PutUint32(b[0:], Magic)
	binary.LittleEndian.PutUint32(b[4:], Version)
	binary.LittleEndian.PutUint32(b[8:], nfds)
	binary.LittleEndian.PutUint32(b[12:], 0)
	binary.LittleEndian.PutUint64(b[16:], size)
}

func checkHello(b []byte, who string) error {
	if m := binary.LittleEndian.Uint32(b[0:]); m != Magic {
		return fmt.Errorf("%w: %s handshake magic %#08x", ErrBadMagic, who, m)
	}
	if v := binary.LittleEndian.Uint32(b[4:]); v != Version {
		return fmt.Errorf("%w: %s speaks version %d, this build speaks version %d%s", ErrVersion, who, v, Version, versionHint(v))
	}
	return nil
}

// Handover sends the region and eventfds to the application at the other
// end of conn (SCM_RIGHTS), waits for its acknowledgement, and from then
// on watches conn: when it closes, the application is gone and the stream
// becomes Broken. The stream owns conn afterwards.
func (s *BridgeStream) Handover(conn *net.UnixConn) error {
	if s.memfd < 0 {
		return errors.New("fabric: Handover needs a fresh stream from NewShm")
	}
	var hello [helloLen]byte
	putHello(hello[:], 4, uint64(len(s.mem)))
	rights := unix.UnixRights(s.memfd, s.fds[0], s.fds[1], s.fds[2])
	conn.SetDeadline(time.Now().Add(handshakeTimeout))
	if _, _, err := conn.WriteMsgUnix(hello[:], rights, nil); err != nil {
		return fmt.Errorf("fabric: sending stream to application: %w", err)
	}
	var ack [helloLen]byte
	if _, err := readFull(conn, ack[:]); err != nil {
		return fmt.Errorf("fabric: waiting for application's acknowledgement: %w", err)
	}
	if err := checkHello(ack[:], "application"); err != nil {
		return err
	}
	conn.SetDeadline(time.Time{})
	unix.Close(s.memfd)
	s.memfd = -1
	s.monitor(conn)
	return nil
}

func readFull(conn *net.UnixConn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		k, err := conn.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// monitor watches the control connection: EOF or an error means the peer
// process is gone (a crash closes its sockets too), so the stream breaks
// and every waiter of ours wakes up.
func (s *end) monitor(conn *net.UnixConn) {
	s.conn = conn
	s.monDone = make(chan struct{})
	go func() {
		defer close(s.monDone)
		var b [64]byte
		for {
			if _, err := conn.Read(b[:]); err != nil {
				if !s.closed.Load() {
					s.peerGone.Store(true)
					for _, fd := range s.fds {
						eventfdSignal(fd)
					}
				}
				return
			}
		}
	}()
}

// AttachShm is the application side of Handover: it receives the region
// and eventfds over conn, validates them (sealed size, layout, version),
// maps the region and acknowledges. It needs no privileges. The stream
// owns conn afterwards; closing conn (or the process dying) tells the
// bridge the application is gone.
func AttachShm(conn *net.UnixConn) (*Stream, error) {
	conn.SetDeadline(time.Now().Add(handshakeTimeout))
	var hello [helloLen]byte
	oob := make([]byte, unix.CmsgSpace(8*4))
	n, oobn, flags, _, err := conn.ReadMsgUnix(hello[:], oob)
	if err != nil {
		return nil, fmt.Errorf("fabric: receiving stream: %w", err)
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err == nil {
			for i := range msgs {
				if f, err := unix.ParseUnixRights(&msgs[i]); err == nil {
					fds = append(fds, f...)
				}
			}
		}
	}
	closeAll := func() {
		for _, f := range fds {
			unix.Close(f)
		}
	}
	var reply [helloLen]byte
	putHello(reply[:], 0, 0)
	if n < helloLen {
		closeAll()
		return nil, fmt.Errorf("%w: short handshake (%d bytes)", ErrBadLayout, n)
	}
	if err := checkHello(hello[:], "bridge"); err != nil {
		closeAll()
		conn.Write(reply[:]) // let the bridge report the mismatch too
		return nil, err
	}
	if flags&unix.MSG_CTRUNC != 0 || len(fds) != 4 {
		closeAll()
		return nil, fmt.Errorf("%w: expected 4 descriptors, got %d (truncated=%v)", ErrBadLayout, len(fds), flags&unix.MSG_CTRUNC != 0)
	}
	size := binary.LittleEndian.Uint64(hello[16:])
	var st unix.Stat_t
	if err := unix.Fstat(fds[0], &st); err != nil {
		closeAll()
		return nil, fmt.Errorf("fabric: fstat region: %w", err)
	}
	seals, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		closeAll()
		return nil, fmt.Errorf("%w: region is not sealed against shrinking", ErrBadLayout)
	}
	if uint64(st.Size) != size || size < pageSize || size > 1<<34 {
		closeAll()
		return nil, fmt.Errorf("%w: region size %d, handshake says %d", ErrBadLayout, st.Size, size)
	}
	mem, err := unix.Mmap(fds[0], 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("fabric: mmap region: %w", err)
	}
	l, err := readHeader(mem)
	if err != nil {
		unix.Munmap(mem)
		closeAll()
		return nil, err
	}
	pages.MapWritable(mem)
	pages.AddZero(mem) // the creator may be writing already
	if _, err := conn.Write(reply[:]); err != nil {
		unix.Munmap(mem)
		closeAll()
		return nil, fmt.Errorf("fabric: acknowledging stream: %w", err)
	}
	conn.SetDeadline(time.Time{})
	unix.Close(fds[0])
	s := &Stream{}
	newEnd(&s.end, false, mem, l, fds[1:4:4])
	s.monitor(conn)
	return s, nil
}

// NewPair returns both ends of a stream in this process, connected through
// the real shm handover over a socketpair. Tests and benchmarks use it; the
// app end has its own mapping, exactly as a separate process would.
func NewPair(cfg Config) (bridge *BridgeStream, app *Stream, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	ca, err := fileConn(fds[0])
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	cb, err := fileConn(fds[1])
	if err != nil {
		ca.Close()
		return nil, nil, err
	}
	bridge, err = NewShm(cfg)
	if err != nil {
		ca.Close()
		cb.Close()
		return nil, nil, err
	}
	errc := make(chan error, 1)
	go func() { errc <- bridge.Handover(ca) }()
	app, err = AttachShm(cb)
	herr := <-errc
	if err == nil {
		err = herr
	}
	if err != nil {
		ca.Close()
		cb.Close()
		bridge.Close()
		if app != nil {
			app.Close()
		}
		return nil, nil, err
	}
	return bridge, app, nil
}

func fileConn(fd int) (*net.UnixConn, error) {
	f := os.NewFile(uintptr(fd), "fabric-socketpair")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return nil, errors.New("fabric: not a unix socket")
	}
	return uc, nil
}

// newRingPair returns the two ends of one ring in private memory, for use
// inside a single process (the remote transport's receive queue, tests).
// The semantics are exactly those of a shared ring.
func newRingPair(depth, slotSize int) (*producer, *consumer, error) {
	l, err := computeLayout(Config{RxSlots: depth, TxSlots: 2, SlotSize: slotSize})
	if err != nil {
		return nil, nil, err
	}
	words := make([]uint64, l.size/8) // 8-byte aligned for the atomics
	mem := unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), l.size)
	writeHeader(mem, l)
	v := newRingView(mem, l.rx)
	return &producer{v: v, wake: signaller{fd: -1}}, &consumer{v: v, wake: signaller{fd: -1}}, nil
}
