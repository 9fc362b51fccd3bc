package certs

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
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
	cfg   Config
	log   *slog.Logger
	allow HostPolicy

	m      atomic.Pointer[autocert.Manager] // set by start
	http01 atomic.Pointer[http.Handler]     // set by start
	client *http.Client                     // set by start
	tr     *http.Transport                  // client's, for close
	closed atomic.Bool

	mu     sync.Mutex
	expiry map[string]time.Time // by host, as last served
}

func newAutocert(cfg Config, log *slog.Logger, allow HostPolicy) (*autocertMode, error) {
	if err := checkACMEURL(cfg.ACMECA); err != nil {
		return nil, fmt.Errorf("tls-mode autocert: %w", err)
	}
	return &autocertMode{cfg: cfg, log: log, allow: allow, expiry: map[string]time.Time{}}, nil
}

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
	if err := checkDirectory(ctx, dir, roots); err != nil {
		return err
	}
	m := &autocert.Manager{
		Prompt:     autocert.AcceptTOS,
		Cache:      closableCache{autocert.DirCache(filepath.Join(a.cfg.DataDir, "autocert")), &a.closed},
		HostPolicy: a.policy,
		Email:      a.cfg.ACMEEmail,
		Client:     &acme.Client{DirectoryURL: dir, HTTPClient: a.client, UserAgent: "ngstone"},
	}
	// Asking for the handler now tells autocert that HTTP-01 is served (the
	// edge always has its plain listener), so it may use either challenge.
	h := m.HTTPHandler(nil)
	a.http01.Store(&h)
	a.m.Store(m)
	a.log.Info("autocert ready; certificates are issued at first handshake", "acme_ca", dir)
	return nil
}

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
	cert, err := m.GetCertificate(hello)
	if err != nil {
		a.log.Debug("autocert handshake failed", "host", hello.ServerName, "err", err)
		return nil, err
	}
	if cert.Leaf != nil && hello.ServerName != "" {
		a.mu.Lock()
		a.expiry[hello.ServerName] = cert.Leaf.NotAfter
		a.mu.Unlock()
	}
	return cert, nil
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
