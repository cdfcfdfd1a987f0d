package main

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance"
	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/testing/testpki"
	"github.com/fabricbridge/fabricbridge/internal/topology"
	"github.com/fabricbridge/fabricbridge/internal/topology/ethtool"
)

// TestRemoteAppMutualTLS: `fabricbridge app http --remote` with the --tls-*
// flags registers, from its own namespace (another node), with a daemon
// whose TCP control plane has auth: tls, and serves HTTP over GENEVE to the
// outside kernel. Without a certificate, with one from another CA, or
// trusting the wrong CA for the bridge, it is refused and registers nothing.
func TestRemoteAppMutualTLS(t *testing.T) {
	testenv.RequirePrivileged(t)
	br, outside, wire := topology.Pair(t, topology.VethOptions{})
	if err := ethtool.DisableTxChecksum(outside, wire.B.Name); err != nil {
		t.Fatal(err)
	}
	appNS := topology.New(t)
	link := topology.Connect(t, br, appNS, topology.VethOptions{MTU: 1600}) // room for GENEVE
	ctl := netip.AddrPortFrom(link.A.Addr4.Addr(), 7070)

	dir := t.TempDir()
	ca := testpki.New(t, dir)
	srvCert, srvKey, _ := ca.Issue("bridge", ctl.Addr(), x509.ExtKeyUsageServerAuth)
	appCert, appKey, _ := ca.Issue("far-http", netip.Addr{}, x509.ExtKeyUsageClientAuth)
	stranger := testpki.New(t, t.TempDir())
	strCert, strKey, _ := stranger.Issue("stranger", netip.Addr{}, x509.ExtKeyUsageClientAuth)
	secret := filepath.Join(dir, "shared.secret")
	if err := os.WriteFile(secret, []byte("0123456789abcdef-cluster\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "fb.yaml")
	text := fmt.Sprintf(`interfaces: [{name: %s}]
addresses: [%s]
metrics: {address: ""}
control:
  socket: %s
  tcp:
    address: %q
    auth: tls
    secret_file: %s
    cert_file: %s
    key_file: %s
    client_ca_file: %s
applications:
  - {name: far-http, ports: [80]}
listeners:
  - {id: 1, name: http, protocol: tcp, port: 80, app: far-http}
`, wire.A.Name, wire.A.Addr4.Addr(), filepath.Join(dir, "control.sock"), ctl, secret, srvCert, srvKey, ca.File)
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	var d *appliance.Daemon
	if err := br.Do(func() (err error) { d, err = appliance.Start(cfg, appliance.Options{Log: io.Discard}); return err }); err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	base := []string{"http", "--name", "far-http", "--remote", ctl.String(), "--secret-file", secret}
	for _, tc := range []struct {
		name  string
		flags []string
		want  string
	}{
		{"plain TCP (no --tls-*)", nil, ""},
		{"certificate of another CA", []string{"--tls-cert", strCert, "--tls-key", strKey, "--tls-ca", ca.File}, ""},
		{"bridge not trusted", []string{"--tls-cert", appCert, "--tls-key", appKey, "--tls-ca", stranger.File}, "certificate"},
		{"key without certificate", []string{"--tls-key", appKey, "--tls-ca", ca.File}, "--tls-cert and --tls-key"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		err := appNS.Do(func() error { return appCommand(ctx, append(append([]string{}, base...), tc.flags...), io.Discard) })
		cancel()
		switch {
		case err == nil:
			t.Errorf("%s: the application ran", tc.name)
		case !strings.Contains(err.Error(), tc.want):
			t.Errorf("%s: %v, want it to mention %q", tc.name, err, tc.want)
		case time.Since(start) > 4*time.Second:
			t.Errorf("%s: refused only after %v", tc.name, time.Since(start))
		default:
			t.Logf("%s: %v", tc.name, err)
		}
		if apps := d.Apps(); len(apps) != 0 {
			t.Fatalf("%s: registered %+v", tc.name, apps)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	const size = 100000
	runAppIn(t, ctx, appNS, append(base, "--tls-cert", appCert, "--tls-key", appKey, "--tls-ca", ca.File, "--size", fmt.Sprint(size))...)
	if apps := d.Apps(); len(apps) != 1 || apps[0].Name != "far-http" || apps[0].Listeners != 1 {
		t.Fatalf("registered: %+v", apps)
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, a string) (c net.Conn, err error) {
			err = outside.Do(func() (err error) { c, err = (&net.Dialer{}).DialContext(ctx, network, a); return err })
			return c, err
		}}}
	want := strings.Repeat("fabricbridge ", size/13+1)[:size]
	resp, err := client.Get(fmt.Sprintf("http://%s/", netip.AddrPortFrom(wire.A.Addr4.Addr(), 80)))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(got) != want {
		t.Fatalf("GET /: %d bytes (want %d), equal %v, %v", len(got), size, string(got) == want, err)
	}
	client.CloseIdleConnections()
	cancel()
	for deadline := time.Now().Add(time.Second); len(d.Apps()) != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("still registered after the application stopped: %+v", d.Apps())
		}
	}
}
