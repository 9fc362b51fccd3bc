package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/certmagic"
)

// certmagicMode obtains certificates with certmagic. Without OnDemand it
// obtains *.DOMAIN and DOMAIN through DNS-01 at Start; with OnDemand it
// obtains a certificate per allowed hostname at its first handshake
// (DNS-01 if a provider is set, else HTTP-01 and TLS-ALPN-01 on the edge's
// own listeners). certmagic renews in the background.
type certmagicMode struct {
	cfg     Config
	log     *slog.Logger
	allow   HostPolicy
	limiter *slidingWindow

	cache  *certmagic.Cache
	magic  atomic.Pointer[certmagic.Config] // set by start
	issuer atomic.Pointer[certmagic.ACMEIssuer]

	mu   sync.Mutex
	seen map[string]bool // SNI names served, for notAfter
}

func newCertmagic(cfg Config, log *slog.Logger, allow HostPolicy) (*certmagicMode, error) {
	if cfg.DNSProvider == "" && !cfg.OnDemand {
		return nil, fmt.Errorf("tls-mode certmagic: dns-provider is required for the wildcard certificate (one of %v), or set on-demand", dnsProviderNames())
	}
	if cfg.DNSProvider != "" {
		if _, ok := dnsProviders[cfg.DNSProvider]; !ok {
			return nil, fmt.Errorf("tls-mode certmagic: dns-provider %q: %w (one of %v)", cfg.DNSProvider, ErrUnknownDNSProvider, dnsProviderNames())
		}
	}
	if err := checkACMEURL(cfg.ACMECA); err != nil {
		return nil, fmt.Errorf("tls-mode certmagic: %w", err)
	}
	limit, window := cfg.OnDemandRateLimit, cfg.OnDemandRateWindow
	if limit == 0 {
		limit = 10
	}
	if window <= 0 {
		window = time.Minute
	}
	return &certmagicMode{cfg: cfg, log: log, allow: allow, limiter: newSlidingWindow(limit, window), seen: map[string]bool{}}, nil
}

func (c *certmagicMode) start(ctx context.Context) error {
	roots, err := loadRoots(c.cfg.ACMECARoot)
	if err != nil {
		return err
	}
	zl := newZapLogger(c.log)
	var solver *certmagic.DNS01Solver
	if c.cfg.DNSProvider != "" {
		dp, err := newDNSProvider(c.cfg)
		if err != nil {
			return err
		}
		propagation := c.cfg.DNSPropagationTimeout
		if propagation < 0 {
			propagation = -1 // the one value certmagic reads as "skip the check"
		}
		solver = &certmagic.DNS01Solver{DNSManager: certmagic.DNSManager{
			DNSProvider:        dp,
			Resolvers:          c.cfg.DNSResolvers,
			PropagationTimeout: propagation,
			Logger:             zl,
		}}
	}
	c.cache = certmagic.NewCache(certmagic.CacheOptions{
		GetConfigForCert: func(certmagic.Certificate) (*certmagic.Config, error) { return c.magic.Load(), nil },
		Logger:           zl,
	})
	magic := certmagic.New(c.cache, certmagic.Config{
		Storage: &certmagic.FileStorage{Path: filepath.Join(c.cfg.DataDir, "certmagic")},
		Logger:  zl,
		// Public CAs have dropped OCSP; stapling would only warn at every load.
		OCSP: certmagic.OCSPConfig{DisableStapling: true},
	})
	tmpl := certmagic.ACMEIssuer{
		CA:           c.cfg.ACMECA,
		Email:        c.cfg.ACMEEmail,
		Agreed:       true,
		TrustedRoots: roots,
		Logger:       zl,
	}
	if solver != nil {
		tmpl.DNS01Solver = solver
	}
	issuer := certmagic.NewACMEIssuer(magic, tmpl)
	magic.Issuers = []certmagic.Issuer{issuer}
	c.issuer.Store(issuer)
	if err := c.obtain(ctx, magic, issuer.CA, roots); err != nil {
		return err
	}
	// Only now: certmagic would take the names given to ManageSync as the
	// only ones on-demand may issue for.
	if c.cfg.OnDemand {
		magic.OnDemand = &certmagic.OnDemandConfig{DecisionFunc: c.decide}
	}
	c.magic.Store(magic)
	return nil
}

// obtain gets, before the edge serves, every certificate it can know in
// advance, so that a wrong token or CA stops start-up.
func (c *certmagicMode) obtain(ctx context.Context, magic *certmagic.Config, ca string, roots *x509.CertPool) error {
	names := []string{"*." + c.cfg.Domain, c.cfg.Domain}
	switch {
	case c.cfg.OnDemand && c.cfg.DNSProvider == "":
		// HTTP-01 and TLS-ALPN-01 need the edge's listeners, which are not
		// up yet: check the ACME directory only.
		return checkDirectory(ctx, ca, roots)
	case c.cfg.OnDemand:
		names = names[1:]
	}
	if err := magic.ManageSync(ctx, names); err != nil {
		return fmt.Errorf("obtain certificate for %v from acme-ca %s with dns-provider %s: %w", names, ca, c.cfg.DNSProvider, err)
	}
	c.mu.Lock()
	for _, n := range names {
		c.seen[n] = true
	}
	c.mu.Unlock()
	c.log.Info("certificates ready", "names", names, "acme_ca", ca)
	return nil
}

// decide admits an on-demand hostname: allowed by policy, within the rate.
func (c *certmagicMode) decide(ctx context.Context, name string) error {
	if err := c.allow(ctx, name); err != nil {
		c.log.Debug("on-demand certificate refused", "host", name, "err", err)
		return err
	}
	if !c.limiter.allow(time.Now()) {
		c.log.Warn("on-demand certificate refused: rate limit", "host", name)
		return fmt.Errorf("%w: %s", ErrRateLimited, name)
	}
	c.log.Info("on-demand certificate allowed", "host", name)
	return nil
}

func (c *certmagicMode) getCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	magic := c.magic.Load()
	if magic == nil {
		return nil, errNotStarted
	}
	cert, err := magic.GetCertificate(hello)
	if err == nil && hello.ServerName != "" {
		c.mu.Lock()
		c.seen[hello.ServerName] = true
		c.mu.Unlock()
	}
	return cert, err
}

func (c *certmagicMode) httpHandler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if iss := c.issuer.Load(); iss != nil && iss.HandleHTTPChallenge(w, r) {
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (c *certmagicMode) notAfter() map[string]time.Time {
	out := map[string]time.Time{}
	if c.cache == nil {
		return out
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for name := range c.seen {
		for _, cert := range c.cache.AllMatchingCertificates(name) {
			if len(cert.Names) > 0 && cert.Leaf != nil && cert.Leaf.NotAfter.After(out[cert.Names[0]]) {
				out[cert.Names[0]] = cert.Leaf.NotAfter
			}
		}
	}
	return out
}

func (c *certmagicMode) reload() error { return nil }

func (c *certmagicMode) close() error {
	if c.cache != nil {
		c.cache.Stop()
	}
	return nil
}

// loadRoots reads the acme-ca-root bundle; nil (system roots) for none.
func loadRoots(path string) (*x509.CertPool, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("acme-ca-root: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("acme-ca-root %s: no PEM certificate found", path)
	}
	return pool, nil
}

// checkACMEURL accepts an empty URL (the default CA) or an https URL.
func checkACMEURL(u string) error {
	if u == "" {
		return nil
	}
	p, err := url.Parse(u)
	if err != nil || p.Scheme != "https" || p.Host == "" {
		return fmt.Errorf("acme-ca %q: want an https directory URL", u)
	}
	return nil
}

// checkDirectory fetches the ACME directory, to fail at start-up on a wrong
// acme-ca or acme-ca-root rather than at the first handshake.
func checkDirectory(ctx context.Context, dirURL string, roots *x509.CertPool) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, dirURL, nil)
	if err != nil {
		return fmt.Errorf("acme-ca %s: %w", dirURL, err)
	}
	client := acmeHTTPClient(roots)
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("acme-ca %s: %w", dirURL, err)
	}
	defer resp.Body.Close()
	var dir struct {
		NewNonce string `json:"newNonce"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&dir); err != nil || resp.StatusCode != http.StatusOK || dir.NewNonce == "" {
		return fmt.Errorf("acme-ca %s: not an ACME directory (%s)", dirURL, resp.Status)
	}
	return nil
}

// acmeHTTPClient is an HTTP client that trusts roots (nil: system roots).
func acmeHTTPClient(roots *x509.CertPool) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// slidingWindow admits at most limit events per window; a negative limit
// admits all. It starts no goroutine.
type slidingWindow struct {
	mu     sync.Mutex
	limit  int
	window time.Duration
	times  []time.Time
}

func newSlidingWindow(limit int, window time.Duration) *slidingWindow {
	return &slidingWindow{limit: limit, window: window}
}

func (s *slidingWindow) allow(now time.Time) bool {
	if s.limit < 0 {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	cut := 0
	for cut < len(s.times) && now.Sub(s.times[cut]) >= s.window {
		cut++
	}
	s.times = s.times[cut:]
	if len(s.times) >= s.limit {
		return false
	}
	s.times = append(s.times, now)
	return true
}
