package certs

import (
	"context"
	"crypto/tls"
	"errors"
	"net/http"
	"testing"
	"time"
)

// TestAutocert issues a certificate for a bound host through pebble, which
// validates HTTP-01 or TLS-ALPN-01 against the edge's own listeners, and
// refuses a host outside the policy.
func TestAutocert(t *testing.T) {
	t.Parallel()
	httpLn, tlsLn := listenLoopback(t), listenLoopback(t)
	_, p := startACME(t, portOf(httpLn), portOf(tlsLn))
	bound := "app." + testDomain
	cfg := Config{
		Mode:       ModeAutocert,
		Domain:     testDomain,
		DataDir:    t.TempDir(),
		ACMECA:     p.DirectoryURL,
		ACMECARoot: p.RootFile,
		ACMEEmail:  "ops@" + testDomain,
	}
	m, err := startManager(t, cfg, allowOnly(bound))
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	serveTLS(t, tlsLn, m)
	serveHTTP(t, httpLn, m.HTTPHandler(http.NotFoundHandler()))

	body, leaf, err := get(t, p.Roots, tlsLn.Addr().String(), bound)
	if err != nil {
		t.Fatalf("GET bound host: %v", err)
	}
	if body != "hello "+bound {
		t.Errorf("body = %q", body)
	}
	if err := leaf.VerifyHostname(bound); err != nil {
		t.Error(err)
	}
	for _, host := range []string{"unbound." + testDomain, "elsewhere.example"} {
		if _, _, err := get(t, p.Roots, tlsLn.Addr().String(), host); err == nil {
			t.Errorf("GET %s succeeded; want a refused handshake", host)
		}
	}
	if _, ok := m.NotAfter()[bound]; !ok {
		t.Errorf("NotAfter() = %v, want an entry for %s", m.NotAfter(), bound)
	}
	if got := m.TLSConfig().NextProtos; len(got) != 3 || got[2] != acmeTLS1 {
		t.Errorf("NextProtos = %v, want h2, http/1.1, %s", got, acmeTLS1)
	}
	checkAutocertInert(t, m, p.DirectoryURL)
}

// checkAutocertInert: after Close, what an autocert renewal timer does when
// it fires (read the cache, then talk to the CA) fails without I/O.
func checkAutocertInert(t *testing.T, m *Manager, dirURL string) {
	t.Helper()
	a := m.p.(*autocertMode)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := a.m.Load().Cache.Get(ctx, "acme_account+key"); !errors.Is(err, errAutocertClosed) {
		t.Errorf("cache after Close: %v, want %v", err, errAutocertClosed)
	}
	resp, err := a.client.Get(dirURL)
	if err == nil {
		resp.Body.Close()
	}
	if !errors.Is(err, errAutocertClosed) {
		t.Errorf("ACME request after Close: %v, want %v", err, errAutocertClosed)
	}
}

// TestAutocertBadCARoot: an ACME server not trusted through acme-ca-root
// does not stop Start (the CA is asked at handshakes); the handshake that
// needs a certificate fails, is counted with its reason, and the next one
// within the backoff is refused at once without asking the CA again.
func TestAutocertBadCARoot(t *testing.T) {
	t.Parallel()
	_, p := startACME(t, 0, 0)
	cfg := Config{Mode: ModeAutocert, Domain: testDomain, DataDir: t.TempDir(), ACMECA: p.DirectoryURL, RetryBase: time.Hour}
	m, err := startManager(t, cfg, nil)
	if err != nil {
		t.Fatalf("Start failed on an untrusted ACME server: %v", err)
	}
	ln := listenLoopback(t)
	serveTLS(t, ln, m)
	host := "app." + testDomain
	if _, _, err := get(t, p.Roots, ln.Addr().String(), host); err == nil {
		t.Fatal("handshake succeeded without a certificate")
	}
	if st := m.Stats(); !hasCount(st.Failures, KindObtain, ReasonACMEUnreachable) || st.NextAttempt.Before(time.Now().Add(30*time.Minute)) {
		t.Errorf("Stats() = %+v; want an acme_unreachable failure and a next attempt an hour away", st)
	}
	a := m.p.(*autocertMode)
	_, err = a.getCertificate(&tls.ClientHelloInfo{ServerName: host})
	if !errors.Is(err, ErrBackoff) || !contains(err.Error(), "x509") {
		t.Errorf("second handshake: %v; want ErrBackoff naming the certificate error", err)
	}
}
