package certs

import (
	"bufio"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testPKI is a CA that issues leaves for files mode.
type testPKI struct {
	ca    *x509.Certificate
	key   crypto.Signer
	n     int // pairs written
	roots *x509.CertPool
	dir   string
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	dir := t.TempDir()
	ca, key, err := createCA(filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	return &testPKI{ca: ca, key: key, roots: roots, dir: dir}
}

// writePair issues a leaf for domain and writes it to cert.pem and key.pem,
// returning its serial number.
func (p *testPKI) writePair(t *testing.T, domain string) string {
	t.Helper()
	return p.writePairAs(t, "", domain)
}

// writePairAs writes the pair to PREFIXcert.pem and PREFIXkey.pem.
func (p *testPKI) writePairAs(t *testing.T, prefix, domain string) string {
	t.Helper()
	leaf, err := issueLeaf(p.ca, p.key, domain)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(leaf.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leaf.Certificate[0]})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	// Write the key first, then the cert; both through rename, as an
	// operator's tooling would.
	for _, f := range []struct {
		name string
		data []byte
	}{{prefix + "key.pem", keyPEM}, {prefix + "cert.pem", certPEM}} {
		path := filepath.Join(p.dir, f.name)
		if err := os.WriteFile(path+".tmp", f.data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	// Coarse file systems may keep the old mtime; push it forward.
	p.n++
	future := time.Now().Add(time.Duration(p.n) * time.Second)
	for _, n := range []string{prefix + "key.pem", prefix + "cert.pem"} {
		_ = os.Chtimes(filepath.Join(p.dir, n), future, future)
	}
	return leaf.Leaf.SerialNumber.String()
}

// servedSerial makes a fresh TLS handshake and returns the leaf's serial.
func servedSerial(t *testing.T, addr string, roots *x509.CertPool) string {
	t.Helper()
	return servedSerialFor(t, addr, roots, "app."+testDomain)
}

func servedSerialFor(t *testing.T, addr string, roots *x509.CertPool, name string) string {
	t.Helper()
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: roots, ServerName: name})
	if err != nil {
		t.Fatalf("handshake: %v", err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
}

// keepAlive is one open HTTPS connection used for several requests.
type keepAlive struct {
	conn *tls.Conn
	r    *bufio.Reader
}

func dialKeepAlive(t *testing.T, addr string, roots *x509.CertPool) *keepAlive {
	t.Helper()
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: roots, ServerName: "app." + testDomain, NextProtos: []string{"http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &keepAlive{conn: conn, r: bufio.NewReader(conn)}
}

func (k *keepAlive) get(t *testing.T) {
	t.Helper()
	_ = k.conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(k.conn, "GET / HTTP/1.1\r\nHost: app.%s\r\n\r\n", testDomain)
	resp, err := http.ReadResponse(k.r, nil)
	if err != nil {
		t.Fatalf("request on the old connection: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

// TestFilesPicksUpReplacedCertificate: polling sees a replaced pair and
// serves it to new handshakes, while a connection opened before keeps
// working.
func TestFilesPicksUpReplacedCertificate(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	first := pki.writePair(t, testDomain)
	cfg := Config{Mode: ModeFiles, Domain: testDomain, CertFiles: []string{filepath.Join(pki.dir, "cert.pem")},
		KeyFiles: []string{filepath.Join(pki.dir, "key.pem")}, ReloadInterval: 10 * time.Millisecond}
	m, ln := serveStarted(t, cfg, nil)
	addr := ln.Addr().String()
	if got := servedSerial(t, addr, pki.roots); got != first {
		t.Fatalf("serving %s, want %s", got, first)
	}
	old := dialKeepAlive(t, addr, pki.roots)
	old.get(t)

	second := pki.writePair(t, testDomain)
	waitFor(t, 5*time.Second, "the replaced certificate to be served", func() bool {
		return servedSerial(t, addr, pki.roots) == second
	})
	old.get(t)
	if na := m.NotAfter()[testDomain]; na.Before(time.Now()) {
		t.Errorf("NotAfter = %v", m.NotAfter())
	}
}

// TestFilesReload: with polling off, Reload (SIGHUP) swaps the pair at
// once; a broken pair is refused and the old one kept.
func TestFilesReload(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	first := pki.writePair(t, testDomain)
	cfg := Config{Mode: ModeFiles, Domain: testDomain, CertFiles: []string{filepath.Join(pki.dir, "cert.pem")},
		KeyFiles: []string{filepath.Join(pki.dir, "key.pem")}, ReloadInterval: -1}
	m, ln := serveStarted(t, cfg, nil)
	addr := ln.Addr().String()

	second := pki.writePair(t, testDomain)
	if got := servedSerial(t, addr, pki.roots); got != first {
		t.Fatalf("serving %s before Reload, want %s", got, first)
	}
	if err := m.Reload(); err != nil {
		t.Fatalf("Reload: %v", err)
	}
	if got := servedSerial(t, addr, pki.roots); got != second {
		t.Fatalf("serving %s after Reload, want %s", got, second)
	}

	if err := os.WriteFile(cfg.KeyFiles[0], []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := m.Reload(); err == nil {
		t.Fatal("Reload of a broken key succeeded")
	}
	if got := servedSerial(t, addr, pki.roots); got != second {
		t.Fatalf("serving %s after a failed Reload, want the old %s", got, second)
	}
}

// TestFilesSeveralPairs: with several pairs, each handshake gets the pair
// covering its server name (the edge's for its domain, an agent's own
// hostname's for that name), the first for a name none covers; a changed
// second pair is picked up, and one that does not load keeps them all.
func TestFilesSeveralPairs(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	edgeSerial := pki.writePair(t, testDomain)
	ownSerial := pki.writePairAs(t, "own-", "example.org")
	cfg := Config{Mode: ModeFiles, Domain: testDomain,
		CertFiles:      []string{filepath.Join(pki.dir, "cert.pem"), filepath.Join(pki.dir, "own-cert.pem")},
		KeyFiles:       []string{filepath.Join(pki.dir, "key.pem"), filepath.Join(pki.dir, "own-key.pem")},
		ReloadInterval: -1}
	m, ln := serveStarted(t, cfg, nil)
	addr := ln.Addr().String()
	if got := servedSerialFor(t, addr, pki.roots, "app."+testDomain); got != edgeSerial {
		t.Errorf("app.%s got %s, want the edge's pair %s", testDomain, got, edgeSerial)
	}
	if got := servedSerialFor(t, addr, pki.roots, "app.example.org"); got != ownSerial {
		t.Errorf("app.example.org got %s, want its own pair %s", got, ownSerial)
	}
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pki.roots, ServerName: "app.other.example"})
	if err == nil {
		conn.Close()
		t.Error("a name no pair covers was accepted by the client")
	} else if !strings.Contains(err.Error(), "app.other.example") {
		t.Errorf("a name no pair covers: %v, want a name mismatch", err)
	}
	if na := m.NotAfter(); len(na) != 2 {
		t.Errorf("NotAfter = %v, want both pairs", na)
	}

	renewed := pki.writePairAs(t, "own-", "example.org")
	if err := m.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := servedSerialFor(t, addr, pki.roots, "app.example.org"); got != renewed {
		t.Errorf("after Reload app.example.org got %s, want %s", got, renewed)
	}
	if err := os.WriteFile(cfg.KeyFiles[1], []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := m.Reload(); err == nil || !strings.Contains(err.Error(), "own-cert.pem") {
		t.Fatalf("Reload of a broken second pair: %v, want an error naming it", err)
	}
	if got := servedSerialFor(t, addr, pki.roots, "app.example.org"); got != renewed {
		t.Errorf("after a failed Reload app.example.org got %s, want the old %s", got, renewed)
	}
	if _, err := New(Config{Mode: ModeFiles, Domain: testDomain, CertFiles: cfg.CertFiles, KeyFiles: cfg.KeyFiles[:1]}, nil, nil); err == nil || !strings.Contains(err.Error(), "pairs") {
		t.Errorf("2 certs, 1 key: %v, want refused", err)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
