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
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
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

	orders    atomic.Int64
	closeOnce sync.Once
	closers   []func()
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
	// Addr is the loopback HOST:PORT of the ACME directory; empty means a
	// free port. A CA started again on the Addr of one that was closed has
	// the same DirectoryURL and none of its accounts: a CA that lost its
	// state.
	Addr string
	// CertValidity is the lifetime of the certificates issued; zero means
	// pebble's 90 days.
	CertValidity time.Duration
}

// StartCA runs pebble until Close or the end of the test. Its log goes to
// t.Log when PEBBLE_TEST_LOG is set.
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
	c := &CA{}
	t.Cleanup(c.Close)
	store := db.NewMemoryStore()
	profile := ca.Profile{Description: "default", ValidityPeriod: uint64(cfg.CertValidity / time.Second)}
	authority := ca.New(logger, store, "", "ecdsa", 0, 1, map[string]ca.Profile{"default": profile})
	validator := va.New(logger, cfg.HTTPPort, cfg.TLSPort, false, cfg.DNS, store)
	// Closers run last-in first-out: the VA's queue is closed only after
	// both servers below have finished every request, so nothing sends on
	// it any more.
	c.closers = append(c.closers, func() { stopVA(t, validator) })
	front := wfe.New(logger, store, validator, authority, []string{"pebble.letsencrypt.org"}, false, false, 0, 0)

	acmeSrv := c.startTLS(t, c.countOrders(front.Handler()), cfg.Addr)
	mgmt := c.startTLS(t, front.ManagementHandler(), "")
	c.DirectoryURL = acmeSrv.URL + wfe.DirectoryPath
	c.RootFile = writeCertPEM(t, acmeSrv.Certificate())
	c.Roots = fetchRoot(t, mgmt)
	return c
}

// Orders is how many orders (newOrder requests) the CA was sent.
func (c *CA) Orders() int { return int(c.orders.Load()) }

// Close stops the CA: its directory refuses connections from then on.
func (c *CA) Close() {
	c.closeOnce.Do(func() {
		for i := len(c.closers) - 1; i >= 0; i-- {
			c.closers[i]()
		}
	})
}

// countOrders counts the POSTs to pebble's newOrder URL (as its
// directory names it).
func (c *CA) countOrders(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == newOrderPath {
			c.orders.Add(1)
		}
		h.ServeHTTP(w, r)
	})
}

// newOrderPath is the path of pebble's newOrder URL in its directory.
const newOrderPath = "/order-plz"

// pebbleEnv sets the knobs pebble reads from the environment when a VA or
// WFE is made: no random sleep before validating, no deliberately rejected
// nonces. Challenges are still really validated.
var pebbleEnv = sync.OnceFunc(func() {
	os.Setenv("PEBBLE_VA_NOSLEEP", "1")
	os.Setenv("PEBBLE_WFE_NONCEREJECT", "0")
})

func (c *CA) startTLS(t testing.TB, h http.Handler, addr string) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	if addr != "" {
		srv.Listener.Close()
		ln, err := listenRetry(addr)
		if err != nil {
			t.Fatalf("acmetest: listen on %s: %v", addr, err)
		}
		srv.Listener = ln
	}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	c.closers = append(c.closers, srv.Close)
	return srv
}

// listenRetry listens on addr, which a CA closed a moment ago may still
// hold for a few milliseconds.
func listenRetry(addr string) (net.Listener, error) {
	var err error
	for range 50 {
		var ln net.Listener
		if ln, err = net.Listen("tcp", addr); err == nil {
			return ln, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil, err
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
