// Package acmetest runs, in-process and on loopback only, what tests of
// ACME issuance need: pebble as the ACME CA (CA), a DNS server
// authoritative for the test domain that takes RFC 2136 updates, so that a
// real DNS provider solves DNS-01 against it (DNS), and relays that carry
// pebble's HTTP-01 and TLS-ALPN-01 validations to listeners bound after
// pebble started (Relay).
//
// It is test support: only _test.go files import it. Everything it starts
// stops at the end of the test that started it, pebble's validation
// dispatcher included.
package acmetest

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"unsafe"

	"github.com/letsencrypt/pebble/v2/ca"
	"github.com/letsencrypt/pebble/v2/db"
	"github.com/letsencrypt/pebble/v2/va"
	"github.com/letsencrypt/pebble/v2/wfe"
)

// CA is an in-process pebble ACME server on loopback.
type CA struct {
	// DirectoryURL is the ACME directory (certs.Config.ACMECA).
	DirectoryURL string
	// RootFile is a PEM file of the directory's own HTTPS certificate
	// (certs.Config.ACMECARoot).
	RootFile string
	// Roots holds only pebble's issuing root, as its management interface
	// hands it out: what a visitor trusts.
	Roots *x509.CertPool
}

// CAConfig says where pebble's validation authority looks.
type CAConfig struct {
	// DNS is the resolver (HOST:PORT) the VA asks for TXT and A records.
	// Required: empty would mean the system's resolvers.
	DNS string
	// HTTPPort and TLSPort are the loopback ports the VA connects to for
	// HTTP-01 and TLS-ALPN-01; zero means pebble's defaults (5002, 5001),
	// where nothing listens in a test, so those challenges fail.
	HTTPPort, TLSPort int
}

// StartCA runs pebble until the end of the test. Its log goes to t.Log
// when PEBBLE_TEST_LOG is set.
func StartCA(t testing.TB, cfg CAConfig) *CA {
	t.Helper()
	if cfg.DNS == "" {
		t.Fatal("acmetest.StartCA: CAConfig.DNS is required")
	}
	pebbleEnv()
	logger := log.New(io.Discard, "", 0)
	if os.Getenv("PEBBLE_TEST_LOG") != "" {
		logger = log.New(testWriter{t}, "pebble ", 0)
	}
	store := db.NewMemoryStore()
	authority := ca.New(logger, store, "", "ecdsa", 0, 1, map[string]ca.Profile{"default": {Description: "default"}})
	validator := va.New(logger, cfg.HTTPPort, cfg.TLSPort, false, cfg.DNS, store)
	// Cleanups run last-in first-out: the VA's queue is closed only after
	// both servers below have finished every request, so nothing sends on
	// it any more.
	t.Cleanup(func() { stopVA(t, validator) })
	front := wfe.New(logger, store, validator, authority, []string{"pebble.letsencrypt.org"}, false, false, 0, 0)

	acmeSrv := startTLS(t, front.Handler())
	mgmt := startTLS(t, front.ManagementHandler())
	return &CA{
		DirectoryURL: acmeSrv.URL + wfe.DirectoryPath,
		RootFile:     writeCertPEM(t, acmeSrv.Certificate()),
		Roots:        fetchRoot(t, mgmt),
	}
}

// pebbleEnv sets the knobs pebble reads from the environment when a VA or
// WFE is made: no random sleep before validating, no deliberately rejected
// nonces. Challenges are still really validated.
var pebbleEnv = sync.OnceFunc(func() {
	os.Setenv("PEBBLE_VA_NOSLEEP", "1")
	os.Setenv("PEBBLE_WFE_NONCEREJECT", "0")
})

func startTLS(t testing.TB, h http.Handler) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

func writeCertPEM(t testing.TB, cert *x509.Certificate) string {
	path := filepath.Join(t.TempDir(), "acme-server.pem")
	b := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// fetchRoot gets pebble's issuing root from its management interface, the
// way an operator of a test CA would.
func fetchRoot(t testing.TB, mgmt *httptest.Server) *x509.CertPool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, mgmt.URL+wfe.RootCertPath+"0", nil)
	if err != nil {
		t.Fatal(err)
	}
	client := mgmt.Client()
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("fetch pebble root: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("fetch pebble root: %s %v", resp.Status, err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(b) {
		t.Fatalf("fetch pebble root: no PEM certificate in %q", b)
	}
	return roots
}

// stopVA ends the dispatcher goroutine that va.New starts and pebble never
// stops, by closing the VA's task queue (an unexported field: pebble has
// no API for it). A pebble that renames the field fails the test here
// rather than leaking.
func stopVA(t testing.TB, v *va.VAImpl) {
	f := reflect.ValueOf(v).Elem().FieldByName("tasks")
	if !f.IsValid() || f.Kind() != reflect.Chan {
		t.Errorf("acmetest: pebble's VAImpl has no tasks channel (%v); update stopVA", f.Kind())
		return
	}
	reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().Close()
}

// testWriter sends log lines to t.Log.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// CertmagicLeaks are the goroutines certmagic leaves behind by design, for
// goleak.VerifyTestMain in packages that run it.
var CertmagicLeaks = []goleak.Option{
	// certmagic keeps one ACME rate limiter per CA and account in a
	// package-level map, never stopped.
	goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.(*RingBufferRateLimiter).loop"),
	// certmagic refreshes a storage lock file every 5s until it sees the
	// file gone, so it outlives the unlock by up to 5s.
	goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.keepLockfileFresh"),
}
