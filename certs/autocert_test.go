package certs

import (
	"net/http"
	"testing"
)

// TestAutocert issues a certificate for a bound host through pebble, which
// validates HTTP-01 or TLS-ALPN-01 against the edge's own listeners, and
// refuses a host outside the policy.
func TestAutocert(t *testing.T) {
	t.Parallel()
	d := startDNS(t)
	httpLn, tlsLn := listenLoopback(t), listenLoopback(t)
	p := startPebble(t, portOf(httpLn), portOf(tlsLn), d.addr)
	bound := "app." + testDomain
	cfg := Config{
		Mode:       ModeAutocert,
		Domain:     testDomain,
		DataDir:    t.TempDir(),
		ACMECA:     p.dirURL,
		ACMECARoot: p.rootFile,
		ACMEEmail:  "ops@" + testDomain,
	}
	m, err := startManager(t, cfg, allowOnly(bound))
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	serveTLS(t, tlsLn, m)
	serveHTTP(t, httpLn, m.HTTPHandler(http.NotFoundHandler()))

	body, leaf, err := get(t, p.roots, tlsLn.Addr().String(), bound)
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
		if _, _, err := get(t, p.roots, tlsLn.Addr().String(), host); err == nil {
			t.Errorf("GET %s succeeded; want a refused handshake", host)
		}
	}
	if _, ok := m.NotAfter()[bound]; !ok {
		t.Errorf("NotAfter() = %v, want an entry for %s", m.NotAfter(), bound)
	}
	if got := m.TLSConfig().NextProtos; len(got) != 3 || got[2] != acmeTLS1 {
		t.Errorf("NextProtos = %v, want h2, http/1.1, %s", got, acmeTLS1)
	}
}

// TestAutocertBadCARoot: an ACME server not trusted through acme-ca-root
// stops Start with an error naming the setting.
func TestAutocertBadCARoot(t *testing.T) {
	t.Parallel()
	d := startDNS(t)
	p := startPebble(t, 0, 0, d.addr)
	cfg := Config{Mode: ModeAutocert, Domain: testDomain, DataDir: t.TempDir(), ACMECA: p.dirURL}
	_, err := startManager(t, cfg, nil)
	if err == nil {
		t.Fatal("Start succeeded against an untrusted ACME server")
	}
	if want := "tls-mode autocert: acme-ca " + p.dirURL; !contains(err.Error(), want) {
		t.Errorf("error %q does not start with %q", err, want)
	}
}
