package appliance

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/internal/testing/testpki"
)

// TestMain lets a test start the test binary as an application process:
// FB_TEST_APP=socket,name,port registers and listens on tcp port, prints
// "ready" and waits to be killed.
func TestMain(m *testing.M) {
	if spec := os.Getenv("FB_TEST_APP"); spec != "" {
		os.Exit(testApp(spec))
	}
	if spec := os.Getenv("FB_TEST_REMOTE_APP"); spec != "" {
		os.Exit(testRemoteApp(spec))
	}
	os.Exit(m.Run())
}

func testApp(spec string) int {
	parts := strings.Split(spec, ",")
	port, _ := strconv.Atoi(parts[2])
	ctx := context.Background()
	c, err := control.DialLocal(ctx, parts[0], parts[1])
	if err != nil {
		fmt.Println(err)
		return 1
	}
	if _, _, err := c.RegisterLocal(ctx, 0, 0); err != nil {
		fmt.Println(err)
		return 1
	}
	if _, err := c.Listen(ctx, "tcp", netip.Addr{}, uint16(port)); err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Println("ready")
	<-c.Done()
	return 0
}

func dialApp(t *testing.T, d *Daemon, name string) *control.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := control.DialLocal(ctx, d.Config().Control.Socket, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, _, err := c.RegisterLocal(ctx, 0, 0); err != nil {
		t.Fatal(err)
	}
	return c
}

func listen(c *control.Client, port uint16) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := c.Listen(ctx, "tcp", netip.Addr{}, port)
	return err
}

func appPorts(d *Daemon, name string) []classifier.PortClaim {
	for _, a := range d.Apps() {
		if a.Name == name {
			return a.Ports
		}
	}
	return nil
}

func TestControlLocal(t *testing.T) {
	tp := newTopo(t)
	c := tp.config(t, fmt.Sprintf(`applications:
  - {name: web, ports: [80, 8080]}
listeners:
  - {id: 1, name: http, protocol: tcp, address: %s, port: 80, app: web}
`, tp.v.A.Addr4.Addr()))
	d := tp.start(t, c, io.Discard)
	defer d.Close()
	if fi, err := os.Stat(c.Control.Socket); err != nil || fi.Mode().Perm() != 0o660 {
		t.Fatalf("control socket: %v, %v", fi, err)
	}

	web := dialApp(t, d, "web")
	if err := listen(web, 8080); err != nil {
		t.Fatal(err)
	}
	ports := appPorts(d, "web")
	want := []classifier.PortClaim{{Proto: 6, Port: 80}, {Proto: 6, Port: 8080}}
	if fmt.Sprint(ports) != fmt.Sprint(want) {
		t.Errorf("web owns %v, want the configured listener's port and its own: %v", ports, want)
	}
	if err := listen(web, 9090); !errors.Is(err, control.ErrNotPermitted) {
		t.Errorf("listen outside the configured ports: %v", err)
	}
	other := dialApp(t, d, "other")
	if err := listen(other, 8080); !errors.Is(err, control.ErrPortInUse) {
		t.Errorf("second application on the same port: %v", err)
	}
	s := tp.scrape(t, d)
	if v := value(t, s, "fabricbridge_applications_connected"); v != 2 {
		t.Errorf("%v applications connected, want 2", v)
	}
	if v := value(t, s, "fabricbridge_application_claims", "app", "web", "kind", "listener"); v != 1 {
		t.Errorf("web holds %v listeners, want 1", v)
	}
}

// TestKilledAppFreesPorts kills an application process with SIGKILL and
// measures how long until another application can take its port.
func TestKilledAppFreesPorts(t *testing.T) {
	tp := newTopo(t)
	d := tp.start(t, tp.config(t, ""), io.Discard)
	defer d.Close()
	const port = 7000

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("FB_TEST_APP=%s,victim,%d", d.Config().Control.Socket, port))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer cmd.Process.Kill()
	line, _ := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		t.Fatalf("application: %q", line)
	}

	next := dialApp(t, d, "successor")
	if err := listen(next, port); !errors.Is(err, control.ErrPortInUse) {
		t.Fatalf("the victim's port is not held: %v", err)
	}
	killed := time.Now()
	if err := cmd.Process.Signal(os.Kill); err != nil {
		t.Fatal(err)
	}
	for {
		err := listen(next, port)
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
	freed := time.Since(killed)
	t.Logf("port free %v after SIGKILL", freed)
	for _, a := range d.Apps() {
		if a.Name == "victim" {
			t.Errorf("the victim is still registered: %+v", a)
		}
	}
}

func writeSecret(t *testing.T, dir, name, secret string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(secret+"\n"), mode); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestControlTCPSecret(t *testing.T) {
	tp := newTopo(t)
	secret := "0123456789abcdef-remote"
	sf := writeSecret(t, tp.dir, "remote.secret", secret, 0o600)
	addr := netip.AddrPortFrom(tp.v.A.Addr4.Addr(), 7070)
	apps := fmt.Sprintf("applications: [{name: remote, secret_file: %s}]\n", sf)
	tcp := fmt.Sprintf("  tcp: {address: %q, auth: secret}\n", addr)

	// A secret others may read is refused at start, with its location.
	os.Chmod(sf, 0o644)
	var err error
	tp.bridge.Do(func() error { _, err = Start(tp.config(t, apps, tcp), Options{Log: io.Discard}); return nil })
	if err == nil || !strings.Contains(err.Error(), "fabricbridge.yaml:8:") || !strings.Contains(err.Error(), "applications[0].secret_file: ") || !strings.Contains(err.Error(), "readable by others") {
		t.Fatalf("world-readable secret: %v", err)
	}
	os.Chmod(sf, 0o600)

	d := tp.start(t, tp.config(t, apps, tcp), io.Discard)
	defer d.Close()
	dial := func(name, s string) (c *control.Client, err error) {
		tp.outside.Do(func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			c, err = control.DialRemote(ctx, addr.String(), name, []byte(s))
			return nil
		})
		return c, err
	}
	c, err := dial("remote", secret)
	if err != nil {
		t.Fatalf("right secret: %v", err)
	}
	c.Close()
	if _, err := dial("remote", "0123456789abcdef-wrong"); !errors.Is(err, control.ErrAuth) {
		t.Errorf("wrong secret: %v", err)
	}
	if _, err := dial("stranger", secret); !errors.Is(err, control.ErrAuth) {
		t.Errorf("application without a secret: %v", err)
	}
}

// TestControlMutualTLS checks the server side of auth: tls: clients without
// a certificate from the configured CA never reach the control protocol;
// a client with one gets the protocol's hello answer (the HMAC exchange
// still follows, as with auth: secret).
func TestControlMutualTLS(t *testing.T) {
	tp := newTopo(t)
	ca := testpki.New(t, tp.dir)
	bridgeIP := tp.v.A.Addr4.Addr()
	srvCert, srvKey, _ := ca.Issue("bridge", bridgeIP, x509.ExtKeyUsageServerAuth)
	_, _, clientPair := ca.Issue("analysis", netip.Addr{}, x509.ExtKeyUsageClientAuth)
	other := testpki.New(t, t.TempDir())
	_, _, strangerPair := other.Issue("stranger", netip.Addr{}, x509.ExtKeyUsageClientAuth)
	sf := writeSecret(t, tp.dir, "shared.secret", "0123456789abcdef-shared", 0o600)
	addr := netip.AddrPortFrom(bridgeIP, 7071)
	d := tp.start(t, tp.config(t, "applications: [{name: analysis}]\n", fmt.Sprintf("  tcp:\n    address: %q\n    auth: tls\n    secret_file: %s\n    cert_file: %s\n    key_file: %s\n    client_ca_file: %s\n",
		addr, sf, srvCert, srvKey, ca.File)), io.Discard)
	defer d.Close()

	roots := ca.Pool()
	hello := func(certs []tls.Certificate) (map[string]any, error) {
		var conn *tls.Conn
		err := tp.outside.Do(func() (err error) {
			raw, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
			if err != nil {
				return err
			}
			conn = tls.Client(raw, &tls.Config{RootCAs: roots, ServerName: bridgeIP.String(), Certificates: certs})
			return nil
		})
		if err != nil {
			return nil, err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		nonce := make([]byte, control.NonceSize)
		body, _ := json.Marshal(control.Request{ID: 1, Op: "hello", Version: control.Version, App: "analysis", Nonce: nonce})
		frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
		if _, err := conn.Write(append(frame, body...)); err != nil {
			return nil, err
		}
		var n [4]byte
		if _, err := io.ReadFull(conn, n[:]); err != nil {
			return nil, err
		}
		rep := make([]byte, binary.BigEndian.Uint32(n[:]))
		if _, err := io.ReadFull(conn, rep); err != nil {
			return nil, err
		}
		var v map[string]any
		return v, json.Unmarshal(rep, &v)
	}
	rep, err := hello([]tls.Certificate{clientPair})
	if err != nil {
		t.Fatalf("client with a certificate from the CA: %v", err)
	}
	if rep["nonce"] == nil || rep["mac"] == nil || rep["error"] != nil {
		t.Errorf("hello reply: %v", rep)
	}
	if rep, err := hello(nil); err == nil {
		t.Errorf("client without a certificate got %v", rep)
	}
	if rep, err := hello([]tls.Certificate{strangerPair}); err == nil {
		t.Errorf("client with a certificate from another CA got %v", rep)
	}
}

// TestQuotas: the configured quotas reach the control server.
func TestQuotas(t *testing.T) {
	tp := newTopo(t)
	d := tp.start(t, tp.config(t, "applications:\n  - {name: small, quota: {ports: 1, max_slots: 2048}}\n"), io.Discard)
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := control.DialLocal(ctx, d.Config().Control.Socket, "small")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.RegisterLocal(ctx, 4096, 0); !errors.Is(err, control.ErrQuota) {
		t.Errorf("ring deeper than max_slots: %v", err)
	}
	if _, _, err := c.RegisterLocal(ctx, 2048, 2048); err != nil {
		t.Fatalf("rings within the quota: %v", err)
	}
	if err := listen(c, 8001); err != nil {
		t.Fatal(err)
	}
	if err := listen(c, 8002); !errors.Is(err, control.ErrQuota) {
		t.Errorf("second port with ports: 1: %v", err)
	}
	// The quota is the application's, not its connection's.
	if err := listen(dialApp(t, d, "small"), 8003); !errors.Is(err, control.ErrQuota) {
		t.Errorf("second port with ports: 1, through a second connection: %v", err)
	}
	// An application the list does not name gets unlisted_quota (here
	// default_quota's: a quarter of the reserved range).
	other := dialApp(t, d, "other")
	for p := range 3 {
		if err := listen(other, uint16(8100+p)); err != nil {
			t.Errorf("unlisted application, port %d: %v", 8100+p, err)
		}
	}
	s := tp.scrape(t, d)
	for reason, want := range map[string]float64{"quota_slots": 1, "quota_ports": 2, "quota_streams": 0} {
		if got := value(t, s, "fabricbridge_control_refusals_total", "reason", reason); got != want {
			t.Errorf("fabricbridge_control_refusals_total{reason=%q} = %v, want %v", reason, got, want)
		}
	}
}

// TestWhoMayRegister: refuse_unlisted and uids reach the control server.
func TestWhoMayRegister(t *testing.T) {
	tp := newTopo(t)
	d := tp.start(t, tp.config(t, "applications:\n  - {name: listed}\n  - {name: other-user, uids: [12345]}\n", "  refuse_unlisted: true\n"), io.Discard)
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	register := func(name string) error {
		c, err := control.DialLocal(ctx, d.Config().Control.Socket, name)
		if err != nil {
			return err
		}
		defer c.Close()
		_, _, err = c.RegisterLocal(ctx, 0, 0)
		return err
	}
	if err := register("listed"); err != nil {
		t.Errorf("listed application: %v", err)
	}
	if err := register("stranger"); err == nil {
		t.Error("an unlisted application registered despite refuse_unlisted")
	}
	if err := register("other-user"); err == nil {
		t.Errorf("uid %d registered as an application reserved for uid 12345", os.Getuid())
	}
}
