package control

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// recorder is a Dataplane that remembers what it was told and can be made
// to refuse.
type recorder struct {
	mu      sync.Mutex
	streams map[uint32]*fabric.BridgeStream
	own     map[uint32]classifier.Ownership
	tables  *classifier.Tables
	sets    int // SetTables calls
	removed []uint32
	fail    error // returned by every call while set
}

func newRecorder() *recorder {
	return &recorder{streams: map[uint32]*fabric.BridgeStream{}, own: map[uint32]classifier.Ownership{}}
}

func (r *recorder) AddStream(id uint32, s *fabric.BridgeStream, own classifier.Ownership) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return r.fail
	}
	r.streams[id] = s
	r.own[id] = own
	return nil
}

func (r *recorder) AddRemoteStream(id uint32, s *fabric.RemoteStream, own classifier.Ownership) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return r.fail
	}
	r.own[id] = own
	return nil
}

func (r *recorder) SetOwnership(id uint32, own classifier.Ownership) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return r.fail
	}
	r.own[id] = own
	return nil
}

func (r *recorder) RemoveStream(id uint32) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.streams, id)
	delete(r.own, id)
	r.removed = append(r.removed, id)
	return nil
}

func (r *recorder) SetTables(t *classifier.Tables) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return r.fail
	}
	r.tables = t
	r.sets++
	return nil
}

func (r *recorder) setFail(err error) {
	r.mu.Lock()
	r.fail = err
	r.mu.Unlock()
}

// entries lists the current listeners and flows as strings, for comparison.
func (r *recorder) entries() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for k, tg := range r.tables.Listeners() {
		out = append(out, fmt.Sprintf("L %d %d %v:%d -> %d", k.Family, k.Proto, addrOf(k.Family, k.Addr), k.Port, tg.Stream))
	}
	for k, tg := range r.tables.Flows() {
		out = append(out, fmt.Sprintf("F %d %v:%d -> %v:%d -> %d", k.Proto, addrOf(k.Family, k.Src), k.SrcPort, addrOf(k.Family, k.Dst), k.DstPort, tg.Stream))
	}
	slices.Sort(out)
	return out
}

func addrOf(fam uint8, a classifier.Addr16) netip.Addr {
	if fam == 4 {
		return netip.AddrFrom4([4]byte(a[:4]))
	}
	return netip.AddrFrom16(a)
}

func (r *recorder) ownership(id uint32) classifier.Ownership {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.own[id]
}

var (
	boxA  = netip.MustParseAddr("198.18.0.1")
	boxB  = netip.MustParseAddr("198.18.0.2")
	box6  = netip.MustParseAddr("2001:db8::1")
	peer4 = netip.MustParseAddrPort("198.18.1.9:5000")
)

type fixture struct {
	t    *testing.T
	dp   *recorder
	srv  *Server
	path string
}

func newFixture(t *testing.T, mod func(*Config)) *fixture {
	t.Helper()
	dp := newRecorder()
	cfg := Config{
		Dataplane: dp,
		Addrs:     []netip.Addr{boxA, box6},
		Ephemeral: classifier.PortRange{Lo: 40000, Hi: 40099},
		Stream:    fabric.Config{RxSlots: 64, TxSlots: 64},
		Apps:      map[string]Policy{"other": {Addrs: []netip.Addr{boxB}}},
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "control.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.ServeLocal(l) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != nil {
			t.Errorf("ServeLocal: %v", err)
		}
	})
	return &fixture{t: t, dp: dp, srv: srv, path: path}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

// register dials and registers one application.
func (f *fixture) register(app string) (*Client, Registration, *fabric.Stream) {
	f.t.Helper()
	c, err := DialLocal(ctx(f.t), f.path, app)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { c.Close() })
	reg, st, err := c.RegisterLocal(ctx(f.t), 0, 0)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { st.Close() })
	return c, reg, st
}

func TestRegisterGivesAWorkingStream(t *testing.T) {
	f := newFixture(t, nil)
	_, reg, st := f.register("web")
	if reg.Stream == 0 || reg.MTU != 1500 || reg.Ports != (classifier.PortRange{Lo: 40000, Hi: 40099}) {
		t.Fatalf("registration %+v", reg)
	}
	if !slices.Equal(reg.Addrs, []netip.Addr{boxA, box6}) {
		t.Fatalf("addresses %v, want the configured ones", reg.Addrs)
	}
	f.dp.mu.Lock()
	bridgeSide := f.dp.streams[reg.Stream]
	f.dp.mu.Unlock()
	if bridgeSide == nil {
		t.Fatal("the data plane never got the stream")
	}
	// Both directions carry packets: the handover really connected them.
	if _, err := st.Send([][]byte{[]byte("from app")}); err != nil {
		t.Fatal(err)
	}
	buf := [][]byte{make([]byte, 2048)}
	if n, err := bridgeSide.RecvTimeout(buf, 5*time.Second); n != 1 || err != nil || string(buf[0]) != "from app" {
		t.Fatalf("bridge got %d %q %v", n, buf[0], err)
	}
	if n, _ := bridgeSide.Send([][]byte{[]byte("to app")}); n != 1 {
		t.Fatal("bridge could not send")
	}
	buf[0] = buf[0][:cap(buf[0])]
	if n, err := st.RecvTimeout(buf, 5*time.Second); n != 1 || err != nil || string(buf[0]) != "to app" {
		t.Fatalf("app got %d %q %v", n, buf[0], err)
	}
}

func TestClaimsReachTablesAndOwnershipBeforeTheReply(t *testing.T) {
	f := newFixture(t, nil)
	c, reg, _ := f.register("web")
	s := reg.Stream
	l, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 80)
	if err != nil {
		t.Fatal(err)
	}
	// The server replies only after SetTables returned, so the tables are
	// there as soon as the call returns.
	want := []string{
		fmt.Sprintf("L 4 6 0.0.0.0:80 -> %d", s),
		fmt.Sprintf("L 6 6 :::80 -> %d", s),
	}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("after listen: %q, want %q", got, want)
	}
	conn, err := c.Connect(ctx(t), "tcp", netip.Addr{}, peer4)
	if err != nil {
		t.Fatal(err)
	}
	if conn.Addr != boxA || conn.Port < 40000 || conn.Port > 40099 {
		t.Fatalf("connect gave %v:%d", conn.Addr, conn.Port)
	}
	flow := fmt.Sprintf("F 6 %v -> %v:%d -> %d", peer4, boxA, conn.Port, s)
	if got := f.dp.entries(); !slices.Contains(got, flow) {
		t.Fatalf("after connect: %q lacks %q", got, flow)
	}
	own := f.dp.ownership(s)
	wantPorts := []classifier.PortClaim{{Proto: classifier.ProtoTCP, Port: 80}, {Proto: classifier.ProtoTCP, Port: conn.Port}}
	if !slices.Equal(own.Ports, wantPorts) || !slices.Equal(own.Addrs, []netip.Addr{boxA, box6}) {
		t.Fatalf("ownership %+v, want ports %v", own, wantPorts)
	}
	u, err := c.Listen(ctx(t), "udp", box6, 0)
	if err != nil {
		t.Fatal(err)
	}
	if u.Port < 40000 || u.Port > 40099 || u.Addr != box6 {
		t.Fatalf("udp listen on port 0 gave %v:%d", u.Addr, u.Port)
	}
	if err := c.Release(ctx(t), conn.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(ctx(t), l.ID); err != nil {
		t.Fatal(err)
	}
	want = []string{fmt.Sprintf("L 6 17 2001:db8::1:%d -> %d", u.Port, s)}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("after release: %q, want %q", got, want)
	}
	if own := f.dp.ownership(s); !slices.Equal(own.Ports, []classifier.PortClaim{{Proto: classifier.ProtoUDP, Port: u.Port}}) {
		t.Fatalf("ownership after release %+v", own)
	}
	if err := c.Release(ctx(t), l.ID); !errors.Is(err, ErrUnknownClaim) {
		t.Fatalf("second release: %v, want ErrUnknownClaim", err)
	}
}

func TestClosingTheConnectionEndsTheLease(t *testing.T) {
	f := newFixture(t, nil)
	c, reg, st := f.register("web")
	if _, err := c.Listen(ctx(t), "tcp", boxA, 8080); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := c.Connect(ctx(t), "udp", boxA, peer4); err != nil {
			t.Fatal(err)
		}
	}
	other, oreg, _ := f.register("other")
	if _, err := other.Listen(ctx(t), "tcp", boxB, 8080); err != nil {
		t.Fatal(err)
	}
	if n := len(f.dp.entries()); n != 5 {
		t.Fatalf("%d entries before close, want 5", n)
	}
	c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		f.dp.mu.Lock()
		removed := slices.Contains(f.dp.removed, reg.Stream)
		f.dp.mu.Unlock()
		if removed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("stream not removed within 5 s of the connection closing")
		}
		time.Sleep(5 * time.Millisecond)
	}
	want := []string{fmt.Sprintf("L 4 6 198.18.0.2:8080 -> %d", oreg.Stream)}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("after the lease ended: %q, want only the other application's %q", got, want)
	}
	// The server closed its side: the application's stream is broken.
	if _, err := st.RecvTimeout([][]byte{make([]byte, 64)}, 5*time.Second); err == nil {
		t.Fatal("stream still works after the lease ended")
	}
	if apps := f.srv.Apps(); len(apps) != 1 || apps[0].Name != "other" || apps[0].Listeners != 1 {
		t.Fatalf("apps %+v", apps)
	}
	// The port is free for others now.
	if _, err := other.Listen(ctx(t), "tcp", netip.Addr{}, 9090); err != nil {
		t.Fatal(err)
	}
}

func TestExplicitErrorsChangeNothing(t *testing.T) {
	f := newFixture(t, func(c *Config) {
		c.Ephemeral = classifier.PortRange{Lo: 40000, Hi: 40002}
		c.Default.MaxPorts = 5 // more than port 80 and the whole range: this test runs the range out
		c.Apps["small"] = Policy{MaxPorts: 1, ListenPorts: []classifier.PortRange{{Lo: 7000, Hi: 7999}}}
	})
	a, _, _ := f.register("web")
	b, _, _ := f.register("other")
	small, _, _ := f.register("small")
	if _, err := a.Listen(ctx(t), "tcp", netip.Addr{}, 80); err != nil {
		t.Fatal(err)
	}
	before, beforeSets := f.dp.entries(), f.dp.setCount()
	cases := []struct {
		name string
		call func() error
		want error
	}{
		{"another app's port (wildcard)", func() error { _, err := b.Listen(ctx(t), "tcp", boxB, 80); return err }, ErrPortInUse},
		{"own port twice", func() error { _, err := a.Listen(ctx(t), "tcp", boxA, 80); return err }, ErrPortInUse},
		{"address not the app's", func() error { _, err := b.Listen(ctx(t), "tcp", boxA, 81); return err }, ErrNotPermitted},
		{"port in the reserved range", func() error { _, err := a.Listen(ctx(t), "udp", netip.Addr{}, 40001); return err }, ErrNotPermitted},
		{"port outside the app's", func() error { _, err := small.Listen(ctx(t), "tcp", netip.Addr{}, 80); return err }, ErrNotPermitted},
		{"connect from a foreign address", func() error { _, err := a.Connect(ctx(t), "tcp", boxB, peer4); return err }, ErrNotPermitted},
		{"connect across families", func() error { _, err := a.Connect(ctx(t), "tcp", box6, peer4); return err }, ErrBadRequest},
		{"connect to nowhere", func() error {
			_, err := a.Connect(ctx(t), "tcp", boxA, netip.MustParseAddrPort("0.0.0.0:80"))
			return err
		}, ErrBadRequest},
		{"no IPv6 address", func() error {
			_, err := b.Connect(ctx(t), "tcp", netip.Addr{}, netip.MustParseAddrPort("[2001:db8::9]:80"))
			return err
		}, ErrNotPermitted},
		{"bad protocol", func() error { _, err := a.Listen(ctx(t), "sctp", netip.Addr{}, 82); return err }, ErrBadRequest},
		{"unknown claim", func() error { return a.Release(ctx(t), 999) }, ErrUnknownClaim},
		{"register twice", func() error { _, _, err := a.RegisterLocal(ctx(t), 0, 0); return err }, ErrBadRequest},
	}
	for _, tc := range cases {
		if err := tc.call(); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if got := f.dp.entries(); !slices.Equal(got, before) || f.dp.setCount() != beforeSets {
		t.Fatalf("refused requests changed the tables: %q -> %q", before, got)
	}

	// Quota: one claim, then no more.
	if _, err := small.Listen(ctx(t), "tcp", netip.Addr{}, 7000); err != nil {
		t.Fatal(err)
	}
	if _, err := small.Listen(ctx(t), "tcp", netip.Addr{}, 7001); !errors.Is(err, ErrQuota) {
		t.Fatalf("over quota: %v", err)
	}
	// Reserved range of three ports: the fourth connect finds none.
	for i := range 3 {
		if _, err := a.Connect(ctx(t), "udp", boxA, peer4); err != nil {
			t.Fatalf("connect %d: %v", i, err)
		}
	}
	if _, err := a.Connect(ctx(t), "udp", boxA, peer4); !errors.Is(err, ErrNoPorts) {
		t.Fatalf("fourth connect: %v, want ErrNoPorts", err)
	}
	// The bridge refusing is reported as such, and nothing changes.
	before = f.dp.entries()
	f.dp.setFail(fmt.Errorf("bridge closed: %w", ErrBridgeGone))
	if _, err := b.Listen(ctx(t), "tcp", boxB, 443); !errors.Is(err, ErrBridgeGone) {
		t.Fatalf("listen while the bridge refuses: %v", err)
	}
	f.dp.setFail(errors.New("map full"))
	if _, err := b.Listen(ctx(t), "tcp", boxB, 443); !errors.Is(err, ErrInternal) {
		t.Fatalf("listen while the bridge fails: %v", err)
	}
	f.dp.setFail(nil)
	if got := f.dp.entries(); !slices.Equal(got, before) {
		t.Fatalf("refused listen changed the tables: %q -> %q", before, got)
	}
	if _, err := b.Listen(ctx(t), "tcp", boxB, 443); err != nil {
		t.Fatalf("listen after the bridge recovered: %v", err)
	}
}

func TestNotRegisteredYet(t *testing.T) {
	f := newFixture(t, nil)
	c, err := DialLocal(ctx(t), f.path, "web")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 80); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("listen before register: %v", err)
	}
	if _, _, err := c.RegisterLocal(ctx(t), 100, 0); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("ring depth 100: %v", err)
	}
	if _, _, err := c.RegisterLocal(ctx(t), 1<<20, 0); !errors.Is(err, ErrQuota) {
		t.Fatalf("ring depth beyond MaxSlots: %v", err)
	}
	if _, err := c.RegisterRemote(ctx(t), netip.MustParseAddrPort("198.18.0.5:6081")); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("GENEVE register on the local socket: %v", err)
	}
}

func b64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

func (r *recorder) setCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sets
}

func (r *recorder) current() *classifier.Tables {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.tables
}

// raw is a hand-driven control connection for malformed input.
type raw struct {
	t    *testing.T
	conn net.Conn
	br   *bufio.Reader
	fds  []int
}

func dialRaw(t *testing.T, path string) *raw {
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	return &raw{t: t, conn: conn}
}

// Read keeps descriptors that arrive, as the real client does.
func (r *raw) Read(p []byte) (int, error) {
	uc, ok := r.conn.(*net.UnixConn)
	if !ok {
		return r.conn.Read(p)
	}
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := uc.ReadMsgUnix(p, oob)
	n = max(n, 0)
	if oobn > 0 {
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		for i := range msgs {
			fds, _ := unix.ParseUnixRights(&msgs[i])
			r.fds = append(r.fds, fds...)
		}
	}
	return n, err
}

// attach completes the stream handover for a register reply.
func (r *raw) attach() *fabric.Stream {
	r.t.Helper()
	if len(r.fds) != 1 {
		r.t.Fatalf("register reply carried %d descriptors", len(r.fds))
	}
	f := os.NewFile(uintptr(r.fds[0]), "handover")
	r.fds = nil
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		r.t.Fatal(err)
	}
	st, err := fabric.AttachShm(c.(*net.UnixConn))
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { st.Close() })
	return st
}

func (r *raw) send(body string) {
	r.t.Helper()
	b := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	if _, err := r.conn.Write(append(b, body...)); err != nil {
		r.t.Fatal(err)
	}
}

func (r *raw) reply() Reply {
	r.t.Helper()
	if r.br == nil {
		r.br = bufio.NewReader(r)
	}
	body, err := readFrame(r.br, nil)
	if err != nil {
		r.t.Fatalf("no reply: %v", err)
	}
	var rep Reply
	if err := decodeStrict(body, &rep); err != nil {
		r.t.Fatalf("reply %q: %v", body, err)
	}
	return rep
}

// closed reports whether the server hung up.
func (r *raw) closed() bool {
	var b [1]byte
	if r.br == nil {
		r.br = bufio.NewReader(r)
	}
	_, err := r.br.Read(b[:])
	return err != nil
}

func TestMalformedRequestsGetAnErrorAndChangeNothing(t *testing.T) {
	f := newFixture(t, nil)
	r := dialRaw(t, f.path)
	r.send(`{"id":1,"op":"hello","version":1,"app":"raw"}`)
	if rep := r.reply(); rep.Error != nil || rep.Version != Version {
		t.Fatalf("hello: %+v", rep)
	}
	r.send(`{"id":2,"op":"register"}`)
	if rep := r.reply(); rep.Error != nil || rep.Stream == 0 {
		t.Fatalf("register: %+v", rep)
	}
	r.attach()
	sets := f.dp.setCount()
	bad := []struct{ body, code string }{
		{`{"id":3,"op":"listen","proto":"tcp","port":80,"color":"red"}`, "bad_request"},
		{`{"id":4,"op":"listen","proto":"tcp","port":70000}`, "bad_request"},
		{`{"id":5,"op":"listen","proto":"tcp","addr":"not-an-ip","port":80}`, "bad_request"},
		{`{"id":6,"op":"fly"}`, "bad_request"},
		{`{"id":7,"op":"connect","proto":"tcp","remote":"198.18.1.1"}`, "bad_request"},
		{`{"id":8,"op":"release"}`, "bad_request"},
		{`{"id":9,"op":"listen","proto":"udp","addr":"::ffff:198.18.0.1","port":53}`, "bad_request"},
		{`{"id":10,"op":"listen"} {"id":11}`, "bad_request"},
		{`[1,2,3]`, "bad_request"},
		{`{"id":12,"op":"hello","version":1,"app":"again"}`, "bad_request"},
	}
	for _, b := range bad {
		r.send(b.body)
		rep := r.reply()
		if rep.Error == nil || rep.Error.Code != b.code {
			t.Errorf("%s: reply %+v, want error %s", b.body, rep, b.code)
		}
	}
	// The id is echoed even when the request did not decode.
	r.send(`{"id":42,"op":"listen","proto":7}`)
	if rep := r.reply(); rep.ID != 42 || rep.Error == nil {
		t.Fatalf("reply to undecodable request: %+v", rep)
	}
	if f.dp.setCount() != sets || len(f.dp.entries()) != 0 {
		t.Fatalf("malformed requests changed the tables: %q", f.dp.entries())
	}
	// Still usable afterwards.
	r.send(`{"id":13,"op":"listen","proto":"tcp","port":80}`)
	if rep := r.reply(); rep.Error != nil || rep.ID != 13 || rep.Port != 80 {
		t.Fatalf("listen after errors: %+v", rep)
	}

	// A frame beyond MaxFrame gets an error, then the connection ends.
	r2 := dialRaw(t, f.path)
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], MaxFrame+1)
	r2.conn.Write(hdr[:])
	if rep := r2.reply(); rep.Error == nil || rep.Error.Code != "bad_request" {
		t.Fatalf("oversized frame: %+v", rep)
	}
	if !r2.closed() {
		t.Fatal("connection stays open after an oversized frame")
	}
	// Anything before hello: error, then the connection ends.
	r3 := dialRaw(t, f.path)
	r3.send(`{"id":1,"op":"listen","proto":"tcp","port":80}`)
	if rep := r3.reply(); rep.Error == nil {
		t.Fatalf("listen before hello: %+v", rep)
	}
	if !r3.closed() {
		t.Fatal("connection stays open after a request before hello")
	}
	// A version this server does not speak.
	r4 := dialRaw(t, f.path)
	r4.send(`{"id":1,"op":"hello","version":0,"app":"old"}`)
	if rep := r4.reply(); rep.Error == nil || rep.Error.Code != "version" {
		t.Fatalf("version 0: %+v", rep)
	}
	if !r4.closed() {
		t.Fatal("connection stays open after a version refusal")
	}
	// A bad name.
	r5 := dialRaw(t, f.path)
	r5.send(`{"id":1,"op":"hello","version":1,"app":"a b\n"}`)
	if rep := r5.reply(); rep.Error == nil || rep.Error.Code != "bad_request" {
		t.Fatalf("bad name: %+v", rep)
	}
}

func TestStaticRulesAndReload(t *testing.T) {
	static := []classifier.Rule{{ID: 1, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(6666), Action: classifier.ActionDrop}}
	f := newFixture(t, func(c *Config) { c.Static.Rules = static })
	if rules := f.dp.current().Rules(); len(rules) != 1 || rules[0].ID != 1 {
		t.Fatalf("static rules not installed: %+v", rules)
	}
	c, reg, _ := f.register("web")
	if _, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 80); err != nil {
		t.Fatal(err)
	}
	// Listener ids never collide with static rule ids.
	for _, tg := range f.dp.current().Listeners() {
		if tg.Rule == 1 {
			t.Fatal("listener got the static rule's id")
		}
	}
	more := append(slices.Clone(static), classifier.Rule{ID: 500, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(9000), Action: classifier.ActionIngest, Stream: 10})
	if err := f.srv.SetStatic(Static{Rules: more}); err != nil {
		t.Fatal(err)
	}
	if len(f.dp.current().Rules()) != 2 || len(f.dp.entries()) != 2 {
		t.Fatalf("reload lost something: rules %d, entries %q", len(f.dp.current().Rules()), f.dp.entries())
	}
	// A rule that steers into an application's stream is refused whole.
	clash := append(slices.Clone(more), classifier.Rule{ID: 501, Action: classifier.ActionSteer, Stream: reg.Stream})
	if err := f.srv.SetStatic(Static{Rules: clash}); err == nil {
		t.Fatal("rule naming an application's stream accepted")
	}
	invalid := []classifier.Rule{{ID: 0, Action: classifier.ActionDrop}}
	if err := f.srv.SetStatic(Static{Rules: invalid}); err == nil {
		t.Fatal("invalid rule accepted")
	}
	if len(f.dp.current().Rules()) != 2 {
		t.Fatal("a refused reload changed the rules")
	}
	// Streams named by static rules are never given to applications.
	f2 := newFixture(t, func(c *Config) {
		c.Static.Rules = []classifier.Rule{{ID: 1, Action: classifier.ActionSteer, Stream: 1, Protocol: classifier.ProtoTCP, DstPorts: classifier.Port(80)}}
	})
	_, reg2, _ := f2.register("web")
	if reg2.Stream == 1 {
		t.Fatal("application got a stream id a static rule uses")
	}
}

// pipeListener serves in-memory connections, so the authentication tests
// need no network at all.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}
func (l *pipeListener) Close() error   { l.once.Do(func() { close(l.done) }); return nil }
func (l *pipeListener) Addr() net.Addr { return &net.UnixAddr{Name: "pipe", Net: "pipe"} }

func (l *pipeListener) dial() net.Conn {
	a, b := net.Pipe()
	l.conns <- b
	return a
}

func TestRemoteAuthentication(t *testing.T) {
	secret := []byte("0123456789abcdef-secret")
	f := newFixture(t, func(c *Config) { c.Secrets = map[string][]byte{"far": secret} })
	pl := newPipeListener()
	go f.srv.ServeRemote(pl)
	dial := func(app string, key []byte) (*Client, error) {
		return DialRemoteConn(ctx(t), pl.dial(), app, key)
	}
	c, err := dial("far", secret)
	if err != nil {
		t.Fatalf("right secret refused: %v", err)
	}
	// Authenticated, it can talk (register needs a Remote, which this
	// server lacks: a clear refusal, not an auth error).
	if _, err := c.RegisterRemote(ctx(t), netip.MustParseAddrPort("0.0.0.0:6081")); !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("register on a bridge without remote transport: %v", err)
	}
	c.Close()
	if _, err := dial("far", []byte("0123456789abcdef-wrong!")); !errors.Is(err, ErrAuth) {
		t.Fatalf("wrong secret: %v", err)
	}
	if _, err := dial("stranger", secret); !errors.Is(err, ErrAuth) {
		t.Fatalf("unknown application: %v", err)
	}
	// A client that ignores the bridge's proof and sends a wrong MAC is
	// refused by the server and disconnected.
	conn := pl.dial()
	r := &raw{t: t, conn: conn}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	r.send(fmt.Sprintf(`{"id":1,"op":"hello","version":1,"app":"far","nonce":%q}`, b64(nonce())))
	if rep := r.reply(); rep.Error != nil || len(rep.Nonce) != NonceSize {
		t.Fatalf("hello: %+v", rep)
	}
	r.send(fmt.Sprintf(`{"id":2,"op":"auth","mac":%q}`, b64(make([]byte, 32))))
	if rep := r.reply(); rep.Error == nil || rep.Error.Code != "auth" {
		t.Fatalf("wrong MAC: %+v", rep)
	}
	if !r.closed() {
		t.Fatal("connection stays open after a failed authentication")
	}
	// Requests before authentication are refused and end the connection.
	conn = pl.dial()
	r = &raw{t: t, conn: conn}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	r.send(fmt.Sprintf(`{"id":1,"op":"hello","version":1,"app":"far","nonce":%q}`, b64(nonce())))
	r.reply()
	r.send(`{"id":2,"op":"register","geneve":"0.0.0.0:6081"}`)
	if rep := r.reply(); rep.Error == nil || rep.Error.Code != "auth" {
		t.Fatalf("register before auth: %+v", rep)
	}
	if !r.closed() {
		t.Fatal("connection stays open after a request before auth")
	}
	// A remote hello without a nonce.
	conn = pl.dial()
	r = &raw{t: t, conn: conn}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	r.send(`{"id":1,"op":"hello","version":1,"app":"far"}`)
	if rep := r.reply(); rep.Error == nil || rep.Error.Code != "bad_request" {
		t.Fatalf("hello without nonce: %+v", rep)
	}
}

func TestHandshakeTimeout(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.HandshakeTimeout = 100 * time.Millisecond })
	r := dialRaw(t, f.path)
	start := time.Now()
	if !r.closed() {
		t.Fatal("silent client not disconnected")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("silent client disconnected after %v", d)
	}
}

func TestClientSeesBridgeGone(t *testing.T) {
	f := newFixture(t, nil)
	c, _, _ := f.register("web")
	f.srv.Close()
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("client did not notice the server closing")
	}
	if _, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 80); !errors.Is(err, ErrBridgeGone) {
		t.Fatalf("listen after the bridge went: %v", err)
	}
	if _, err := DialLocal(ctx(t), f.path, "late"); !errors.Is(err, ErrBridgeGone) {
		t.Fatalf("dial after the bridge went: %v", err)
	}
}

func TestConcurrentConnectsGetDistinctPorts(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.Ephemeral = classifier.PortRange{Lo: 50000, Hi: 50999} })
	c, _, _ := f.register("web")
	var mu sync.Mutex
	seen := map[uint16]bool{}
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			cl, err := c.Connect(ctx(t), "tcp", netip.Addr{}, peer4)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if seen[cl.Port] {
				t.Errorf("port %d given twice", cl.Port)
			}
			seen[cl.Port] = true
		})
	}
	wg.Wait()
	if n := len(f.dp.entries()); n != 200 {
		t.Fatalf("%d flows installed, want 200", n)
	}
}

func TestConfiguredEntriesFollowTheirApplication(t *testing.T) {
	web := AppStatic{
		Listeners: []classifier.Listener{{ID: 10, Protocol: classifier.ProtoTCP, Port: 80}},
		Rules: []classifier.Rule{{ID: 11, Priority: 5, Protocol: classifier.ProtoUDP, DstPorts: classifier.Port(5353),
			Action: classifier.ActionSteer}},
	}
	f := newFixture(t, func(c *Config) {
		c.Static = Static{Apps: map[string]AppStatic{"web": web}}
		c.FirstDynamicID = 4096
	})
	if got := f.dp.entries(); len(got) != 0 {
		t.Fatalf("entries of an absent application installed: %q", got)
	}
	c, reg, _ := f.register("web")
	want := []string{
		fmt.Sprintf("L 4 6 0.0.0.0:80 -> %d", reg.Stream),
		fmt.Sprintf("L 6 6 :::80 -> %d", reg.Stream),
	}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("after register: %q, want %q", got, want)
	}
	if rules := f.dp.current().Rules(); len(rules) != 1 || rules[0].Stream != reg.Stream || rules[0].ID != 11 {
		t.Fatalf("bound rule %+v", rules)
	}
	wantPorts := []classifier.PortClaim{{Proto: classifier.ProtoTCP, Port: 80}, {Proto: classifier.ProtoUDP, Port: 5353}}
	if own := f.dp.ownership(reg.Stream); !slices.Equal(own.Ports, wantPorts) {
		t.Fatalf("ownership %+v, want %v", own.Ports, wantPorts)
	}
	// Nobody else gets the configured port, not even while web is away.
	other, _, _ := f.register("other")
	if _, err := other.Listen(ctx(t), "tcp", boxB, 80); !errors.Is(err, ErrPortInUse) {
		t.Fatalf("other app on web's configured port: %v", err)
	}
	// web itself may listen there: the claim shares the configured entry.
	own, err := c.Listen(ctx(t), "tcp", boxA, 80)
	if err != nil {
		t.Fatalf("web listening on its configured port: %v", err)
	}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("web's claim on its configured port changed the entries: %q, want %q", got, want)
	}
	if err := c.Release(ctx(t), own.ID); err != nil {
		t.Fatal(err)
	}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("releasing the shared claim changed the entries: %q, want %q", got, want)
	}
	// A second "web" cannot take the name's entries.
	c2, err := DialLocal(ctx(t), f.path, "web")
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, _, err := c2.RegisterLocal(ctx(t), 0, 0); !errors.Is(err, ErrNameTaken) {
		t.Fatalf("second web: %v", err)
	}
	// Dynamic ids stay above the floor.
	l, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 8080)
	if err != nil {
		t.Fatal(err)
	}
	for k, tg := range f.dp.current().Listeners() {
		if k.Port == 8080 && tg.Rule < 4096 {
			t.Fatalf("dynamic listener id %d below the floor", tg.Rule)
		}
	}
	// A reload that changes web's port keeps its claims.
	web2 := AppStatic{Listeners: []classifier.Listener{{ID: 10, Protocol: classifier.ProtoTCP, Port: 81}}}
	if err := f.srv.SetStatic(Static{Apps: map[string]AppStatic{"web": web2}}); err != nil {
		t.Fatal(err)
	}
	want = []string{
		fmt.Sprintf("L 4 6 0.0.0.0:8080 -> %d", reg.Stream),
		fmt.Sprintf("L 4 6 0.0.0.0:81 -> %d", reg.Stream),
		fmt.Sprintf("L 6 6 :::8080 -> %d", reg.Stream),
		fmt.Sprintf("L 6 6 :::81 -> %d", reg.Stream),
	}
	if got := f.dp.entries(); !slices.Equal(got, want) {
		t.Fatalf("after reload: %q, want %q", got, want)
	}
	wantPorts = []classifier.PortClaim{{Proto: classifier.ProtoTCP, Port: 81}, {Proto: classifier.ProtoTCP, Port: 8080}}
	if own := f.dp.ownership(reg.Stream); !slices.Equal(own.Ports, wantPorts) {
		t.Fatalf("ownership after reload %+v, want %v", own.Ports, wantPorts)
	}
	// A reload binding a port someone holds is refused whole.
	clash := Static{Apps: map[string]AppStatic{"other": {Listeners: []classifier.Listener{{ID: 12, Protocol: classifier.ProtoTCP, Port: 8080}}}}}
	if err := f.srv.SetStatic(clash); err == nil {
		t.Fatal("reload binding web's port 8080 to other accepted")
	}
	var dynID uint32
	for k, tg := range f.dp.current().Listeners() {
		if k.Port == 8080 {
			dynID = tg.Rule
		}
	}
	taken := Static{
		Apps:  map[string]AppStatic{"web": web2},
		Rules: []classifier.Rule{{ID: dynID, Action: classifier.ActionDrop, Protocol: classifier.ProtoUDP}},
	}
	if err := f.srv.SetStatic(taken); err == nil {
		t.Fatalf("static rule with the id %d of a live listener accepted", dynID)
	}
	if err := c.Release(ctx(t), l.ID); err != nil {
		t.Fatal(err)
	}
	if err := f.srv.SetStatic(taken); err != nil {
		t.Fatalf("the same id after the listener went: %v", err)
	}
	if apps := f.srv.Apps(); len(apps) != 2 {
		t.Fatalf("apps %+v", apps)
	}
}

// TestOwnConfiguredListenerIsShared: an application listening on a port its
// own configured listener covers gets a claim that shares the configured
// entry; only the part the configuration does not cover gets an entry of
// its own, and the claim keeps steering if a reload drops the configured
// listener.
func TestOwnConfiguredListenerIsShared(t *testing.T) {
	v4only := AppStatic{Listeners: []classifier.Listener{{ID: 10, Protocol: classifier.ProtoTCP, Addr: netip.IPv4Unspecified(), Port: 80}}}
	f := newFixture(t, func(c *Config) {
		c.Static = Static{Apps: map[string]AppStatic{"web": v4only}}
		c.FirstDynamicID = 4096
	})
	c, reg, _ := f.register("web")
	rules := func() map[string]uint32 {
		out := map[string]uint32{}
		for k, tg := range f.dp.current().Listeners() {
			if tg.Stream != reg.Stream {
				t.Fatalf("listener %+v steers to stream %d, not web's %d", k, tg.Stream, reg.Stream)
			}
			out[fmt.Sprintf("%v:%d", addrOf(k.Family, k.Addr), k.Port)] = tg.Rule
		}
		return out
	}

	// Covered whole: no entry of its own.
	exact, err := c.Listen(ctx(t), "tcp", boxA, 80)
	if err != nil {
		t.Fatalf("listen on an address the configured wildcard covers: %v", err)
	}
	if got := rules(); len(got) != 1 || got["0.0.0.0:80"] != 10 {
		t.Fatalf("entries %v, want only the configured 0.0.0.0:80 (id 10)", got)
	}
	if err := c.Release(ctx(t), exact.ID); err != nil {
		t.Fatal(err)
	}

	// Both families asked, IPv4 configured: the claim adds IPv6 only.
	both, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 80)
	if err != nil {
		t.Fatalf("listen on both families: %v", err)
	}
	got := rules()
	if len(got) != 2 || got["0.0.0.0:80"] != 10 || got[":::80"] < 4096 {
		t.Fatalf("entries %v, want the configured 0.0.0.0:80 (id 10) and a dynamic :::80", got)
	}
	if _, err := c.Listen(ctx(t), "tcp", netip.Addr{}, 80); !errors.Is(err, ErrPortInUse) {
		t.Fatalf("second listen on the same port: %v", err)
	}
	other, _, _ := f.register("other")
	if _, err := other.Listen(ctx(t), "tcp", boxB, 80); !errors.Is(err, ErrPortInUse) {
		t.Fatalf("another application on web's port: %v", err)
	}

	// A reload that drops the configured listener leaves the claim
	// steering both families on its own; one that brings it back shares
	// again.
	if err := f.srv.SetStatic(Static{Apps: map[string]AppStatic{"web": {}}}); err != nil {
		t.Fatal(err)
	}
	dyn := rules()
	if len(dyn) != 2 || dyn["0.0.0.0:80"] < 4096 || dyn["0.0.0.0:80"] != dyn[":::80"] {
		t.Fatalf("after dropping the configured listener: %v, want the claim's own entry on both families", dyn)
	}
	if own := f.dp.ownership(reg.Stream); !slices.Contains(own.Ports, classifier.PortClaim{Proto: classifier.ProtoTCP, Port: 80}) {
		t.Fatalf("ownership %+v lost tcp/80", own.Ports)
	}
	if err := f.srv.SetStatic(Static{Apps: map[string]AppStatic{"web": v4only}}); err != nil {
		t.Fatalf("reload bringing the configured listener back: %v", err)
	}
	if got := rules(); len(got) != 2 || got["0.0.0.0:80"] != 10 || got[":::80"] != dyn[":::80"] {
		t.Fatalf("after restoring: %v", got)
	}

	// Released, the configured entry stays and so does the port.
	if err := c.Release(ctx(t), both.ID); err != nil {
		t.Fatal(err)
	}
	if got := rules(); len(got) != 1 || got["0.0.0.0:80"] != 10 {
		t.Fatalf("after release: %v", got)
	}
	if own := f.dp.ownership(reg.Stream); !slices.Contains(own.Ports, classifier.PortClaim{Proto: classifier.ProtoTCP, Port: 80}) {
		t.Fatalf("ownership %+v lost the configured tcp/80", own.Ports)
	}
}

func TestWhoMayRegister(t *testing.T) {
	me := uint32(os.Getuid())
	f := newFixture(t, func(c *Config) {
		c.RefuseUnlisted = true
		c.Apps["mine"] = Policy{UIDs: []uint32{me}}
		c.Apps["theirs"] = Policy{UIDs: []uint32{me + 1}}
	})
	if _, err := DialLocal(ctx(t), f.path, "stranger"); !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("unlisted application: %v", err)
	}
	if _, err := DialLocal(ctx(t), f.path, "theirs"); !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("another user's application: %v", err)
	}
	c, err := DialLocal(ctx(t), f.path, "mine")
	if err != nil {
		t.Fatalf("own application: %v", err)
	}
	c.Close()
}

func TestSharedSecret(t *testing.T) {
	shared := []byte("a-secret-everyone-shares")
	f := newFixture(t, func(c *Config) {
		c.Secret = shared
		c.Secrets = map[string][]byte{"special": []byte("0123456789abcdef")}
	})
	pl := newPipeListener()
	go f.srv.ServeRemote(pl)
	try := func(app string, key []byte) error {
		c, err := DialRemoteConn(ctx(t), pl.dial(), app, key)
		if err == nil {
			c.Close()
		}
		return err
	}
	if err := try("anyone", shared); err != nil {
		t.Fatalf("shared secret: %v", err)
	}
	if err := try("special", shared); !errors.Is(err, ErrAuth) {
		t.Fatalf("shared secret for an app with its own: %v", err)
	}
	if err := try("special", []byte("0123456789abcdef")); err != nil {
		t.Fatalf("own secret: %v", err)
	}
	if _, err := NewServer(Config{Dataplane: newRecorder(), Secret: []byte("short")}); err == nil {
		t.Fatal("short secret accepted")
	}
}
