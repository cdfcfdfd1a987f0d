package appliance

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/internal/netns"
	"github.com/fabricbridge/fabricbridge/userstack"
)

// remoteBody is what the remote test application serves: 2 MB that no
// shifted or dropped segment can reproduce.
func remoteBody() []byte {
	b := make([]byte, 2<<20)
	for i := range b {
		b[i] = byte(i*7 + i>>11)
	}
	return b
}

// testRemoteApp is the application process of TestRemoteApplication
// (FB_TEST_REMOTE_APP=control-address,name,secret-file): a user-space
// stack over the TCP control plane and GENEVE, HTTP on :80 and :8080.
func testRemoteApp(spec string) int {
	parts := strings.Split(spec, ",")
	secret, err := os.ReadFile(parts[2])
	if err != nil {
		fmt.Println(err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := userstack.Open(ctx, userstack.Options{App: parts[1],
		Remote: &userstack.RemoteOptions{Control: parts[0], Secret: bytes.TrimSpace(secret)}})
	if err != nil {
		fmt.Println(err)
		return 1
	}
	body := remoteBody()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /body", func(w http.ResponseWriter, r *http.Request) { w.Write(body) })
	for _, port := range []string{":80", ":8080"} {
		ln, err := st.Listen("tcp", port)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		go http.Serve(ln, mux)
	}
	fmt.Println("ready")
	select {}
}

// startRemoteApp runs the test binary as the application in ns and waits
// until it serves.
func startRemoteApp(t *testing.T, ns *netns.NS, spec string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FB_TEST_REMOTE_APP="+spec)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	// A child starts in the namespace of the thread that forks it.
	if err := ns.Do(cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, _ := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		t.Fatalf("application: %q", line)
	}
	return cmd
}

// TestRemoteApplication: an application on another node (its own process
// in its own namespace) registers over the TCP control port with its
// secret, serves HTTP on a user-space stack over GENEVE through the relay
// (on the port a configured listener binds to it, and on one it claims
// itself), a kernel client outside fetches bodies byte-exact, and killing
// the application frees its ports and stops the relay.
func TestRemoteApplication(t *testing.T) {
	tp := newTopo(t)
	appNS := netns.New(t)
	// GENEVE adds 36 bytes to the wire's packets.
	link := netns.Connect(t, tp.bridge, appNS, netns.VethOptions{MTU: 1600})
	ctl := netip.AddrPortFrom(link.A.Addr4.Addr(), 7070)
	sf := writeSecret(t, tp.dir, "far.secret", "0123456789abcdef-far-away", 0o600)
	cfg := tp.config(t, fmt.Sprintf(`applications:
  - {name: far, ports: [80, 8080], secret_file: %s}
listeners:
  - {id: 1, name: http, protocol: tcp, port: 80, app: far}
`, sf), fmt.Sprintf("  tcp: {address: %q, auth: secret}\n", ctl))
	d := tp.start(t, cfg, io.Discard)
	defer d.Close()

	app := startRemoteApp(t, appNS, ctl.String()+",far,"+sf)
	var far control.AppInfo
	for _, a := range d.Apps() {
		if a.Name == "far" {
			far = a
		}
	}
	if far.Listeners != 2 {
		t.Fatalf("far: %+v, want 2 listeners", far)
	}
	plane := d.plane.(*bridgePlane)
	plane.mu.Lock()
	e := plane.streams[far.Stream]
	plane.mu.Unlock()
	if e == nil || e.relay == nil {
		t.Fatalf("stream %d of the remote application is not relayed: %+v", far.Stream, e)
	}

	client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
			err = tp.outside.Do(func() (err error) { c, err = (&net.Dialer{}).DialContext(ctx, network, a); return err })
			return c, err
		}}}
	want := remoteBody()
	for _, port := range []uint16{80, 8080} {
		resp, err := client.Get(fmt.Sprintf("http://%s/body", netip.AddrPortFrom(tp.v.A.Addr4.Addr(), port)))
		if err != nil {
			t.Fatalf("port %d: %v", port, err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("port %d: %d bytes (want %d), equal %v, %v", port, len(got), len(want), bytes.Equal(got, want), err)
		}
	}
	client.CloseIdleConnections()
	s := tp.scrape(t, d)
	stream := fmt.Sprint(far.Stream)
	if v := value(t, s, "fabricbridge_stream_tx_packets_total", "stream", stream); v < float64(2*len(want)/1500) {
		t.Errorf("stream %s sent %v packets", stream, v)
	}
	if v := value(t, s, "fabricbridge_stream_relay_drops_total", "stream", stream); v != 0 {
		t.Errorf("relay dropped %v", v)
	}
	if v := value(t, s, "fabricbridge_stream_health", "stream", stream, "state", "normal"); v != 1 {
		t.Errorf("stream %s not healthy", stream)
	}

	// SIGKILL: the control connection closes, the lease ends, the ports
	// are free and the relay is gone.
	next := dialApp(t, d, "successor")
	if err := listen(next, 8080); !errors.Is(err, control.ErrPortInUse) {
		t.Fatalf("far's port 8080 is not held: %v", err)
	}
	killed := time.Now()
	if err := app.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	for {
		err := listen(next, 8080)
		if err == nil {
			break
		}
		if !errors.Is(err, control.ErrPortInUse) {
			t.Fatal(err)
		}
		if time.Since(killed) > time.Second {
			t.Fatalf("port still held %v after SIGKILL", time.Since(killed))
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("port free %v after SIGKILL", time.Since(killed))
	waitPumps(t, e.relay)
	for _, a := range d.Apps() {
		if a.Name == "far" {
			t.Errorf("far is still registered: %+v", a)
		}
	}
	plane.mu.Lock()
	left := len(plane.streams)
	plane.mu.Unlock()
	if left != 1 { // the successor's
		t.Errorf("%d streams left, want the successor's only", left)
	}
}
