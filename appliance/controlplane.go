package appliance

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/control"
	"github.com/fabricbridge/fabricbridge/fabric"
)

// static is the configuration's classification in the control server's
// terms: rules bound to no application, and each application's listeners
// and steer rules, installed while it is registered.
func static(cfg *config.Config) control.Static {
	rules, apps := cfg.Classification()
	st := control.Static{Rules: rules, Apps: map[string]control.AppStatic{}}
	for name, e := range apps {
		st.Apps[name] = control.AppStatic{Listeners: e.Listeners, Rules: e.Rules}
	}
	return st
}

func portRanges(rs []config.PortRange) []classifier.PortRange {
	out := make([]classifier.PortRange, len(rs))
	for i, r := range rs {
		out[i] = r.Classifier()
	}
	return out
}

func addrs(as []config.Addr) []netip.Addr {
	out := make([]netip.Addr, len(as))
	for i, a := range as {
		out[i] = a.Addr
	}
	return out
}

// controlConfig maps the configuration onto the control server's.
func controlConfig(cfg *config.Config, dp control.Dataplane, remote *fabric.Remote, log *slog.Logger) (control.Config, error) {
	cc := control.Config{
		Dataplane:      dp,
		Addrs:          addrs(cfg.Addresses),
		Ephemeral:      cfg.ReservedPorts.Classifier(),
		Stream:         fabric.Config{RxSlots: cfg.Streams.RxSlots, TxSlots: cfg.Streams.TxSlots, SlotSize: int(cfg.Streams.SlotSize)},
		Static:         static(cfg),
		FirstDynamicID: config.MaxStaticID + 1,
		Default:        policy(cfg.QuotaOf("")),
		RefuseUnlisted: cfg.Control.RefuseUnlisted,
		Apps:           map[string]control.Policy{},
		Secrets:        map[string][]byte{},
		Remote:         remote,
		Spread:         cfg.Spread.Control(),
		Logger:         log,
	}
	for _, w := range cfg.Warnings {
		if log == nil {
			break
		}
		log.Warn("configuration", "warning", w)
	}
	if f := cfg.Control.TCP.SecretFile; f != "" {
		secret, err := readSecret(f)
		if err != nil {
			return cc, cfg.Errorf("control.tcp.secret_file", "%v", err)
		}
		cc.Secret = secret
	}
	if ifc, err := net.InterfaceByName(cfg.Interfaces[0].Name); err == nil {
		cc.MTU = ifc.MTU
	}
	for i, a := range cfg.Applications {
		pol := policy(cfg.QuotaOf(a.Name))
		pol.ListenPorts, pol.UIDs = portRanges(a.Ports), a.UIDs
		cc.Apps[a.Name] = pol
		if a.SecretFile == "" {
			continue
		}
		field := fmt.Sprintf("applications[%d].secret_file", i)
		secret, err := readSecret(a.SecretFile)
		if err != nil {
			return cc, cfg.Errorf(field, "%v", err)
		}
		cc.Secrets[a.Name] = secret
	}
	return cc, nil
}

// policy is a quota in the control server's terms.
func policy(q config.Quota) control.Policy {
	return control.Policy{MaxPorts: q.Ports, MaxFlows: q.Flows, MaxStreams: q.Streams,
		MaxRingBytes: int64(q.RingBytes), MaxSlots: q.MaxSlots}
}

// readSecret reads a secret file, refusing one that others may read.
func readSecret(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%s is readable by others (mode %04o); chmod 600 it", path, fi.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	if len(b) < control.MinSecretSize {
		return nil, fmt.Errorf("%s holds %d bytes; a secret needs at least %d", path, len(b), control.MinSecretSize)
	}
	return b, nil
}

// listenUnix opens the local control socket with the configured mode.
func listenUnix(cfg *config.Config) (*net.UnixListener, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: cfg.Control.Socket, Net: "unix"})
	if err != nil {
		return nil, cfg.Errorf("control.socket", "%v", err)
	}
	if err := os.Chmod(cfg.Control.Socket, os.FileMode(cfg.Control.SocketMode)); err != nil {
		ln.Close()
		return nil, cfg.Errorf("control.socket_mode", "%v", err)
	}
	return ln, nil
}

// listenTCP opens the remote control port, inside mutual TLS if so
// configured, and the GENEVE endpoint of the remote transport.
func listenTCP(cfg *config.Config) (net.Listener, *fabric.Remote, error) {
	t := cfg.Control.TCP
	geneve := string(t.Geneve)
	if geneve == "" {
		host, _, _ := net.SplitHostPort(string(t.Address))
		geneve = net.JoinHostPort(host, strconv.Itoa(fabric.GenevePort))
	}
	gap, err := netip.ParseAddrPort(geneve)
	if err != nil {
		return nil, nil, cfg.Errorf("control.tcp.geneve", "%q: %v", geneve, err)
	}
	var tlsCfg *tls.Config
	if t.Auth == config.AuthTLS {
		if tlsCfg, err = serverTLS(cfg); err != nil {
			return nil, nil, err
		}
	}
	ln, err := net.Listen("tcp", string(t.Address))
	if err != nil {
		return nil, nil, cfg.Errorf("control.tcp.address", "%v", err)
	}
	remote, err := fabric.ListenRemote(gap, fabric.RemoteConfig{SlotSize: int(cfg.Streams.SlotSize)})
	if err != nil {
		ln.Close()
		return nil, nil, cfg.Errorf("control.tcp.geneve", "%v", err)
	}
	if tlsCfg != nil {
		ln = tls.NewListener(ln, tlsCfg)
	}
	return ln, remote, nil
}

// serverTLS is mutual TLS: the bridge's certificate, and client
// certificates required and checked against the configured CA.
func serverTLS(cfg *config.Config) (*tls.Config, error) {
	t := cfg.Control.TCP
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, cfg.Errorf("control.tcp.cert_file", "%v", err)
	}
	pem, err := os.ReadFile(t.ClientCAFile)
	if err != nil {
		return nil, cfg.Errorf("control.tcp.client_ca_file", "%v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, cfg.Errorf("control.tcp.client_ca_file", "%s holds no PEM certificate", t.ClientCAFile)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		MinVersion:   tls.VersionTLS13,
	}, nil
}
