package certs

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/acmetest"
)

// acmeConfig is a certmagic-mode Config against p, resolving with d.
func acmeConfig(t *testing.T, p *acmetest.CA, d *acmetest.DNS) Config {
	return Config{
		Mode:         ModeCertmagic,
		Domain:       testDomain,
		DataDir:      t.TempDir(),
		ACMECA:       p.DirectoryURL,
		ACMECARoot:   p.RootFile,
		ACMEEmail:    "ops@" + testDomain,
		DNSResolvers: []string{d.Addr},
	}
}

// rfc2136Config is acmeConfig against a CA and DNS server of the test's
// own, with DNS-01 through rfc2136 updates to that server.
func rfc2136Config(t *testing.T) (*acmetest.CA, Config) {
	d, p := startACME(t, 0, 0)
	cfg := acmeConfig(t, p, d)
	cfg.DNSProvider = DNSRFC2136
	cfg.DNSCredentials = d.RFC2136Credentials()
	return p, cfg
}

func startManager(t *testing.T, cfg Config, policy HostPolicy) (*Manager, error) {
	t.Helper()
	return startLogged(t, cfg, policy, testLogger(t))
}

func startLogged(t *testing.T, cfg Config, policy HostPolicy, log *slog.Logger) (*Manager, error) {
	t.Helper()
	m, err := New(cfg, log, policy)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = m.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	return m, m.Start(ctx)
}

// serveReady starts m from cfg, waits for its certificates and serves it
// on a loopback listener.
func serveReady(t *testing.T, cfg Config, policy HostPolicy) (*Manager, net.Listener) {
	t.Helper()
	m, ln := serveStarted(t, cfg, policy)
	waitReady(t, m)
	return m, ln
}

// waitReady waits until m has a valid certificate for every name it
// obtains in advance.
func waitReady(t *testing.T, m *Manager) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for m.Status() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("certificates not ready within 60s: %v", m.Status())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitStatus waits until m.Status() mentions every one of want, and
// returns it.
func waitStatus(t *testing.T, m *Manager, want ...string) error {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := m.Status()
		if err != nil && containsAll(err.Error(), want...) {
			return err
		}
		if time.Now().After(deadline) {
			t.Fatalf("Status() = %v; want an error mentioning %q", err, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// TestCertmagicWildcardDNS01 obtains *.DOMAIN and DOMAIN from pebble through
// DNS-01 (rfc2136 updates to a DNS server that pebble then queries), and a
// visitor trusting only pebble's root gets a response from app.DOMAIN; a
// client that sends no SNI gets the DOMAIN certificate.
func TestCertmagicWildcardDNS01(t *testing.T) {
	t.Parallel()
	p, cfg := rfc2136Config(t)
	m, ln := serveReady(t, cfg, nil)

	for _, host := range []string{"app." + testDomain, testDomain} {
		body, leaf, err := get(t, p.Roots, ln.Addr().String(), host)
		if err != nil {
			t.Fatalf("GET https://%s/: %v", host, err)
		}
		if want := "hello " + host; body != want {
			t.Errorf("body = %q, want %q", body, want)
		}
		if err := leaf.VerifyHostname(host); err != nil {
			t.Errorf("leaf for %s: %v", host, err)
		}
	}
	checkNoSNI(t, ln.Addr().String(), p.Roots)
	na := m.NotAfter()
	for _, name := range []string{"*." + testDomain, testDomain} {
		if na[name].Before(time.Now()) {
			t.Errorf("NotAfter()[%q] = %v, want a future time (map %v)", name, na[name], na)
		}
	}
}

// TestCertmagicCloudflare obtains the wildcard through the cloudflare
// provider, against a fake of the Cloudflare API that writes into the DNS
// server pebble queries; the token comes from a *_FILE variable.
func TestCertmagicCloudflare(t *testing.T) {
	t.Parallel()
	d, p := startACME(t, 0, 0)
	api := startFakeCloudflare(t, d, "good-token")
	tokenFile := writeTemp(t, "token", "good-token\n")
	cfg := acmeConfig(t, p, d)
	cfg.DNSProvider = DNSCloudflare
	cfg.DNSCredentials = map[string]string{"base_url": api.URL}
	cfg.DNSPropagationTimeout = -time.Second // pebble's own lookup still checks the record
	cfg.getenv = fakeEnv(map[string]string{"CLOUDFLARE_API_TOKEN_FILE": tokenFile})
	_, ln := serveReady(t, cfg, nil)
	if _, _, err := get(t, p.Roots, ln.Addr().String(), "app."+testDomain); err != nil {
		t.Fatalf("GET: %v", err)
	}
}

// TestCertmagicBadTokenKeepsServing: a DNS token the provider refuses
// does not stop Start; Status names the mode's provider and the refusal,
// a handshake is refused at once with ErrNoCertificate, and the failure
// is counted by reason.
func TestCertmagicBadTokenKeepsServing(t *testing.T) {
	t.Parallel()
	d, p := startACME(t, 0, 0)
	api := startFakeCloudflare(t, d, "good-token")
	cfg := acmeConfig(t, p, d)
	cfg.DNSProvider = DNSCloudflare
	cfg.DNSCredentials = map[string]string{"base_url": api.URL, "api_token": "wrong"}
	m, err := startManager(t, cfg, nil)
	if err != nil {
		t.Fatalf("Start failed on a refused token: %v", err)
	}
	st := waitStatus(t, m, "dns-provider cloudflare", "Authentication error", ReasonDNSAuth, "next attempt at")
	if !errors.Is(st, ErrNoCertificate) {
		t.Errorf("Status() = %v, want ErrNoCertificate", st)
	}
	ln := listenLoopback(t)
	serveTLS(t, ln, m)
	// A name of this test's own (uniqueName): certmagic shares a handshake's
	// load between every Config in the process that misses the same name.
	_, _, gerr := get(t, p.Roots, ln.Addr().String(), uniqueName(t))
	if gerr == nil {
		t.Fatal("handshake succeeded without a certificate")
	}
	stats := m.Stats()
	if !hasCount(stats.Failures, KindObtain, ReasonDNSAuth) || !hasCount(stats.Refused, "", RefusedNoCertificate) || stats.NextAttempt.IsZero() {
		t.Errorf("Stats() = %+v after the GET failed with %v; want an obtain failure for dns_auth, a no_certificate refusal and a next attempt", stats, gerr)
	}
}

// uniqueName is a hostname under testDomain that no other test asks for in
// a handshake. certmagic lets a handshake that misses its cache wait for
// another one loading the same name, in any Config of the process, and
// take that one's outcome (handshake.go, certLoadWaitChans): two parallel
// tests loading one name could each be served the other's certificate,
// from the other's CA. An edge has one Config per name (configFor), so it
// never meets this.
func uniqueName(t *testing.T) string {
	return strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name())) + "." + testDomain
}

func hasCount(cs []Count, kind, reason string) bool {
	for _, c := range cs {
		if c.Kind == kind && c.Reason == reason && c.N > 0 {
			return true
		}
	}
	return false
}

// TestCertmagicOnDemand issues a certificate at the first handshake of a
// bound hostname, and refuses one the policy refuses and one outside DOMAIN.
func TestCertmagicOnDemand(t *testing.T) {
	t.Parallel()
	p, cfg := rfc2136Config(t)
	cfg.DNSPropagationTimeout = -time.Second
	cfg.OnDemand = true
	bound := uniqueName(t)
	m, ln := serveReady(t, cfg, allowOnly(bound))

	_, leaf, err := get(t, p.Roots, ln.Addr().String(), bound)
	if err != nil {
		t.Fatalf("GET bound host: %v", err)
	}
	if !slices.Equal(leaf.DNSNames, []string{bound}) {
		t.Errorf("on-demand leaf names = %v, want [%s]", leaf.DNSNames, bound)
	}
	for _, host := range []string{"unbound." + testDomain, "elsewhere.example"} {
		if _, _, err := get(t, p.Roots, ln.Addr().String(), host); err == nil {
			t.Errorf("GET %s succeeded; want a refused handshake", host)
		}
	}
	if _, ok := m.NotAfter()[bound]; !ok {
		t.Errorf("NotAfter() = %v, want an entry for %s", m.NotAfter(), bound)
	}
}

// TestOnDemandRateLimit: past the limit, an allowed hostname is refused;
// a name the policy refuses (no tunnel bound to it) is refused first.
func TestOnDemandRateLimit(t *testing.T) {
	cfg := Config{Mode: ModeCertmagic, Domain: testDomain, OnDemand: true, OnDemandRateLimit: 1, OnDemandRateWindow: time.Hour}
	m, err := New(cfg, nil, func(_ context.Context, host string) error {
		if strings.HasSuffix(host, "."+testDomain) {
			return nil
		}
		return errors.New("no tunnel is bound to " + host)
	})
	if err != nil {
		t.Fatal(err)
	}
	c := m.p.(*certmagicMode)
	c.book = newRetryBook("", 0, 0, "", testLogger(t))
	ctx := context.Background()
	if err := c.decide(ctx, "a."+testDomain); err != nil {
		t.Fatalf("first: %v", err)
	}
	if err := c.decide(ctx, "b."+testDomain); !errors.Is(err, ErrRateLimited) {
		t.Fatalf("second: %v, want ErrRateLimited", err)
	}
	if err := c.decide(ctx, "a.other.example"); !errors.Is(err, ErrHostNotAllowed) {
		t.Fatalf("a name nothing is bound to: %v, want ErrHostNotAllowed", err)
	}
}

// TestOnDemandLimiter: a burst of the limit, then the limit again over
// each window; a negative limit admits all.
func TestOnDemandLimiter(t *testing.T) {
	l := onDemandLimiter(2, time.Minute)
	t0 := time.Unix(1000, 0)
	steps := []struct {
		at   time.Duration
		want bool
	}{{0, true}, {time.Second, true}, {2 * time.Second, false}, {30 * time.Second, true}, {31 * time.Second, false},
		{time.Minute, true}, {2 * time.Minute, true}, {2*time.Minute + time.Second, true}, {2*time.Minute + 2*time.Second, false}}
	for _, s := range steps {
		if got := l.AllowN(t0.Add(s.at), 1); got != s.want {
			t.Errorf("allow(+%v) = %v, want %v", s.at, got, s.want)
		}
	}
	all := onDemandLimiter(-1, time.Minute)
	for i := range 1000 {
		if !all.AllowN(t0, 1) {
			t.Fatalf("negative limit: refused the %dth", i+1)
		}
	}
}

// startFakeCloudflare fakes the part of the Cloudflare API v4 the provider
// uses, for one zone, accepting only token; records go into d.
func startFakeCloudflare(t *testing.T, d *acmetest.DNS, token string) *httptest.Server {
	var mu sync.Mutex
	records := map[string]cfRecord{}
	reply := func(w http.ResponseWriter, code int, result any) {
		w.WriteHeader(code)
		resp := map[string]any{"success": code < 300, "errors": []cfError{}, "result": result}
		if code >= 300 {
			resp["errors"] = []cfError{{Code: 10000, Message: "Authentication error"}}
		}
		_ = json.NewEncoder(w).Encode(resp)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /zones", func(w http.ResponseWriter, r *http.Request) {
		reply(w, 200, []map[string]string{{"id": "z1", "name": r.URL.Query().Get("name")}})
	})
	mux.HandleFunc("POST /zones/z1/dns_records", func(w http.ResponseWriter, r *http.Request) {
		var rec cfRecord
		_ = json.NewDecoder(r.Body).Decode(&rec)
		mu.Lock()
		rec.ID = rec.Content[:8]
		records[rec.ID] = rec
		mu.Unlock()
		d.AddTXT(rec.Name, rec.Content)
		reply(w, 200, rec)
	})
	mux.HandleFunc("GET /zones/z1/dns_records", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		var out []cfRecord
		for _, rec := range records {
			if rec.Name == r.URL.Query().Get("name") && rec.Content == r.URL.Query().Get("content") {
				out = append(out, rec)
			}
		}
		reply(w, 200, out)
	})
	mux.HandleFunc("DELETE /zones/z1/dns_records/{id}", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		rec := records[r.PathValue("id")]
		delete(records, r.PathValue("id"))
		mu.Unlock()
		d.RemoveTXT(rec.Name, rec.Content)
		reply(w, 200, map[string]string{"id": rec.ID})
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+token {
			reply(w, http.StatusForbidden, nil)
			return
		}
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv
}
