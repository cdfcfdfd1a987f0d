// Package testpki makes throwaway certificate authorities and certificates
// for tests of mutual TLS: a CA, and certificates it signs for servers (with
// an IP address to verify) and clients, written to files as the daemon and
// the command line read them.
package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a certificate authority valid for an hour around its creation.
type CA struct {
	// File is the CA certificate in PEM, for client_ca_file or --tls-ca.
	File string
	// PEM is the same certificate in memory.
	PEM []byte

	t      testing.TB
	dir    string
	key    *ecdsa.PrivateKey
	cert   *x509.Certificate
	serial int64
}

// New makes a CA whose files go to dir.
func New(t testing.TB, dir string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{t: t, dir: dir, key: key, cert: cert, serial: 1}
	ca.PEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	ca.File = filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca.File, ca.PEM, 0o644); err != nil {
		t.Fatal(err)
	}
	return ca
}

// Pool is a certificate pool holding the CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// Issue signs a certificate for name (with ip as its address, if valid)
// for usage (x509.ExtKeyUsageServerAuth or ClientAuth), writes name.pem and
// name.key (0600) beside the CA, and returns their paths and the pair.
func (ca *CA) Issue(name string, ip netip.Addr, usage x509.ExtKeyUsage) (certFile, keyFile string, pair tls.Certificate) {
	ca.t.Helper()
	ca.serial++
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		ca.t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(ca.serial), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	if ip.IsValid() {
		tmpl.IPAddresses = []net.IP{ip.AsSlice()}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		ca.t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		ca.t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
	certFile, keyFile = filepath.Join(ca.dir, name+".pem"), filepath.Join(ca.dir, name+".key")
	if err := os.WriteFile(certFile, certPEM, 0o644); err != nil {
		ca.t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, keyPEM, 0o600); err != nil {
		ca.t.Fatal(err)
	}
	if pair, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		ca.t.Fatal(err)
	}
	return certFile, keyFile, pair
}
