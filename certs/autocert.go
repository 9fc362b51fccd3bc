package certs

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/acme"
	"golang.org/x/crypto/acme/autocert"
)

// autocertMode issues a certificate per host with x/crypto's autocert,
// through TLS-ALPN-01 on the HTTPS listener or HTTP-01 on the plain one,
// for DOMAIN and the hostnames the HostPolicy allows.
//
// autocert renews each certificate on a timer of its own (a third of its
// lifetime, at most 30 days, before expiry), re-armed after every attempt,
// with no way to stop it. So close cannot stop the timers; it makes them
// inert instead: past close, autocert's cache and ACME client refuse every
// call, so a renewal that fires does no I/O, fails, and re-arms 30-60
// minutes later. What stays is the closed autocert.Manager in memory, held
// by its timers.
type autocertMode struct {
	cfg    Config
	log    *slog.Logger
	allow  HostPolicy
	counts *counters
	// book holds the hosts whose issuance failed: their handshakes are
	// refused until the backoff passes (autocert itself would try again
	// a minute later, at the next handshake).
	book   *retryBook
	noHTTP bool // no plain listener: TLS-ALPN-01 only

	m      atomic.Pointer[autocert.Manager] // set by start
	http01 atomic.Pointer[http.Handler]     // set by start
	client *http.Client                     // set by start
	tr     *http.Transport                  // client's, for close
	closed atomic.Bool

	mu     sync.Mutex
	expiry map[string]time.Time // by host, as last served
}

func newAutocert(cfg Config, log *slog.Logger, allow HostPolicy, counts *counters) (*autocertMode, error) {
	if err := checkACMEURL(cfg.ACMECA); err != nil {
		return nil, fmt.Errorf("tls-mode autocert: %w", err)
	}
	return &autocertMode{cfg: cfg, log: log, allow: allow, counts: counts, expiry: map[string]time.Time{}}, nil
}

// useListeners: without a plain listener HTTP-01 is not offered (autocert
// never listens itself).
func (a *autocertMode) useListeners(httpAddr, _ net.Addr) { a.noHTTP = httpAddr == nil }

func (a *autocertMode) start(ctx context.Context) error {
	roots, err := loadRoots(a.cfg.ACMECARoot)
	if err != nil {
		return err
	}
	dir := a.cfg.ACMECA
	if dir == "" {
		dir = autocert.DefaultACMEDirectory
	}
	a.client = acmeHTTPClient(roots)
	a.tr = a.client.Transport.(*http.Transport)
	a.client.Transport = closableTransport{a.tr, &a.closed}
	a.book = newRetryBook(filepath.Join(a.cfg.DataDir, RetryFile), a.cfg.RetryBase, a.cfg.RetryMax, settingsDigest(a.cfg), a.log)
	a.book.load(time.Now())
	if err := checkDirectory(ctx, dir, roots); err != nil {
		// Not fatal: certificates are requested at handshakes, and the
		// CA may be back by then.
		a.log.Warn("ACME directory not reachable now; certificates are requested at the first handshake of each name", "err", err)
	}
	m := &autocert.Manager{
		Prompt:     autocert.AcceptTOS,
		Cache:      closableCache{autocert.DirCache(filepath.Join(a.cfg.DataDir, "autocert")), &a.closed},
		HostPolicy: a.policy,
		Email:      a.cfg.ACMEEmail,
		Client:     &acme.Client{DirectoryURL: dir, HTTPClient: a.client, UserAgent: "ngstone"},
	}
	// Asking for the handler tells autocert that HTTP-01 is served on the
	// plain listener, so it may use either challenge.
	if !a.noHTTP {
		h := m.HTTPHandler(nil)
		a.http01.Store(&h)
	}
	a.m.Store(m)
	a.log.Info("autocert ready; certificates are issued at first handshake", "acme_ca", dir)
	return nil
}

// policy is autocert's HostPolicy, for handshakes and for HTTP-01
// requests, whose Host may carry a port (allowHost ignores it).
func (a *autocertMode) policy(ctx context.Context, host string) error {
	if err := a.allow(ctx, host); err != nil {
		a.log.Debug("autocert refused host", "host", host, "err", err)
		return err
	}
	return nil
}

func (a *autocertMode) getCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	m := a.m.Load()
	if m == nil {
		return nil, errNotStarted
	}
	host := hostOnly(hello.ServerName)
	challenge := isALPNChallenge(hello)
	if !challenge {
		if due, _ := a.book.due(host, time.Now()); !due {
			e, _ := a.book.entry(host)
			return nil, fmt.Errorf("%w for %s: %s", ErrBackoff, host, describeRetry(e))
		}
	}
	cert, err := m.GetCertificate(hello)
	if err != nil {
		if !challenge && !errors.Is(err, ErrHostNotAllowed) {
			a.failed(host, err)
		}
		return nil, err
	}
	if cert.Leaf != nil && hello.ServerName != "" {
		a.served(host, cert.Leaf.NotAfter)
	}
	return cert, nil
}

// failed records a failed issuance for host and says so at warn: agents
// and visitors only see a TLS alert.
func (a *autocertMode) failed(host string, err error) {
	a.counts.attempt(KindObtain)
	e := a.book.fail(a.counts, host, KindObtain, err, time.Now())
	a.log.Warn("autocert could not obtain a certificate; handshakes for it are refused until the next attempt",
		"host", host, "reason", e.Reason, "err", err, "failures", e.Failures, "next_attempt", e.NextAttempt.UTC().Format(time.RFC3339))
}

func (a *autocertMode) served(host string, notAfter time.Time) {
	a.mu.Lock()
	_, known := a.expiry[host]
	a.expiry[host] = notAfter
	a.mu.Unlock()
	if _, failing := a.book.entry(host); failing || !known {
		a.counts.attempt(KindObtain)
	}
	a.book.succeed(host, time.Now())
}

func (a *autocertMode) nextAttempt() time.Time {
	if a.book == nil {
		return time.Time{}
	}
	return a.book.nextAttempt()
}

func (a *autocertMode) httpHandler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h := a.http01.Load(); h != nil && strings.HasPrefix(r.URL.Path, "/.well-known/acme-challenge/") {
			(*h).ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (a *autocertMode) notAfter() map[string]time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]time.Time, len(a.expiry))
	for k, v := range a.expiry {
		out[k] = v
	}
	return out
}

func (a *autocertMode) reload() error { return nil }

func (a *autocertMode) close() error {
	a.closed.Store(true)
	if a.tr != nil {
		a.tr.CloseIdleConnections()
	}
	return nil
}

// errAutocertClosed answers autocert's cache and ACME calls after close.
var errAutocertClosed = errors.New("autocert closed")

// closableCache is autocert's cache until closed is set, then refuses.
type closableCache struct {
	autocert.Cache
	closed *atomic.Bool
}

func (c closableCache) Get(ctx context.Context, key string) ([]byte, error) {
	if c.closed.Load() {
		return nil, errAutocertClosed
	}
	return c.Cache.Get(ctx, key)
}

func (c closableCache) Put(ctx context.Context, key string, data []byte) error {
	if c.closed.Load() {
		return errAutocertClosed
	}
	return c.Cache.Put(ctx, key, data)
}

func (c closableCache) Delete(ctx context.Context, key string) error {
	if c.closed.Load() {
		return errAutocertClosed
	}
	return c.Cache.Delete(ctx, key)
}

// closableTransport is the ACME client's transport until closed is set,
// then refuses every request.
type closableTransport struct {
	http.RoundTripper
	closed *atomic.Bool
}

func (t closableTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if t.closed.Load() {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, errAutocertClosed
	}
	return t.RoundTripper.RoundTrip(r)
}
