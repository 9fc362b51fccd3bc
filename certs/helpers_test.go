package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/acmetest"
)

// testDomain is the edge's domain in these tests.
const testDomain = "ngstone.test"

// startACME runs a DNS server authoritative for testDomain and pebble
// resolving through it, validating HTTP-01 on httpPort and TLS-ALPN-01 on
// tlsPort (zero: nowhere).
func startACME(t *testing.T, httpPort, tlsPort int) (*acmetest.DNS, *acmetest.CA) {
	t.Helper()
	d := acmetest.StartDNS(t, testDomain)
	return d, acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr, HTTPPort: httpPort, TLSPort: tlsPort})
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// serveStarted starts a Manager of cfg and serves TLS with it on a
// loopback listener, until the test ends.
func serveStarted(t *testing.T, cfg Config, policy HostPolicy) (*Manager, net.Listener) {
	t.Helper()
	m, err := startManager(t, cfg, policy)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	ln := listenLoopback(t)
	serveTLS(t, ln, m)
	return m, ln
}

// serveTLS runs an HTTPS server on a loopback listener with m's TLS config;
// it answers "hello HOST".
func serveTLS(t *testing.T, ln net.Listener, m *Manager) {
	t.Helper()
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "hello %s", r.Host)
		}),
		TLSConfig:         m.TLSConfig(),
		ErrorLog:          m.ErrorLog(),
		ReadHeaderTimeout: 10 * time.Second,
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.ServeTLS(ln, "", "")
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
}

// serveHTTP runs a plain HTTP server on ln with h.
func serveHTTP(t *testing.T, ln net.Listener, h http.Handler) {
	t.Helper()
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
}

// get fetches https://host/ through addr, trusting roots, and returns the
// body, or the error.
func get(t *testing.T, roots *x509.CertPool, addr, host string) (string, *x509.Certificate, error) {
	t.Helper()
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: host},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
		ForceAttemptHTTP2: true,
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	resp, err := client.Get("https://" + host + "/")
	if err != nil {
		return "", nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), resp.TLS.PeerCertificates[0], err
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

func portOf(ln net.Listener) int { return ln.Addr().(*net.TCPAddr).Port }

func testLogger(t *testing.T) *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// allowOnly is a HostPolicy allowing the given hosts.
func allowOnly(hosts ...string) HostPolicy {
	return func(_ context.Context, host string) error {
		for _, h := range hosts {
			if h == host {
				return nil
			}
		}
		return fmt.Errorf("%s is not bound", host)
	}
}

// checkNoSNI handshakes with addr sending no SNI, as a client that dialed
// an IP address does, and checks that the certificate served chains to
// roots and is valid for testDomain.
func checkNoSNI(t *testing.T, addr string, roots *x509.CertPool) {
	t.Helper()
	conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatalf("handshake without SNI: %v", err)
	}
	defer conn.Close()
	chain := conn.ConnectionState().PeerCertificates
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, DNSName: testDomain}); err != nil {
		t.Errorf("certificate served without SNI: %v", err)
	}
}
