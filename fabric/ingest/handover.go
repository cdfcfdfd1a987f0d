package ingest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// HandshakeTimeout bounds each side's wait for the other's handshake, so a
// silent peer cannot hang either.
var HandshakeTimeout = 5 * time.Second

// The handshake message, both ways: u32 magic, u32 version, u32 number of
// descriptors, u32 status, u64 region length, u64 reserved.
const (
	helloLen   = 32
	statusOK   = 0
	statusBusy = 1
	helloFDs   = 2 // the region memfd, the consumer's wake-up eventfd
)

func putHello(b []byte, nfds, status uint32, size uint64) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], Magic)
	le.PutUint32(b[4:], Version)
	le.PutUint32(b[8:], nfds)
	le.PutUint32(b[12:], status)
	le.PutUint64(b[16:], size)
	le.PutUint64(b[24:], 0)
}

func checkHello(b []byte, who string) error {
	le := binary.LittleEndian
	if m := le.Uint32(b[0:]); m != Magic {
		return fmt.Errorf("%w: %s handshake magic %#08x", ErrBadMagic, who, m)
	}
	if v := le.Uint32(b[4:]); v != Version {
		return fmt.Errorf("%w: %s speaks version %d, this build %d", ErrVersion, who, v, Version)
	}
	return nil
}

// server hands the region to one consumer at a time and watches it: when
// its connection closes, the consumer is gone and another may attach.
type server struct {
	ln   *net.UnixListener
	r    *Ring
	wg   sync.WaitGroup
	mu   sync.Mutex
	conn *net.UnixConn // the consumer attached or attaching
	// ready is set once the consumer acknowledged, which it does after it
	// has chosen its first buffer: from then on every publish is its.
	ready bool
	done  bool
}

func serve(path string, r *Ring) (*server, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("ingest: %w", err)
	}
	if _, err := os.Lstat(path); err == nil {
		// A live producer answers; a dead one left its socket behind.
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("ingest: ring %q is already served at %s", r.name, path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("ingest: removing stale socket: %w", err)
		}
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("ingest: listen: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	s := &server{ln: ln, r: r}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func (s *server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			return
		}
		s.wg.Add(1)
		go s.handle(c)
	}
}

func (s *server) handle(c *net.UnixConn) {
	defer s.wg.Done()
	defer c.Close()
	s.mu.Lock()
	busy := s.conn != nil || s.done
	if !busy {
		s.conn = c
	}
	s.mu.Unlock()
	var hello [helloLen]byte
	c.SetDeadline(time.Now().Add(HandshakeTimeout))
	if busy {
		putHello(hello[:], 0, statusBusy, 0)
		c.Write(hello[:])
		return
	}
	defer s.detach(c)
	putHello(hello[:], helloFDs, statusOK, uint64(len(s.r.reg.mem)))
	if _, _, err := c.WriteMsgUnix(hello[:], unix.UnixRights(s.r.reg.fd, s.r.evfd), nil); err != nil {
		return
	}
	if _, err := io.ReadFull(c, hello[:]); err != nil || checkHello(hello[:], "consumer") != nil {
		return
	}
	c.SetDeadline(time.Time{})
	s.mu.Lock()
	s.ready = true
	s.mu.Unlock()
	// The consumer sends nothing more; a read returns when it goes.
	var b [64]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			return
		}
	}
}

func (s *server) detach(c *net.UnixConn) {
	s.mu.Lock()
	if s.conn == c {
		s.conn, s.ready = nil, false
	}
	s.mu.Unlock()
}

func (s *server) attached() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ready
}

// close stops accepting, disconnects the consumer and waits for the
// handshake goroutines, which use the region's descriptors.
func (s *server) close() error {
	err := s.ln.Close()
	s.mu.Lock()
	s.done = true
	if s.conn != nil {
		s.conn.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// dial connects to the ring's producer and receives its descriptors.
func dial(path string) (*net.UnixConn, int, int, uint64, error) {
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, -1, -1, 0, fmt.Errorf("ingest: %w", err)
	}
	var fds []int
	fail := func(err error) (*net.UnixConn, int, int, uint64, error) {
		conn.Close()
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, -1, -1, 0, err
	}
	conn.SetDeadline(time.Now().Add(HandshakeTimeout))
	var hello [helloLen]byte
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := conn.ReadMsgUnix(hello[:], oob)
	if err != nil {
		return fail(fmt.Errorf("ingest: handshake: %w", err))
	}
	// Take ownership of whatever descriptors came, before any check.
	if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
		for _, m := range msgs {
			if got, rerr := unix.ParseUnixRights(&m); rerr == nil {
				fds = append(fds, got...)
			}
		}
	}
	if n < helloLen {
		if _, err := io.ReadFull(conn, hello[n:]); err != nil {
			return fail(fmt.Errorf("ingest: handshake: %w", err))
		}
	}
	if err := checkHello(hello[:], "producer"); err != nil {
		return fail(err)
	}
	le := binary.LittleEndian
	if le.Uint32(hello[12:]) == statusBusy {
		return fail(ErrBusy)
	}
	if le.Uint32(hello[8:]) != helloFDs || len(fds) != helloFDs {
		return fail(fmt.Errorf("%w: handshake carried %d descriptors, want %d", ErrBadLayout, len(fds), helloFDs))
	}
	return conn, fds[0], fds[1], le.Uint64(hello[16:]), nil
}

func ack(conn *net.UnixConn) error {
	var hello [helloLen]byte
	putHello(hello[:], 0, statusOK, 0)
	_, err := conn.Write(hello[:])
	return err
}
