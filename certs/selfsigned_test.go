package certs

import (
	"bytes"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// TestSelfSigned: ca.pem is written, the leaf covers DOMAIN, *.DOMAIN,
// localhost, 127.0.0.1 and ::1 (checked by real handshakes trusting only
// ca.pem), and a restart reuses the CA.
func TestSelfSigned(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := Config{Mode: ModeSelfSigned, Domain: testDomain, DataDir: dir}
	m, err := startManager(t, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatalf("ca.pem: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("ca.pem holds no certificate")
	}
	ln := listenLoopback(t)
	serveTLS(t, ln, m)
	for _, name := range []string{testDomain, "app." + testDomain, "localhost", "127.0.0.1", "::1"} {
		conn, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: roots, ServerName: name})
		if err != nil {
			t.Errorf("handshake for %s: %v", name, err)
			continue
		}
		conn.Close()
	}
	if ln6, err := net.Listen("tcp", "[::1]:0"); err == nil {
		serveTLS(t, ln6, m)
		if _, _, err := get(t, roots, ln6.Addr().String(), "app."+testDomain); err != nil {
			t.Errorf("over ::1: %v", err)
		}
	}
	if na := m.NotAfter()[testDomain]; na.IsZero() {
		t.Errorf("NotAfter = %v", m.NotAfter())
	}

	m2, err := startManager(t, cfg, nil)
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	again, _ := os.ReadFile(filepath.Join(dir, CAFile))
	if !bytes.Equal(caPEM, again) {
		t.Fatal("restart replaced ca.pem")
	}
	leaf, err := m2.p.getCertificate(&tls.ClientHelloInfo{ServerName: testDomain})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.Leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: "app." + testDomain}); err != nil {
		t.Errorf("leaf after restart does not chain to the first CA: %v", err)
	}
}

// TestCloseBeforeStart: Close works on a Manager that never started (or
// failed to), and twice.
func TestCloseBeforeStart(t *testing.T) {
	for _, cfg := range []Config{
		{Mode: ModeSelfSigned, Domain: testDomain},
		{Mode: ModeFiles, Domain: testDomain, CertFiles: []string{"c"}, KeyFiles: []string{"k"}},
		{Mode: ModeAutocert, Domain: testDomain},
		{Mode: ModeCertmagic, Domain: testDomain, OnDemand: true},
	} {
		m, err := New(cfg, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.TLSConfig().GetCertificate(&tls.ClientHelloInfo{ServerName: testDomain}); err == nil {
			t.Errorf("%s: handshake before Start succeeded", cfg.Mode)
		}
		if err := m.Close(); err != nil {
			t.Errorf("%s: Close: %v", cfg.Mode, err)
		}
		if err := m.Close(); err != nil {
			t.Errorf("%s: second Close: %v", cfg.Mode, err)
		}
	}
}

// TestSelfSignedCAMadeOnce: edges starting at once on one fresh data dir
// (two `ngstone http` sharing a cache) all end with the same CA, its key
// the key of its certificate, and no temporary file left behind.
func TestSelfSignedCAMadeOnce(t *testing.T) {
	t.Parallel()
	for round := range 20 {
		dir := filepath.Join(t.TempDir(), "data")
		const n = 8
		cas := make([]*x509.Certificate, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				ca, key, err := loadOrCreateCA(dir, testLogger(t))
				if err == nil && !key.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(ca.PublicKey) {
					err = errors.New("the key is not the certificate's")
				}
				cas[i], errs[i] = ca, err
			})
		}
		wg.Wait()
		for i := range n {
			if errs[i] != nil {
				t.Fatalf("round %d, edge %d: %v", round, i, errs[i])
			}
			if !cas[i].Equal(cas[0]) {
				t.Fatalf("round %d: edge %d has another CA than edge 0", round, i)
			}
		}
		onDisk, key, err := loadCA(filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile))
		if err != nil || !onDisk.Equal(cas[0]) || !key.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(onDisk.PublicKey) {
			t.Fatalf("round %d: the CA on disk is not the one the edges use (%v)", round, err)
		}
		if left, _ := filepath.Glob(filepath.Join(dir, ".*")); len(left) > 0 {
			t.Fatalf("round %d: temporary files left: %v", round, left)
		}
	}
}
