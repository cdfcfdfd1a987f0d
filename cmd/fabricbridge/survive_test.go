package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// restartMetrics is the daemon's metrics address, inside its namespace.
const restartMetrics = "127.0.0.1:9470"

// restartRig is `fabricbridge run` in a bridge namespace, which a test
// stops and starts again under applications that keep running.
type restartRig struct {
	bridge, outside *topology.NS
	v               *topology.Veth
	path, sock      string
	bpffs           string // where the daemons pin their data path
	d               *daemonProc
	t               *testing.T // the daemons' owner, whose end stops the last
}

func newRestartRig(t *testing.T) *restartRig {
	t.Helper()
	testenv.RequirePrivileged(t)
	// The daemons pin their data path in a bpf file system of the test's,
	// as on a host with /sys/fs/bpf: while one is away steered packets are
	// dropped, not passed to the kernel, which would reset their
	// connections (docs/restart.md). Without it a client that sent
	// anything into the gap (a window update) lost its download: once in
	// CI.
	r := &restartRig{t: t, bpffs: testenv.BPFFS(t)}
	r.bridge, r.outside, r.v = topology.Pair(t, topology.VethOptions{})
	if err := ethtool.DisableTxChecksum(r.outside, r.v.B.Name); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r.path, r.sock = filepath.Join(dir, "fb.yaml"), filepath.Join(dir, "control.sock")
	cfg := fmt.Sprintf("interfaces: [{name: %s}]\naddresses: [%s]\ncontrol: {socket: %s}\nmetrics: {address: %q}\n",
		r.v.A.Name, r.v.A.Addr4.Addr(), r.sock, restartMetrics)
	if err := os.WriteFile(r.path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	r.start(t)
	return r
}

// start runs the daemon and returns when its control socket answers.
func (r *restartRig) start(t *testing.T) time.Time {
	t.Helper()
	r.d = startDaemon(r.t, r.bridge, "run", "--config", r.path, "--bpffs", r.bpffs)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(time.Millisecond) {
		if c, err := net.Dial("unix", r.sock); err == nil {
			c.Close()
			return time.Now()
		}
		if time.Now().After(deadline) {
			t.Fatalf("the daemon's control socket never answered:\n%s", r.d.out.String())
		}
	}
}

func (r *restartRig) addr(port uint16) netip.AddrPort {
	return netip.AddrPortFrom(r.v.A.Addr4.Addr(), port)
}

// dial opens a kernel TCP connection from the outside host.
func (r *restartRig) dial(to netip.AddrPort, timeout time.Duration) (c net.Conn, err error) {
	err = r.outside.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", to.String(), timeout)
		return err
	})
	return c, err
}

// patternAt is the byte at offset i of what the pattern server sends: a
// stream in which a lost, repeated or misplaced segment shows.
func patternAt(i int) byte {
	var w [8]byte
	binary.LittleEndian.PutUint64(w[:], uint64(i/8)*0x9e3779b97f4a7c15)
	return w[i%8]
}

// servePattern sends size bytes of the pattern to every connection, at
// rate bytes a second.
func servePattern(l net.Listener, size, rate int) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			buf := make([]byte, 64<<10)
			start := time.Now()
			for off := 0; off < size; {
				n := min(len(buf), size-off)
				for i := range n {
					buf[i] = patternAt(off + i)
				}
				if _, err := c.Write(buf[:n]); err != nil {
					return
				}
				off += n
				time.Sleep(time.Duration(float64(off)/float64(rate)*float64(time.Second)) - time.Since(start))
			}
		}()
	}
}

// download reads a transfer to its end, checking every byte, with progress
// a test can wait on.
type download struct {
	mu   sync.Mutex
	got  int
	err  error
	done chan struct{}
}

func (d *download) progress() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.got
}

// readChecked reads r to its end as fast as it can, as a client saving a
// download does, checking each byte with want. (A reader slower than the
// sender opens its window while the daemon is away; see the report at the
// end of TestApplicationsSurviveDaemonRestarts.)
func readChecked(r io.Reader, want func(i int) byte) *download {
	d := &download{done: make(chan struct{})}
	go func() {
		defer close(d.done)
		buf := make([]byte, 64<<10)
		for {
			n, err := r.Read(buf)
			d.mu.Lock()
			for i, b := range buf[:n] {
				if b != want(d.got+i) && d.err == nil {
					d.err = fmt.Errorf("byte %d is %#x, not %#x", d.got+i, b, want(d.got+i))
				}
			}
			d.got += n
			if err != nil && !errors.Is(err, io.EOF) && d.err == nil {
				d.err = err
			}
			d.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return d
}

// udpProbe sends a numbered datagram to an echo server every interval and
// notes which came back.
type udpProbe struct {
	interval time.Duration
	mu       sync.Mutex
	sentAt   []time.Time
	back     map[int]bool
	stop     chan struct{}
	done     sync.WaitGroup
}

func startUDPProbe(t *testing.T, ns *topology.NS, to netip.AddrPort, interval time.Duration) *udpProbe {
	t.Helper()
	var c *net.UDPConn
	if err := ns.Do(func() (err error) {
		c, err = net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	p := &udpProbe{interval: interval, back: map[int]bool{}, stop: make(chan struct{})}
	p.done.Add(2)
	go func() {
		defer p.done.Done()
		buf := make([]byte, 64)
		for {
			n, err := c.Read(buf)
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if n == 8 {
				p.mu.Lock()
				p.back[int(binary.BigEndian.Uint64(buf))] = true
				p.mu.Unlock()
			}
		}
	}()
	go func() {
		defer p.done.Done()
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-p.stop:
				time.Sleep(100 * time.Millisecond) // the last echoes
				c.Close()
				return
			case <-tick.C:
			}
			p.mu.Lock()
			seq := len(p.sentAt)
			p.sentAt = append(p.sentAt, time.Now())
			p.mu.Unlock()
			c.Write(binary.BigEndian.AppendUint64(nil, uint64(seq)))
		}
	}()
	return p
}

// finish stops the probe and returns the longest time between sending two
// datagrams that came back with none between them that did, and how many
// were lost in all.
func (p *udpProbe) finish() (window time.Duration, lost, sent int) {
	close(p.stop)
	p.done.Wait()
	last := -1
	for seq := range p.sentAt {
		if !p.back[seq] {
			lost++
			continue
		}
		if last >= 0 {
			window = max(window, p.sentAt[seq].Sub(p.sentAt[last]))
		}
		last = seq
	}
	return window, lost, len(p.sentAt)
}

// TestApplicationsSurviveDaemonRestarts stops the daemon (SIGTERM, then
// kill -9) and starts it again under running applications: downloads from
// `app http` and from a stack serving a pattern continue byte-exact, new
// connections are served within a second of the daemon being back, and
// the application logs the bridge going and coming. It reports how long
// packets to applications were lost.
func TestApplicationsSurviveDaemonRestarts(t *testing.T) {
	if raceEnabled {
		t.Skip("times downloads across daemon restarts: run without -race (CI's first pass does)")
	}
	r := newRestartRig(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// FB_RESTART_MIB sizes the download from app http (default 128 MiB,
	// 4 s at the rate; issue 16 asks for 1 GiB: FB_RESTART_MIB=1024).
	httpSize := envInt("FB_RESTART_MIB", 128) << 20
	const (
		patternSize = 64 << 20
		rate        = 32 << 20 // bytes a second
	)
	httpLog := runApp(t, ctx, "http", "--control", r.sock, "--listen", ":80", "--rate", fmt.Sprint(rate*8/1e6))
	runApp(t, ctx, "echo", "--control", r.sock, "--listen", ":7", "--udp")
	var backMu sync.Mutex
	var patternBack time.Time // when the pattern server's stack was last back
	ps, err := userstack.Open(ctx, userstack.Options{App: "pattern", Control: r.sock, Events: func(e userstack.Event) {
		if e.Kind == userstack.BridgeBack {
			backMu.Lock()
			patternBack = time.Now()
			backMu.Unlock()
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	pl, err := ps.Listen("tcp", ":81")
	if err != nil {
		t.Fatal(err)
	}
	defer pl.Close()
	go servePattern(pl, patternSize, rate/2)

	for i, stop := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(stop.String(), func(t *testing.T) {
			hc, err := r.dial(r.addr(80), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer hc.Close()
			fmt.Fprintf(hc, "GET /bytes/%d HTTP/1.1\r\nHost: fb\r\nConnection: close\r\n\r\n", httpSize)
			resp, err := http.ReadResponse(bufio.NewReaderSize(hc, 64<<10), nil)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("GET: %v %v", resp, err)
			}
			httpDL := readChecked(resp.Body, func(int) byte { return 'x' })
			pc, err := r.dial(r.addr(81), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer pc.Close()
			patternDL := readChecked(pc, patternAt)
			probe := startUDPProbe(t, r.outside, r.addr(7), time.Millisecond)

			for deadline := time.Now().Add(20 * time.Second); httpDL.progress() < 16<<20 || patternDL.progress() < 8<<20; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("downloads stuck at %d and %d bytes before the restart", httpDL.progress(), patternDL.progress())
				}
			}
			t0 := time.Now()
			r.d.signal(t, stop)
			r.d.wait(t)
			exited := time.Now()
			back := r.start(t)
			// New connections: served within a second of the daemon's
			// control socket answering.
			var served time.Time
			for served.IsZero() && time.Since(back) < 5*time.Second {
				c, err := r.dial(r.addr(81), 100*time.Millisecond)
				if err == nil {
					c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
					if _, err := io.ReadFull(c, make([]byte, 1000)); err == nil {
						served = time.Now()
					}
					c.Close()
				}
				if served.IsZero() {
					time.Sleep(5 * time.Millisecond)
				}
			}
			if served.IsZero() || served.Sub(back) > time.Second {
				t.Errorf("no new connection served within a second of the daemon being back (served: %v)", served.Sub(back))
			}

			for _, dl := range []struct {
				name string
				d    *download
				size int
			}{{"app http", httpDL, httpSize}, {"pattern", patternDL, patternSize}} {
				select {
				case <-dl.d.done:
				case <-time.After(60*time.Second + time.Duration(httpSize/rate)*time.Second):
					t.Fatalf("%s: download stuck at %d bytes after the restart", dl.name, dl.d.progress())
				}
				if dl.d.got != dl.size || dl.d.err != nil {
					t.Errorf("%s: %d of %d bytes across the restart: %v", dl.name, dl.d.got, dl.size, dl.d.err)
				}
			}
			window, lost, sent := probe.finish()
			backMu.Lock()
			reattached := patternBack.Sub(back)
			backMu.Unlock()
			t.Logf("%v: the daemon exited %v after the signal; its control socket answered %v after the new start; "+
				"the application was attached again %v after that and new connections served %v after that; no UDP echo for %v (%d of %d lost, one sent every ms)",
				stop, exited.Sub(t0).Round(time.Millisecond), back.Sub(exited).Round(time.Millisecond),
				reattached.Round(time.Millisecond), served.Sub(back).Round(time.Millisecond), window, lost, sent)
			// The new daemon counts the applications that came back.
			waitMetric(t, r.bridge, restartMetrics, r.d, func(s []metrics.Sample) bool {
				a := metrics.Find(s, "fabricbridge_applications_connected")
				return len(a) == 1 && a[0].Value == 3
			})
			for _, want := range []string{"http: bridge lost", "http: bridge back"} {
				if n := strings.Count(httpLog.String(), want); n != i+1 {
					t.Errorf("the application logged %q %d times after %d restarts:\n%s", want, n, i+1, httpLog.String())
				}
			}
		})
	}
}
