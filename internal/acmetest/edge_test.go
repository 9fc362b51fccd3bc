package acmetest_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/acmetest"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// These tests run the whole path with certificates from an ACME CA: pebble
// issues to a real edge, a real agent binds names on it, and a visitor
// that trusts only pebble's root reaches the agent's local service.

const domain = tunneltest.Domain

// acmeEdgeConfig is an edge on loopback whose certificates come from ca in
// mode, resolving with d.
func acmeEdgeConfig(t *testing.T, mode string, ca *acmetest.CA, d *acmetest.DNS) edge.Config {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TLS.Mode = mode
	cfg.TLS.ACMECA = ca.DirectoryURL
	cfg.TLS.ACMECARoot = ca.RootFile
	cfg.TLS.ACMEEmail = "ops@" + domain
	cfg.TLS.DNSResolvers = []string{d.Addr}
	return cfg
}

// withRFC2136 solves DNS-01 by RFC 2136 updates to d. Pebble looks the
// record up itself, so certmagic's own propagation check (proven in the
// certs tests) is skipped to save its 2s poll per name.
func withRFC2136(cfg edge.Config, d *acmetest.DNS) edge.Config {
	cfg.TLS.DNSProvider = certs.DNSRFC2136
	cfg.TLS.DNSCredentials = d.RFC2136Credentials()
	cfg.TLS.DNSPropagationTimeout = -time.Second
	return cfg
}

// startEdge starts an edge from cfg, certificates first, and closes it at
// the end of the test.
func startEdge(t *testing.T, cfg edge.Config) *tunneltest.Edge {
	t.Helper()
	e, err := edge.New(cfg, tunneltest.Logger().With("side", "edge"))
	if err != nil {
		t.Fatalf("edge.New: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.Start(ctx); err != nil {
		t.Fatalf("edge.Start: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return &tunneltest.Edge{Edge: e, Config: cfg}
}

// bind runs an agent that binds name on e to a backend, and waits until it
// is online.
func bind(t *testing.T, e *tunneltest.Edge, roots *x509.CertPool, name string) {
	t.Helper()
	startAgent(t, e, roots, func(cfg *agent.Config) { cfg.Subdomain = name }).WaitOnline(t)
}

// startAgent runs an agent on e, with a backend, set up by set.
func startAgent(t *testing.T, e *tunneltest.Edge, roots *x509.CertPool, set func(*agent.Config)) *tunneltest.Agent {
	t.Helper()
	b := tunneltest.StartBackend(t)
	cfg := e.AgentConfig("", b.Addr())
	set(&cfg)
	// The agent dials the control listener by IP address and checks the
	// edge's DOMAIN certificate, from pebble, by name.
	cfg.RootCAs, cfg.ServerName = roots, domain
	// In autocert mode that DOMAIN certificate is issued during the
	// agent's first handshake.
	cfg.DialTimeout = 15 * time.Second
	return tunneltest.StartAgent(t, cfg)
}

// visit is GET https://HOST/hello through e's HTTPS listener by a client
// that trusts only roots.
type visit struct {
	status int
	proto  string
	body   string
	leaf   *x509.Certificate
}

func get(t *testing.T, e *tunneltest.Edge, roots *x509.CertPool, host string) (visit, error) {
	t.Helper()
	addr := e.Addr("https").String()
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
		ForceAttemptHTTP2: true,
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	resp, err := client.Get("https://" + host + "/hello")
	if err != nil {
		return visit{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return visit{status: resp.StatusCode, proto: resp.Proto, body: string(b), leaf: resp.TLS.PeerCertificates[0]}, err
}

// wantTunnel checks that host answers with the backend's /hello through a
// certificate for names.
func wantTunnel(t *testing.T, e *tunneltest.Edge, roots *x509.CertPool, host string, names ...string) visit {
	t.Helper()
	v, err := get(t, e, roots, host)
	if err != nil {
		t.Fatalf("GET https://%s/hello: %v", host, err)
	}
	if v.status != http.StatusOK || v.body != "hello" {
		t.Errorf("GET https://%s/hello = %d %q, want 200 \"hello\" from the backend", host, v.status, v.body)
	}
	if !slices.Equal(v.leaf.DNSNames, names) {
		t.Errorf("certificate served for %s covers %v, want %v", host, v.leaf.DNSNames, names)
	}
	return v
}

// wantRefused checks that a handshake for host fails at the TLS layer.
func wantRefused(t *testing.T, e *tunneltest.Edge, roots *x509.CertPool, host string) {
	t.Helper()
	v, err := get(t, e, roots, host)
	if err == nil {
		t.Fatalf("GET https://%s/hello = %d %q; want the handshake refused", host, v.status, v.body)
	}
	if !strings.Contains(err.Error(), "remote error: tls") {
		t.Errorf("GET https://%s/hello: %v; want a TLS alert from the edge", host, err)
	}
}

// TestEdgeWildcardDNS01: the edge obtains *.DOMAIN and DOMAIN from pebble
// through DNS-01 (rfc2136 updates to a DNS server that pebble then
// queries) in the background, /healthz turning 200 once it has them; a visitor trusting only pebble's root reaches
// app.DOMAIN's agent over h2, through the wildcard certificate.
func TestEdgeWildcardDNS01(t *testing.T) {
	t.Parallel()
	d := acmetest.StartDNS(t, domain)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr})
	e := startEdge(t, withRFC2136(acmeEdgeConfig(t, certs.ModeCertmagic, ca, d), d))
	waitHealthz(t, e, http.StatusOK, 60*time.Second)
	bind(t, e, ca.Roots, "app")

	v := wantTunnel(t, e, ca.Roots, "app."+domain, "*."+domain)
	if v.proto != "HTTP/2.0" {
		t.Errorf("visitor spoke %s, want HTTP/2.0 (ALPN h2)", v.proto)
	}
	// A name with no tunnel still gets a valid certificate and the edge's
	// own answer, not a handshake failure.
	v, err := get(t, e, ca.Roots, "nobody."+domain)
	if err != nil || v.status != http.StatusNotFound {
		t.Errorf("GET https://nobody.%s/hello = %d, %v; want 404 over a valid handshake", domain, v.status, err)
	}
}

// TestEdgeOnDemand: with on-demand, a bound hostname gets its own
// certificate at its first handshake and the tunnel's response; an unbound
// one is refused at the handshake, and gets a certificate once bound.
//
// Its names are its own: certmagic keeps one process-wide table of the
// handshakes loading or obtaining a certificate, keyed by the name alone,
// and a handshake for a name another config is obtaining on demand waits
// for that config and is handed its certificate. The edges of this
// package's parallel tests share the process (and DOMAIN), so a name
// obtained here on demand and handshaken for by another test's edge
// meanwhile (app.DOMAIN, say) would reach that edge's visitor with a
// certificate of this test's CA. One edge per process, as deployed, has
// one config per name (DOMAIN's or the own hostnames').
func TestEdgeOnDemand(t *testing.T) {
	t.Parallel()
	d := acmetest.StartDNS(t, domain)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr})
	cfg := withRFC2136(acmeEdgeConfig(t, certs.ModeCertmagic, ca, d), d)
	cfg.TLS.OnDemand = true
	e := startEdge(t, cfg)
	waitHealthz(t, e, http.StatusOK, 60*time.Second)
	bind(t, e, ca.Roots, "ondemand")

	wantTunnel(t, e, ca.Roots, "ondemand."+domain, "ondemand."+domain)
	wantRefused(t, e, ca.Roots, "late."+domain)
	bind(t, e, ca.Roots, "late")
	wantTunnel(t, e, ca.Roots, "late."+domain, "late."+domain)
}

// TestEdgeAutocert: in autocert mode pebble validates HTTP-01 or
// TLS-ALPN-01 against the edge's own listeners (through relays, since the
// edge binds them after pebble starts); a bound subdomain gets a
// certificate and the tunnel's response, an unbound one is refused; and so
// does an agent's own hostname.
func TestEdgeAutocert(t *testing.T) {
	t.Parallel()
	d := acmetest.StartDNS(t, domain, ownZone)
	httpRelay, tlsRelay := acmetest.StartRelay(t), acmetest.StartRelay(t)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr, HTTPPort: httpRelay.Port(), TLSPort: tlsRelay.Port()})
	cfg := acmeEdgeConfig(t, certs.ModeAutocert, ca, d)
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "t", Hostnames: []string{"*." + ownZone}}}
	e := startEdge(t, cfg)
	httpRelay.SetTarget(e.Addr("http").String())
	tlsRelay.SetTarget(e.Addr("https").String())
	startAgent(t, e, ca.Roots, func(c *agent.Config) { c.Token, c.Subdomain = "t", "app" }).WaitOnline(t)

	wantTunnel(t, e, ca.Roots, "app."+domain, "app."+domain)
	wantRefused(t, e, ca.Roots, "unbound."+domain)

	// An agent's own hostname, allowed by its token, likewise.
	startAgent(t, e, ca.Roots, func(c *agent.Config) { c.Token, c.Hostname = "t", "app."+ownZone }).WaitOnline(t)
	wantTunnel(t, e, ca.Roots, "app."+ownZone, "app."+ownZone)
	wantRefused(t, e, ca.Roots, "unbound."+ownZone)
}

// ownZone holds the hostnames agents bind of their own in these tests.
const ownZone = "example.test"

// TestEdgeOwnHostname: an edge whose *.DOMAIN certificate comes by DNS-01
// serves an agent's own hostname too. The agent's token allows
// *.example.test; it binds app.example.test (which resolves to the edge,
// as a CNAME would make it); at the first handshake for it the edge has
// pebble validate the name over HTTP-01 or TLS-ALPN-01 on its own
// listeners (DNS-01 proves the edge's zone only), and a client that trusts
// only pebble's root gets the local service's answer through a certificate
// for that name. A token without the pattern is refused unauthorized, and
// an own hostname nothing is bound to is refused at the handshake.
func TestEdgeOwnHostname(t *testing.T) {
	t.Parallel()
	d := acmetest.StartDNS(t, domain, ownZone)
	httpRelay, tlsRelay := acmetest.StartRelay(t), acmetest.StartRelay(t)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr, HTTPPort: httpRelay.Port(), TLSPort: tlsRelay.Port()})
	cfg := withRFC2136(acmeEdgeConfig(t, certs.ModeCertmagic, ca, d), d)
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "own-names", Hostnames: []string{"*." + ownZone}}, {Token: "plain"}}
	e := startEdge(t, cfg)
	httpRelay.SetTarget(e.Addr("http").String())
	tlsRelay.SetTarget(e.Addr("https").String())
	waitHealthz(t, e, http.StatusOK, 60*time.Second)

	host := "app." + ownZone
	s := startAgent(t, e, ca.Roots, func(c *agent.Config) { c.Token, c.Hostname = "own-names", host }).WaitOnline(t)
	if s.Hostname != host || !strings.HasPrefix(s.URL, "https://"+host+":") {
		t.Errorf("bound %q at %q, want %s at https://%s:PORT", s.Hostname, s.URL, host, host)
	}
	wantTunnel(t, e, ca.Roots, host, host)

	refused := startAgent(t, e, ca.Roots, func(c *agent.Config) { c.Token, c.Hostname = "plain", "other."+ownZone })
	var re *agent.RefusedError
	if err := refused.Err(); !errors.As(err, &re) || re.Code != "unauthorized" || !strings.Contains(re.Message, "hostnames") {
		t.Errorf("a token without hostnames binding other.%s: %v, want unauthorized naming the tokens file's hostnames", ownZone, err)
	}
	wantRefused(t, e, ca.Roots, "nobody."+ownZone)
	wantRefused(t, e, ca.Roots, "other."+ownZone)

	// The same edge's subdomains still come under the wildcard.
	startAgent(t, e, ca.Roots, func(c *agent.Config) { c.Token, c.Subdomain = "plain", "sub" }).WaitOnline(t)
	wantTunnel(t, e, ca.Roots, "sub."+domain, "*."+domain)
}
