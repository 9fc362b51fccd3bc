package acmetest_test

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/acmetest"
	"github.com/ngstone/ngstone/internal/conntest"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// These tests take the DNS server or the CA away from a running edge, as
// outages and credential rotations do, against BIND 9 (started by the
// test; skipped without named) and pebble.

// bindEdgeConfig is a certmagic edge solving DNS-01 through b, with
// certmagic's propagation check asking b as well.
func bindEdgeConfig(t *testing.T, ca *acmetest.CA, b *acmetest.BIND) edge.Config {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TLS.Mode = certs.ModeCertmagic
	cfg.TLS.ACMECA, cfg.TLS.ACMECARoot, cfg.TLS.ACMEEmail = ca.DirectoryURL, ca.RootFile, "ops@"+domain
	cfg.TLS.DNSProvider = certs.DNSRFC2136
	cfg.TLS.DNSCredentials = b.RFC2136Credentials()
	cfg.TLS.DNSResolvers = []string{b.Addr}
	return cfg
}

// healthz is the edge's /healthz status and body.
func healthz(t *testing.T, e *tunneltest.Edge) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + e.Addr("admin").String() + "/healthz")
	if err != nil {
		t.Fatalf("GET /healthz: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// waitHealthz waits until /healthz answers want, and returns the body.
func waitHealthz(t *testing.T, e *tunneltest.Edge, want int, within time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		code, body := healthz(t, e)
		if code == want {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("/healthz = %d %q after %v, want %d", code, body, within, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// metric reads one unlabelled sample of name from /metrics; -1 if absent.
func metric(t *testing.T, e *tunneltest.Edge, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + e.Addr("admin").String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return -1
}

// TestEdgeDNSDownAtFirstStart: with BIND down when the edge first starts,
// the edge starts anyway, /healthz says why it has no certificate, no
// order reaches the CA while the update server does not answer (each
// attempt checks it first), and the certificate is served within one
// backoff step of BIND coming back.
//
// The outage is the 2 minutes of the issue scaled by 1/120 with the
// schedule (base 1m → 500ms): the same count of backoff steps, in 1s.
// The bound: attempts during an outage of length T after the first
// failure are at most 1 + log2(T/base + 1) (2 for T = 2 base, plus the
// first); orders placed during it: 0.
func TestEdgeDNSDownAtFirstStart(t *testing.T) {
	t.Parallel()
	b := acmetest.StartBIND(t, domain)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: b.Addr})
	b.Stop()
	const base, outage = 500 * time.Millisecond, time.Second
	cfg := bindEdgeConfig(t, ca, b)
	cfg.TLS.RetryBase, cfg.TLS.RetryMax = base, 30*time.Second
	start := time.Now()
	e := startEdge(t, cfg)
	waitHealthz(t, e, http.StatusServiceUnavailable, 10*time.Second)
	body := waitHealthzMentions(t, e, certs.ReasonDNSUnreachable, b.Addr, "next attempt at")
	t.Logf("/healthz during the outage: %s", body)
	if _, err := get(t, e, ca.Roots, "app."+domain); err == nil || !strings.Contains(err.Error(), "remote error: tls") {
		t.Errorf("visitor during the outage: %v; want a TLS alert", err)
	}

	time.Sleep(time.Until(start.Add(outage)))
	const attemptsName = `ngstone_certificate_attempts_total{kind="obtain"}`
	attempts, orders := metric(t, e, attemptsName), ca.Orders()
	took := time.Since(start) // the outage as it was (see the bound below)
	nextSec := metric(t, e, "ngstone_certificate_next_attempt_timestamp_seconds")
	next := time.UnixMilli(int64(nextSec * 1e3))
	b.Start()
	back := time.Now()
	t.Logf("outage of %v (%v planned, 2m scaled): %v obtain attempts for 2 names, %d orders placed; next attempt due %v after BIND came back",
		took.Round(time.Millisecond), outage, attempts, orders, next.Sub(back).Round(time.Millisecond))
	if orders != 0 {
		t.Errorf("%d orders placed while the update server was down, want 0", orders)
	}
	// The outage is taken as it was: from before the edge started to the
	// metric's read, which a loaded machine can take past the planned 1s
	// (an over-estimate of the time since the first failure, so a looser
	// bound). Per name: 1 + log2(T/base + 1) attempts, rounded up (3 for
	// T = 1s).
	perName := 2 + int(math.Log2(float64(took)/float64(base)+1))
	if attempts > float64(2*perName) {
		t.Errorf("%v attempts during an outage of %v, want at most %d (%d per name)", attempts, took.Round(time.Millisecond), 2*perName, perName)
	}
	// One step is the delay after the failures so far: base·2^(n-1) after
	// n failures per name (2·base for the planned 1s). The next attempt
	// starts within it (plus the scheduling slack of a loaded machine),
	// and serves once issued.
	step := base << max(int(math.Ceil(attempts/2))-1, 0)
	waitMetric(t, e, attemptsName, attempts+1)
	if retried := time.Since(back); retried > step+2*time.Second {
		t.Errorf("first attempt %v after BIND came back; want within one backoff step (%v)", retried, step)
	} else {
		t.Logf("first attempt %v after BIND came back (one step: %v)", retried.Round(time.Millisecond), step)
	}
	waitHealthz(t, e, http.StatusOK, 60*time.Second)
	t.Logf("certificate served %v after BIND came back (issuance of 2 names included)", time.Since(back).Round(time.Millisecond))
	bind(t, e, ca.Roots, "app")
	wantTunnel(t, e, ca.Roots, "app."+domain, "*."+domain)
}

func waitHealthzMentions(t *testing.T, e *tunneltest.Edge, want ...string) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, body := healthz(t, e)
		ok := code == http.StatusServiceUnavailable
		for _, w := range want {
			ok = ok && strings.Contains(body, w)
		}
		if ok {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("/healthz = %d %q; want 503 mentioning %q", code, body, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestEdgeRenewalFailing: an edge restarted with a stored certificate
// inside its renewal window while renewal fails (a TSIG key rotation half
// done: the edge has the new secret, the server not yet) starts at once
// and serves the stored certificate; once the server has the new secret
// too, the certificate is renewed in the background, and a keep-alive
// connection opened before the renewal goes on serving across the swap.
func TestEdgeRenewalFailing(t *testing.T) {
	t.Parallel()
	b := acmetest.StartBIND(t, domain)
	// A 1h certificate needs renewal once less than 5 renew-check
	// intervals are left: none with the default 10m, at once with 15m.
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: b.Addr, CertValidity: time.Hour})
	cfg := bindEdgeConfig(t, ca, b)
	first := startEdge(t, cfg)
	waitHealthz(t, first, http.StatusOK, 60*time.Second)
	first.Close()
	firstOrders := ca.Orders()

	good := cfg.TLS.DNSCredentials
	cfg.TLS.DNSCredentials = map[string]string{"server": good["server"], "tsig_key": good["tsig_key"], "tsig_algorithm": good["tsig_algorithm"],
		"tsig_secret": "cm90YXRlZC1hd2F5LXJvdGF0ZWQtYXdheS1yb3RhdGVkIQ=="}
	cfg.TLS.RenewCheckInterval = 15 * time.Minute
	cfg.TLS.RetryBase = 200 * time.Millisecond
	started := time.Now()
	e := startEdge(t, cfg)
	if code, body := healthz(t, e); code != http.StatusOK {
		t.Fatalf("/healthz right after start with a stored certificate = %d %q", code, body)
	}
	t.Logf("edge with a stored certificate serving %v after Start", time.Since(started).Round(time.Millisecond))
	old := wantCert(t, e, ca, "app."+domain)
	waitMetric(t, e, `ngstone_certificate_failures_total{kind="renew",reason="dns_auth"}`, 1)
	if n := ca.Orders() - firstOrders; n != 0 {
		t.Errorf("%d orders placed with a refused key, want 0 (the key is checked first)", n)
	}
	if again := wantCert(t, e, ca, "app."+domain); !again.Equal(old) {
		t.Fatalf("certificate changed while renewal fails")
	}

	conn := keepAlive(t, e, ca, "app."+domain)
	defer conn.Close()
	conn.get(t)
	b.SetSecret(cfg.TLS.DNSCredentials["tsig_secret"]) // the rotation completed
	waitMetric(t, e, `ngstone_certificate_attempts_total{kind="renew"}`, 2)
	deadline := time.Now().Add(60 * time.Second)
	for wantCert(t, e, ca, "app."+domain).Equal(old) {
		if time.Now().After(deadline) {
			t.Fatal("certificate not renewed within 60s of the key matching")
		}
		conn.get(t)
		time.Sleep(50 * time.Millisecond)
	}
	for range 3 {
		conn.get(t) // the connection opened before the swap still serves
	}
}

// wantCert handshakes for host and returns the leaf's NotBefore.
func wantCert(t *testing.T, e *tunneltest.Edge, ca *acmetest.CA, host string) time.Time {
	t.Helper()
	c, err := tls.Dial("tcp", e.Addr("https").String(), &tls.Config{RootCAs: ca.Roots, ServerName: host})
	if err != nil {
		t.Fatalf("handshake for %s: %v", host, err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].NotBefore
}

func waitMetric(t *testing.T, e *tunneltest.Edge, name string, atLeast float64) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for metric(t, e, name) < atLeast {
		if time.Now().After(deadline) {
			t.Fatalf("%s = %v, want at least %v", name, metric(t, e, name), atLeast)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kaConn is one HTTP/1.1 keep-alive connection to the edge.
type kaConn struct {
	net.Conn
	r    *bufio.Reader
	host string
}

func keepAlive(t *testing.T, e *tunneltest.Edge, ca *acmetest.CA, host string) *kaConn {
	t.Helper()
	c, err := tls.Dial("tcp", e.Addr("https").String(), &tls.Config{RootCAs: ca.Roots, ServerName: host, NextProtos: []string{"http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	return &kaConn{Conn: c, r: bufio.NewReader(c), host: host}
}

// get sends one request on the connection and reads the edge's answer
// (404: no tunnel bound; what matters is that the connection serves).
func (c *kaConn) get(t *testing.T) {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", c.host)
	resp, err := http.ReadResponse(c.r, nil)
	if err != nil {
		t.Fatalf("request on the kept connection: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.Close {
		t.Fatal("the edge closed the kept connection")
	}
}

// TestEdgeCALostAccount: a CA that lost the edge's account (pebble
// restarted with nothing) still issues on the edge's first start after
// it: the stale account is replaced, not retried.
func TestEdgeCALostAccount(t *testing.T) {
	t.Parallel()
	d := acmetest.StartDNS(t, domain)
	addr := conntest.DeadAddr(t)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr, Addr: addr})
	cfg := withRFC2136(acmeEdgeConfig(t, certs.ModeCertmagic, ca, d), d)
	cfg.TLS.OnDemand = true // DOMAIN only
	first := startEdge(t, cfg)
	waitHealthz(t, first, http.StatusOK, 60*time.Second)
	first.Close()
	ca.Close()

	fresh := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr, Addr: addr})
	if fresh.DirectoryURL != ca.DirectoryURL {
		t.Fatalf("restarted CA at %s, want %s", fresh.DirectoryURL, ca.DirectoryURL)
	}
	// The stored certificate is still valid: remove it so the edge must
	// order one, with the account only it remembers.
	removeCertificates(t, cfg.TLS.DataDir)
	e := startEdge(t, cfg)
	waitHealthz(t, e, http.StatusOK, 60*time.Second)
	if n := metric(t, e, `ngstone_certificate_attempts_total{kind="obtain"}`); n != 1 {
		t.Errorf("obtain attempts = %v, want 1 (the first attempt works)", n)
	}
}

// removeCertificates deletes the certificates certmagic stored under
// dataDir, keeping its accounts.
func removeCertificates(t *testing.T, dataDir string) {
	t.Helper()
	if err := os.RemoveAll(filepath.Join(dataDir, "certmagic", "certificates")); err != nil {
		t.Fatal(err)
	}
}
