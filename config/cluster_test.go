package config_test

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
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func loadCluster(t *testing.T, args ...string) (clusterSettings, error) {
	t.Helper()
	clearNgstoneEnv(t)
	base := []string{"--domain", "tunnels.example.com", "--data-dir", t.TempDir(),
		"--cluster-etcd", "https://etcd.example.com:2379", "--cluster-key", strings.Repeat("k", 32)}
	c, err := loadEdge(t, append(base, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Load(); err != nil {
		t.Fatal(err)
	}
	cl, err := c.Cluster()
	return clusterSettings{cl.LeaseTTL, cl.RouteStaleness}, err
}

type clusterSettings struct{ ttl, staleness time.Duration }

// TestClusterRouteStaleness: --cluster-route-staleness defaults to 2s, or
// a fifth of a lease TTL below 10s, and is refused beyond the TTL or below
// 0 with an error that names it.
func TestClusterRouteStaleness(t *testing.T) {
	tests := map[string]struct {
		args []string
		want clusterSettings
		err  string
	}{
		"default":       {want: clusterSettings{60 * time.Second, 2 * time.Second}},
		"short ttl":     {args: []string{"--cluster-lease-ttl", "5s"}, want: clusterSettings{5 * time.Second, time.Second}},
		"set":           {args: []string{"--cluster-route-staleness", "500ms"}, want: clusterSettings{60 * time.Second, 500 * time.Millisecond}},
		"beyond ttl":    {args: []string{"--cluster-route-staleness", "61s"}, err: "cluster-route-staleness"},
		"negative":      {args: []string{"--cluster-route-staleness", "-1s"}, err: "cluster-route-staleness"},
		"the whole ttl": {args: []string{"--cluster-route-staleness", "60s"}, want: clusterSettings{60 * time.Second, 60 * time.Second}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got, err := loadCluster(t, tc.args...)
			switch {
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("error %v, want one naming %s", err, tc.err)
			case tc.err == "" && (err != nil || got != tc.want):
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

// TestEtcdTLSReloadsClientCertificate: the etcd client certificate is read
// again when its files change, so a rotated certificate serves the next
// connection; a rotation caught half-written (certificate and key that do
// not match) keeps the last good pair in use.
func TestEtcdTLSReloadsClientCertificate(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "client.pem"), filepath.Join(dir, "client-key.pem")
	caCert, caKey := newCA(t)
	first, firstKey := issue(t, caCert, caKey, 1)
	second, secondKey := issue(t, caCert, caKey, 2)
	write(t, certFile, first)
	write(t, keyFile, firstKey)
	clearNgstoneEnv(t)
	c, err := loadEdge(t, "--domain", "tunnels.example.com", "--data-dir", dir,
		"--cluster-etcd", "https://127.0.0.1:2379", "--cluster-key", strings.Repeat("k", 32),
		"--cluster-etcd-cert", certFile, "--cluster-etcd-key", keyFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Load(); err != nil {
		t.Fatal(err)
	}
	cl, err := c.Cluster()
	if err != nil {
		t.Fatal(err)
	}
	tc, err := cl.EtcdTLS(nil)
	if err != nil {
		t.Fatal(err)
	}
	tc.InsecureSkipVerify = true // the server's certificate is not the point
	addr := clientCertServer(t, caCert)
	if got := presented(t, addr, tc); got != 1 {
		t.Fatalf("first connection presented certificate %d, want 1", got)
	}
	write(t, certFile, second)
	if got := presented(t, addr, tc); got != 1 {
		t.Fatalf("with the new certificate beside the old key: presented %d, want the last good pair (1)", got)
	}
	write(t, keyFile, secondKey)
	if got := presented(t, addr, tc); got != 2 {
		t.Fatalf("after the rotation: presented certificate %d, want 2", got)
	}
}

func write(t *testing.T, name string, b []byte) {
	t.Helper()
	// Through a rename, as rotation tools do: the file is never half-written.
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, name); err != nil {
		t.Fatal(err)
	}
}

func newCA(t *testing.T) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(100), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// issue returns a client certificate with serial number n, and its key, as PEM.
func issue(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, n int64) ([]byte, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(n), Subject: pkix.Name{CommonName: "edge"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

// clientCertServer accepts TLS connections that present a certificate of
// ca, and writes back the certificate's serial number.
func clientCertServer(t *testing.T, ca *x509.Certificate) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "etcd"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		ClientAuth:   tls.RequireAndVerifyClientCert, ClientCAs: pool,
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			tc := c.(*tls.Conn)
			tc.SetDeadline(time.Now().Add(5 * time.Second))
			if tc.Handshake() == nil {
				if peers := tc.ConnectionState().PeerCertificates; len(peers) > 0 {
					tc.Write([]byte(peers[0].SerialNumber.String()))
				}
			}
			tc.Close()
		}
	}()
	return ln.Addr().String()
}

// presented connects with tc and returns the serial number the server saw.
func presented(t *testing.T, addr string, tc *tls.Config) int64 {
	t.Helper()
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, tc)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 32)
	n, _ := c.Read(b)
	serial, ok := new(big.Int).SetString(string(b[:n]), 10)
	if !ok {
		t.Fatalf("the server answered %q", b[:n])
	}
	return serial.Int64()
}
