package certs

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// CA file names under the data directory.
const (
	CAFile    = "ca.pem"
	CAKeyFile = "ca-key.pem"
)

type selfSigned struct {
	cfg   Config
	log   *slog.Logger
	allow HostPolicy // for hostnames outside the domain
	leaf  *tls.Certificate
	ca    *x509.Certificate
	caKey crypto.Signer

	mu     sync.Mutex
	byHost map[string]*tls.Certificate
}

// maxHostLeaves bounds the per-host leaf cache; past it the cache starts over.
const maxHostLeaves = 4096

func (s *selfSigned) start(context.Context) error {
	ca, key, err := loadOrCreateCA(s.cfg.DataDir, s.log)
	if err != nil {
		return err
	}
	leaf, err := issueLeaf(ca, key, s.cfg.Domain)
	if err != nil {
		return fmt.Errorf("issue leaf for %s: %w", s.cfg.Domain, err)
	}
	s.leaf, s.ca, s.caKey = leaf, ca, key
	s.byHost = make(map[string]*tls.Certificate)
	return nil
}

// policyTimeout bounds the policy's answer for a handshake's name.
const policyTimeout = 5 * time.Second

// getCertificate serves the shared leaf, except for a single-label host
// under the domain, which gets a leaf of its own (clients refuse a wildcard
// directly under a top-level name such as *.localhost), and for a hostname
// outside the domain that the policy allows (an agent's own, bound), which
// gets one too; another name outside the domain gets the shared leaf,
// which the client will refuse for it.
func (s *selfSigned) getCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	if s.leaf == nil {
		return nil, errNotStarted
	}
	name := strings.TrimSuffix(strings.ToLower(hello.ServerName), ".")
	label, under := strings.CutSuffix(name, "."+s.cfg.Domain)
	switch {
	case under && (label == "" || strings.Contains(label, ".")):
		return s.leaf, nil
	case !under && (name == "" || name == s.cfg.Domain || net.ParseIP(name) != nil || s.allow == nil):
		return s.leaf, nil
	case !under:
		ctx, cancel := context.WithTimeout(hello.Context(), policyTimeout)
		err := s.allow(ctx, name)
		cancel()
		if err != nil {
			return s.leaf, nil
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if c := s.byHost[name]; c != nil {
		return c, nil
	}
	c, err := issueLeaf(s.ca, s.caKey, name)
	if err != nil {
		return nil, fmt.Errorf("issue leaf for %s: %w", name, err)
	}
	if len(s.byHost) >= maxHostLeaves {
		clear(s.byHost)
	}
	s.byHost[name] = c
	return c, nil
}

func (s *selfSigned) notAfter() map[string]time.Time { return leafNotAfter(s.leaf) }

// leafNotAfter keys c's expiry by its first name; empty for no certificate.
func leafNotAfter(c *tls.Certificate) map[string]time.Time {
	out := map[string]time.Time{}
	if c == nil || c.Leaf == nil {
		return out
	}
	name := c.Leaf.Subject.CommonName
	if len(c.Leaf.DNSNames) > 0 {
		name = c.Leaf.DNSNames[0]
	}
	out[name] = c.Leaf.NotAfter
	return out
}

func (s *selfSigned) reload() error { return nil }
func (s *selfSigned) close() error  { return nil }

// loadOrCreateCA returns the CA under dir, creating it on first use. The CA
// persists so that agents keep trusting the edge across restarts. Edges
// starting at once on one fresh dir (two `ngstone http` sharing a cache)
// end with one CA: the first to place its key makes it, the others read
// it (createCA).
func loadOrCreateCA(dir string, log *slog.Logger) (*x509.Certificate, crypto.Signer, error) {
	certPath, keyPath := filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile)
	ca, key, err := loadCA(certPath, keyPath)
	if !errors.Is(err, os.ErrNotExist) {
		if err != nil {
			return nil, nil, fmt.Errorf("data-dir %s: load CA: %w", dir, err)
		}
		return ca, key, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("data-dir %s: %w", dir, err)
	}
	ca, key, err = createCA(certPath, keyPath)
	if errors.Is(err, fs.ErrExist) {
		// Another edge placed its key first: its certificate follows.
		return awaitCA(dir, certPath, keyPath)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("data-dir %s: create CA: %w", dir, err)
	}
	log.Info("created self-signed CA; give it to agents with --ca-file", "ca_file", certPath)
	return ca, key, nil
}

// loadCA reads the CA's certificate and key; an error matching
// os.ErrNotExist when either is missing.
func loadCA(certPath, keyPath string) (*x509.Certificate, crypto.Signer, error) {
	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return nil, nil, err
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, nil, fmt.Errorf("%s holds no signing key", CAKeyFile)
	}
	return pair.Leaf, signer, nil
}

// awaitCA waits (up to caWait) for the CA another edge is creating in dir.
func awaitCA(dir, certPath, keyPath string) (*x509.Certificate, crypto.Signer, error) {
	deadline := time.Now().Add(caWait)
	for {
		ca, key, err := loadCA(certPath, keyPath)
		if err == nil || time.Now().After(deadline) {
			if err != nil {
				err = fmt.Errorf("data-dir %s: another process began a CA there and did not finish it in %s: %w (remove %s to start over)", dir, caWait, err, CAKeyFile)
			}
			return ca, key, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// caWait bounds the wait for a CA another edge is writing: a few file
// writes, unless it died half way.
const caWait = 5 * time.Second

// createCA makes a CA and places its key at keyPath, then its certificate
// at certPath. The key is placed with a hard link, which fails (fs.ErrExist)
// where another process placed one first; the certificate replaces any
// left without its key.
func createCA(certPath, keyPath string) (*x509.Certificate, crypto.Signer, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          randomSerial(),
		Subject:               pkix.Name{CommonName: "ngstone self-signed CA", Organization: []string{"ngstone"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	keyTmp, err := writeTempPEM(keyPath, "PRIVATE KEY", keyDER, 0o600)
	if err != nil {
		return nil, nil, err
	}
	defer os.Remove(keyTmp)
	if err := os.Link(keyTmp, keyPath); err != nil {
		return nil, nil, err
	}
	certTmp, err := writeTempPEM(certPath, "CERTIFICATE", der, 0o644)
	if err == nil {
		err = os.Rename(certTmp, certPath)
	}
	if err != nil {
		os.Remove(keyPath) // no key without its certificate: the next start makes both
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	return ca, key, err
}

func issueLeaf(ca *x509.Certificate, caKey crypto.Signer, domain string) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	dns := []string{domain, "*." + domain}
	if domain != "localhost" {
		dns = append(dns, "localhost", "*.localhost")
	} else {
		dns = append(dns, "*.localhost")
	}
	tmpl := &x509.Certificate{
		SerialNumber: randomSerial(),
		Subject:      pkix.Name{CommonName: domain, Organization: []string{"ngstone"}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().AddDate(1, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     uniq(dns),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &tls.Certificate{Certificate: [][]byte{der, ca.Raw}, PrivateKey: key, Leaf: leaf}, nil
}

func uniq(s []string) []string {
	seen := map[string]bool{}
	out := s[:0]
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}

func randomSerial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand never fails on supported platforms
	}
	return n
}

// writeTempPEM writes der as PEM to a new file beside path and returns its
// name.
func writeTempPEM(path, typ string, der []byte, mode os.FileMode) (string, error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return "", err
	}
	_, err = f.Write(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}))
	if err == nil {
		err = f.Chmod(mode)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}
