package certs

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/acmetest"
)

// recorder is a slog.Handler that keeps every record as one line.
type recorder struct {
	mu    sync.Mutex
	lines []string
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *recorder) WithGroup(string) slog.Handler            { return r }
func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", rec.Level, rec.Message)
	rec.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	r.mu.Lock()
	r.lines = append(r.lines, b.String())
	r.mu.Unlock()
	return nil
}

// find returns the lines containing every one of subs.
func (r *recorder) find(subs ...string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, l := range r.lines {
		if containsAll(l, subs...) {
			out = append(out, l)
		}
	}
	return out
}

// await waits, at most 10 s, for a line with all of subs.
func (r *recorder) await(subs ...string) bool {
	for deadline := time.Now().Add(10 * time.Second); len(r.find(subs...)) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

// text is every line recorded.
func (r *recorder) text() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.lines, "\n")
}

// TestPropagationErrorNamesResolvers: a record the provider set where the
// resolvers do not look (the fake API accepts it and writes nowhere)
// fails with an error naming the record, the resolvers asked and what
// they answered, not certmagic's "last error: <nil>"; and a Present that
// failed is not followed by a "no memory of presenting" clean-up error.
func TestPropagationErrorNamesResolvers(t *testing.T) {
	t.Parallel()
	d, p := startACME(t, 0, 0)
	api := startFakeCloudflare(t, acmetest.StartDNS(t, testDomain), "good-token") // writes to another server
	cfg := acmeConfig(t, p, d)
	cfg.DNSProvider = DNSCloudflare
	cfg.DNSCredentials = map[string]string{"base_url": api.URL, "api_token": "good-token"}
	cfg.DNSPropagationTimeout = 3 * time.Second
	cfg.OnDemand = true // DOMAIN only
	m, err := startLogged(t, cfg, nil, slog.New(&recorder{}))
	if err != nil {
		t.Fatal(err)
	}
	st := waitStatus(t, m, ReasonDNSPropagation)
	for _, w := range []string{"_acme-challenge." + testDomain, d.Addr, "dns-resolvers", "answered 0 TXT record(s), none with this challenge's value", "3s"} {
		if !strings.Contains(st.Error(), w) {
			t.Errorf("Status() = %q; does not mention %q", st, w)
		}
	}
	if strings.Contains(st.Error(), "<nil>") {
		t.Errorf("Status() = %q still says <nil>", st)
	}
}

// TestNoSpuriousCleanupError: when setting the record fails, nothing logs
// "no memory of presenting a DNS record" (acmez cleans up every challenge
// it tried to present; certmagic's solver then errs for the one it never
// set).
func TestNoSpuriousCleanupError(t *testing.T) {
	t.Parallel()
	d, p := startACME(t, 0, 0)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost { // the record itself is refused
			http.Error(w, `{"success":false,"errors":[{"code":9999,"message":"record refused"}]}`, http.StatusBadRequest)
			return
		}
		fakeZones(w, r)
	}))
	t.Cleanup(api.Close)
	rec := &recorder{}
	cfg := acmeConfig(t, p, d)
	cfg.DNSProvider = DNSCloudflare
	cfg.DNSCredentials = map[string]string{"base_url": api.URL, "api_token": "good-token"}
	cfg.OnDemand = true
	m, err := startLogged(t, cfg, nil, slog.New(rec))
	if err != nil {
		t.Fatal(err)
	}
	waitStatus(t, m, ReasonDNSUpdate, "record refused")
	if lines := rec.find("no memory of presenting"); len(lines) > 0 {
		t.Errorf("spurious clean-up error logged: %q", lines)
	}
	// The failure is in Status before its log line is written.
	if !rec.await("ERROR could not obtain certificate", "reason=dns_update", "name="+testDomain) {
		t.Errorf("the failure was not logged with its name and reason; log:\n%s", rec.text())
	}
}

// fakeZones answers the zone lookup of the cloudflare provider.
func fakeZones(w http.ResponseWriter, r *http.Request) {
	fmt.Fprintf(w, `{"success":true,"errors":[],"result":[{"id":"z1","name":%q}]}`, r.URL.Query().Get("name"))
}

// TestAutocertHostWithPort: HTTP-01 requests carry the Host as the CA
// sent it, possibly with a port; the host policy ignores the port.
func TestAutocertHostWithPort(t *testing.T) {
	t.Parallel()
	_, p := startACME(t, 0, 0)
	cfg := Config{Mode: ModeAutocert, Domain: testDomain, DataDir: t.TempDir(), ACMECA: p.DirectoryURL, ACMECARoot: p.RootFile}
	m, err := startManager(t, cfg, allowOnly("app."+testDomain))
	if err != nil {
		t.Fatal(err)
	}
	h := m.HTTPHandler(http.NotFoundHandler())
	for host, want := range map[string]int{testDomain + ":80": http.StatusNotFound, "app." + testDomain + ":8080": http.StatusNotFound, "other." + testDomain + ":80": http.StatusForbidden} {
		w := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodGet, "http://"+host+"/.well-known/acme-challenge/tok", nil)
		h.ServeHTTP(w, r)
		// 404: the policy allowed the host and autocert has no such
		// token; 403: the policy refused it.
		if w.Code != want {
			t.Errorf("HTTP-01 for Host %s: %d %q, want %d", host, w.Code, w.Body, want)
		}
	}
}

// TestAutocertFailureAtWarn: a failed issuance is logged at warn with the
// host and the reason (agents only see a TLS alert).
func TestAutocertFailureAtWarn(t *testing.T) {
	t.Parallel()
	_, p := startACME(t, 0, 0)
	rec := &recorder{}
	cfg := Config{Mode: ModeAutocert, Domain: testDomain, DataDir: t.TempDir(), ACMECA: p.DirectoryURL, ACMECARoot: p.RootFile}
	m, err := startLogged(t, cfg, nil, slog.New(rec))
	if err != nil {
		t.Fatal(err)
	}
	ln := listenLoopback(t)
	serveTLS(t, ln, m) // no HTTP-01 listener, and pebble validates TLS-ALPN-01 on its default port: fails
	if _, _, err := get(t, p.Roots, ln.Addr().String(), testDomain); err == nil {
		t.Fatal("issuance succeeded with no challenge reachable")
	}
	// The server logs a refused handshake after the client has seen it.
	if !rec.await("WARN autocert could not obtain a certificate", "host="+testDomain, "reason=") {
		t.Errorf("no warn line naming the host and reason; log:\n%s", rec.text())
	}
	if !rec.await("WARN TLS handshake refused", "host="+testDomain) {
		t.Errorf("refused handshake not logged at warn")
	}
	if _, err := m.p.getCertificate(helloFor(testDomain)); !errors.Is(err, ErrBackoff) {
		t.Errorf("handshake within the backoff: %v, want ErrBackoff", err)
	}
}

func helloFor(host string) *tls.ClientHelloInfo { return &tls.ClientHelloInfo{ServerName: host} }

// TestCloudflareTokens: the tokens mean what they mean in libdns/cloudflare
// and Caddy's docs: zone_token finds the zone (Zone.Zone:Read), api_token
// edits the records (Zone.DNS:Edit); without zone_token, api_token does
// both.
func TestCloudflareTokens(t *testing.T) {
	for name, tt := range map[string]struct {
		creds              map[string]string
		zoneAuth, editAuth string
	}{
		"both":           {map[string]string{"api_token": "edit", "zone_token": "read"}, "Bearer read", "Bearer edit"},
		"api_token only": {map[string]string{"api_token": "edit"}, "Bearer edit", "Bearer edit"},
	} {
		t.Run(name, func(t *testing.T) {
			var mu sync.Mutex
			got := map[string]string{}
			api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				got[r.Method+" "+r.URL.Path] = r.Header.Get("Authorization")
				mu.Unlock()
				if r.URL.Path == "/zones" {
					fakeZones(w, r)
					return
				}
				fmt.Fprint(w, `{"success":true,"errors":[],"result":{}}`)
			}))
			defer api.Close()
			tt.creds["base_url"] = api.URL
			p, err := newCloudflare(tt.creds)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.AppendRecords(context.Background(), testDomain+".", testRecords()); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			if got["GET /zones"] != tt.zoneAuth || got["POST /zones/z1/dns_records"] != tt.editAuth {
				t.Errorf("tokens used: %v; want zone lookup with %q, record edit with %q", got, tt.zoneAuth, tt.editAuth)
			}
		})
	}
}
