package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
)

// certmagicMode obtains certificates with certmagic. The names known in
// advance (DOMAIN, and *.DOMAIN without OnDemand) are obtained and renewed
// by a schedule of its own in the background (run): Start only loads what
// storage holds, so an edge serves a valid stored certificate at once and
// never waits for, or exits on, a CA or DNS failure. Failed attempts back
// off (retryBook), across restarts too. With OnDemand, a certificate per
// allowed hostname is issued at its first handshake (DNS-01 if a provider
// is set, else HTTP-01 and TLS-ALPN-01 on the edge's own listeners). A
// hostname of an agent's own, outside DOMAIN, is always issued at its first
// handshake, and over HTTP-01 and TLS-ALPN-01 even with a DNS provider,
// which can prove the edge's zone only.
//
// certmagic retries on its own schedule (minutes, fixed, not persisted);
// every attempt it starts passes admit (the cert_obtaining event), which
// refuses its retries and its renewals of the scheduled names, so that
// one schedule governs how often the CA is asked.
type certmagicMode struct {
	cfg     Config
	log     *slog.Logger
	allow   HostPolicy
	limiter *rate.Limiter
	counts  *counters
	// names are obtained and renewed by run.
	names []string

	httpAddr, httpsAddr net.Addr // the edge's listeners, from useListeners

	// Set by start.
	dns    certmagic.DNSProvider
	book   *retryBook
	roots  *x509.CertPool
	cache  *certmagic.Cache
	magic  atomic.Pointer[certmagic.Config]
	issuer atomic.Pointer[certmagic.ACMEIssuer]
	// own obtains the certificates of agents' own hostnames (outside
	// DOMAIN), on demand; with a DNS provider it has an issuer of its own
	// (ownIssuer), else it is magic.
	own       atomic.Pointer[certmagic.Config]
	ownIssuer atomic.Pointer[certmagic.ACMEIssuer]
	stop      context.CancelFunc
	wg        sync.WaitGroup

	mu   sync.Mutex
	seen map[string]bool // SNI names served, for notAfter
}

// driverKey marks the context of run's own attempts, which admit lets
// through: run has checked the backoff already.
type driverKey struct{}

// attemptTimeout bounds one attempt: a DNS propagation wait (2m by
// default) and the CA's validation and finalization polls fit in it.
const attemptTimeout = 10 * time.Minute

func newCertmagic(cfg Config, log *slog.Logger, allow HostPolicy, counts *counters) (*certmagicMode, error) {
	if cfg.DNSProvider == "" && !cfg.OnDemand {
		return nil, fmt.Errorf("tls-mode certmagic: dns-provider is required for the wildcard certificate (one of %v), or set on-demand", dnsProviderNames())
	}
	if cfg.DNSProvider != "" {
		if err := checkDNSProvider(cfg); err != nil {
			return nil, fmt.Errorf("tls-mode certmagic: %w", err)
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
	c := &certmagicMode{cfg: cfg, log: log, allow: allow, limiter: onDemandLimiter(limit, window), counts: counts, seen: map[string]bool{}}
	switch {
	case cfg.OnDemand && cfg.DNSProvider == "":
		// HTTP-01 and TLS-ALPN-01 for DOMAIN as for any other name, at
		// the first handshake.
	case cfg.OnDemand:
		c.names = []string{cfg.Domain}
	default:
		c.names = []string{"*." + cfg.Domain, cfg.Domain}
	}
	return c, nil
}

func (c *certmagicMode) useListeners(httpAddr, httpsAddr net.Addr) {
	c.httpAddr, c.httpsAddr = httpAddr, httpsAddr
}

func (c *certmagicMode) checkInterval() time.Duration {
	if c.cfg.RenewCheckInterval > 0 {
		return c.cfg.RenewCheckInterval
	}
	return certmagic.DefaultRenewCheckInterval
}

func (c *certmagicMode) start(ctx context.Context) error {
	roots, err := loadRoots(c.cfg.ACMECARoot)
	if err != nil {
		return err
	}
	c.roots = roots
	zl := newZapLogger(c.log)
	tmpl, err := c.issuerTemplate(zl)
	if err != nil {
		return err
	}
	c.book = newRetryBook(filepath.Join(c.cfg.DataDir, RetryFile), c.cfg.RetryBase, c.cfg.RetryMax, settingsDigest(c.cfg), c.log)
	c.book.load(time.Now())
	c.cache = certmagic.NewCache(certmagic.CacheOptions{
		GetConfigForCert:   func(cert certmagic.Certificate) (*certmagic.Config, error) { return c.configFor(cert.Names...), nil },
		RenewCheckInterval: c.checkInterval(),
		Logger:             zl,
	})
	magic := certmagic.New(c.cache, certmagic.Config{
		Storage: &certmagic.FileStorage{Path: filepath.Join(c.cfg.DataDir, "certmagic")},
		Logger:  zl,
		// Public CAs have dropped OCSP; stapling would only warn at every load.
		OCSP:    certmagic.OCSPConfig{DisableStapling: true},
		OnEvent: c.onEvent,
	})
	issuer := certmagic.NewACMEIssuer(magic, tmpl)
	magic.Issuers = []certmagic.Issuer{c.wrapIssuer(issuer)}
	if c.cfg.OnDemand {
		magic.OnDemand = &certmagic.OnDemandConfig{DecisionFunc: c.decide}
	}
	own := magic
	if c.dns != nil {
		// DNS-01 proves the edge's own zone only. The hostnames agents
		// bind of their own (a CNAME to the edge) are proven on the edge's
		// listeners, HTTP-01 and TLS-ALPN-01, each at its first handshake.
		own = certmagic.New(c.cache, certmagic.Config{
			Storage: magic.Storage,
			Logger:  zl,
			OCSP:    magic.OCSP,
			OnEvent: c.onEvent,
		})
		otmpl := tmpl
		otmpl.DNS01Solver = nil
		c.challengeListeners(&otmpl)
		oiss := certmagic.NewACMEIssuer(own, otmpl)
		own.Issuers = []certmagic.Issuer{oneShotIssuer{oiss}}
		own.OnDemand = &certmagic.OnDemandConfig{DecisionFunc: c.decide}
		c.ownIssuer.Store(oiss)
	}
	c.issuer.Store(issuer)
	c.magic.Store(magic)
	c.own.Store(own)
	for _, name := range c.names {
		c.loadStored(ctx, magic, name)
	}
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	c.stop = stop
	c.wg.Add(1)
	go c.run(runCtx)
	return nil
}

// issuerTemplate is the ACME issuer's settings: DNS-01 through the
// provider, or HTTP-01 and TLS-ALPN-01 answered on the edge's own
// listeners only.
func (c *certmagicMode) issuerTemplate(zl *zap.Logger) (certmagic.ACMEIssuer, error) {
	tmpl := certmagic.ACMEIssuer{
		CA:           c.cfg.ACMECA,
		Email:        c.cfg.ACMEEmail,
		Agreed:       true,
		TrustedRoots: c.roots,
		Logger:       zl,
	}
	if c.cfg.DNSProvider != "" {
		dp, err := newDNSProvider(c.cfg)
		if err != nil {
			return tmpl, err
		}
		c.dns = dp
		tmpl.DNS01Solver = newDNSSolver(c.cfg, dp, zl)
		return tmpl, nil
	}
	c.challengeListeners(&tmpl)
	return tmpl, nil
}

// challengeListeners points certmagic's HTTP-01 and TLS-ALPN-01 solvers at
// the edge's own listeners. certmagic's solver listens on its address
// itself unless that is taken, and then assumes whoever holds it answers
// (the edge does: httpHandler, and GetCertificate for acme-tls/1), so the
// address must be exactly the edge's, or certmagic would open a socket of
// its own (":80" by default). A challenge with no listener of the edge's
// is disabled.
func (c *certmagicMode) challengeListeners(tmpl *certmagic.ACMEIssuer) {
	httpHost, httpPort, httpOK := tcpHostPort(c.httpAddr)
	tlsHost, tlsPort, tlsOK := tcpHostPort(c.httpsAddr)
	if httpOK && tlsOK && httpHost != tlsHost {
		// One ListenHost serves both solvers: keep HTTP-01 only.
		c.log.Info("http-addr and https-addr are on different hosts; answering HTTP-01 challenges only", "http_addr", c.httpAddr, "https_addr", c.httpsAddr)
		tlsOK = false
	}
	tmpl.DisableHTTPChallenge, tmpl.DisableTLSALPNChallenge = !httpOK, !tlsOK
	tmpl.AltHTTPPort, tmpl.AltTLSALPNPort = httpPort, tlsPort
	tmpl.ListenHost = httpHost
	if !httpOK {
		tmpl.ListenHost = tlsHost
	}
}

// tcpHostPort splits a bound listener's address; an unspecified IP is ""
// (certmagic then tries ":PORT", which conflicts with it as well).
func tcpHostPort(a net.Addr) (string, int, bool) {
	ta, ok := a.(*net.TCPAddr)
	if !ok || ta == nil {
		return "", 0, false
	}
	if ta.IP.IsUnspecified() {
		return "", ta.Port, true
	}
	return ta.IP.String(), ta.Port, true
}

// wrapIssuer hands certmagic the ACME issuer as is where it can: certmagic
// marks a renewal as replacing the old certificate (ARI) only for its own
// *ACMEIssuer type. Without an email address it would prompt for one on
// the terminal, and with on-demand it would retry a failed handshake's
// order inside that handshake for minutes; oneShotIssuer does neither.
func (c *certmagicMode) wrapIssuer(iss *certmagic.ACMEIssuer) certmagic.Issuer {
	if c.cfg.ACMEEmail == "" || c.cfg.OnDemand {
		return oneShotIssuer{iss}
	}
	return iss
}

// oneShotIssuer is the ACME issuer, never interactive, whose failures
// outside run's own attempts end certmagic's retry loop at once (the
// retry book decides when to try again).
type oneShotIssuer struct{ *certmagic.ACMEIssuer }

// PreCheck never lets certmagic prompt on stdin for an email address.
func (o oneShotIssuer) PreCheck(ctx context.Context, names []string, _ bool) error {
	return o.ACMEIssuer.PreCheck(ctx, names, false)
}

func (o oneShotIssuer) Issue(ctx context.Context, csr *x509.CertificateRequest) (*certmagic.IssuedCertificate, error) {
	cert, err := o.ACMEIssuer.Issue(ctx, csr)
	if err != nil && ctx.Value(driverKey{}) == nil {
		return nil, certmagic.ErrNoRetry{Err: err}
	}
	return cert, err
}

// loadStored puts name's stored certificate, if any, into the cache; no
// network.
func (c *certmagicMode) loadStored(ctx context.Context, magic *certmagic.Config, name string) {
	cert, err := magic.CacheManagedCertificate(ctx, name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		c.log.Info("no stored certificate; obtaining one in the background", "name", name, "acme_ca", c.caURL())
	case err != nil:
		c.log.Warn("stored certificate unusable; obtaining another in the background", "name", name, "err", err)
	default:
		c.markSeen(name)
		c.log.Info("serving stored certificate", "name", name, "not_after", cert.Leaf.NotAfter.UTC().Format(time.RFC3339))
	}
}

func (c *certmagicMode) caURL() string {
	if c.cfg.ACMECA != "" {
		return c.cfg.ACMECA
	}
	return certmagic.LetsEncryptProductionCA
}

// run obtains and renews the scheduled names until ctx ends.
func (c *certmagicMode) run(ctx context.Context) {
	defer c.wg.Done()
	for {
		wait := c.checkInterval()
		for _, name := range c.names {
			wait = min(wait, c.maintain(ctx, name))
		}
		t := time.NewTimer(max(wait, 0))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// maintain obtains or renews name if it needs it and its backoff has
// passed, and returns how long until it should be looked at again.
func (c *certmagicMode) maintain(ctx context.Context, name string) time.Duration {
	magic := c.magic.Load()
	kind := KindObtain
	if cert, ok := c.cached(name); ok {
		if !cert.NeedsRenewal(magic) {
			return c.checkInterval()
		}
		kind = KindRenew
	}
	if due, at := c.book.due(name, time.Now()); !due {
		return time.Until(at)
	}
	c.attempt(ctx, magic, name, kind)
	if due, at := c.book.due(name, time.Now()); !due {
		return time.Until(at)
	}
	return c.checkInterval()
}

// attempt makes one attempt to obtain or renew name: first the checks that
// need no order (the DNS provider's server and credentials, the CA's
// directory), then the order.
func (c *certmagicMode) attempt(ctx context.Context, magic *certmagic.Config, name, kind string) {
	prior, _ := c.book.entry(name)
	c.counts.attempt(kind)
	c.book.begin(name, kind, time.Now())
	actx, cancel := context.WithTimeout(ctx, attemptTimeout)
	defer cancel()
	err := c.preflight(actx)
	if err == nil {
		// The count of failures so far: certmagic sends a retry to the
		// CA's staging directory first, where Let's Encrypt has one.
		failures := prior.Failures
		actx = context.WithValue(context.WithValue(actx, driverKey{}, name), certmagic.AttemptsCtxKey, &failures)
		err = c.order(actx, magic, name, kind)
		if lostAccount(err) {
			c.log.Info("the CA did not know the ACME account; ordering again with the one registered instead", "name", name, "acme_ca", c.caURL())
			err = c.order(actx, magic, name, kind)
		}
	}
	if err == nil {
		err = c.swapIn(ctx, magic, name)
	}
	if ctx.Err() != nil {
		return // closing
	}
	if err != nil {
		e := c.book.fail(c.counts, name, kind, err, time.Now())
		c.logFailure(name, kind, e)
		return
	}
	c.book.succeed(name, time.Now())
	cert, _ := c.cached(name)
	c.log.Info("certificate "+map[string]string{KindObtain: "obtained", KindRenew: "renewed"}[kind], "name", name,
		"not_after", cert.Leaf.NotAfter.UTC().Format(time.RFC3339), "acme_ca", c.caURL())
}

func (c *certmagicMode) order(ctx context.Context, magic *certmagic.Config, name, kind string) error {
	if kind == KindObtain {
		return magic.ObtainCertSync(ctx, name)
	}
	return magic.RenewCertSync(ctx, name, false)
}

// lostAccount recognizes certmagic's answer when the CA no longer knows
// the stored account (a CA reset): certmagic registers a new account, but
// orders again with the old one in the same call, and fails with no
// chains. The next order uses the new account.
func lostAccount(err error) bool {
	return err != nil && strings.HasSuffix(err.Error(), "no certificate chains")
}

func (c *certmagicMode) logFailure(name, kind string, e retryEntry) {
	msg := "could not obtain certificate; TLS handshakes for it are refused until one is obtained"
	if cert, ok := c.cached(name); ok && time.Now().Before(cert.Leaf.NotAfter) {
		msg = "could not renew certificate; serving the current one until it expires"
		c.log.Warn(msg, "name", name, "reason", e.Reason, "err", e.Error, "failures", e.Failures,
			"next_attempt", e.NextAttempt.UTC().Format(time.RFC3339), "not_after", cert.Leaf.NotAfter.UTC().Format(time.RFC3339))
		return
	}
	c.log.Error(msg, "name", name, "kind", kind, "reason", e.Reason, "err", e.Error, "failures", e.Failures,
		"next_attempt", e.NextAttempt.UTC().Format(time.RFC3339))
}

// preflight checks what can be checked without placing an order, so an
// unreachable DNS server or a refused key costs the CA nothing.
func (c *certmagicMode) preflight(ctx context.Context) error {
	if ch, ok := c.dns.(dnsChecker); ok {
		if err := ch.check(ctx, "_acme-challenge."+c.cfg.Domain); err != nil {
			return fmt.Errorf("dns-provider %s: %w", c.cfg.DNSProvider, err)
		}
	}
	return checkDirectory(ctx, c.caURL(), c.roots)
}

// swapIn swaps the certificate storage now holds for name into the cache;
// handshakes in progress keep the one they picked.
func (c *certmagicMode) swapIn(ctx context.Context, magic *certmagic.Config, name string) error {
	old := c.exact(name)
	cert, err := magic.CacheManagedCertificate(ctx, name)
	if err != nil {
		return fmt.Errorf("load the new certificate for %s from storage: %w", name, err)
	}
	var stale []string
	for _, o := range old {
		if o.Hash() != cert.Hash() {
			stale = append(stale, o.Hash())
		}
	}
	c.cache.Remove(stale)
	c.markSeen(name)
	return nil
}

// exact returns the cached certificates whose names include name itself.
func (c *certmagicMode) exact(name string) []certmagic.Certificate {
	var out []certmagic.Certificate
	for _, cert := range c.cache.AllMatchingCertificates(name) {
		if cert.Leaf != nil && slices.Contains(cert.Names, name) {
			out = append(out, cert)
		}
	}
	return out
}

// cached returns the cached certificate for name that expires last.
func (c *certmagicMode) cached(name string) (certmagic.Certificate, bool) {
	var best certmagic.Certificate
	for _, cert := range c.exact(name) {
		if best.Leaf == nil || cert.Leaf.NotAfter.After(best.Leaf.NotAfter) {
			best = cert
		}
	}
	return best, best.Leaf != nil
}

// onEvent sees every attempt certmagic makes: admit may refuse one before
// it places an order; the outcomes of attempts not run's own (on-demand)
// go into the retry book.
func (c *certmagicMode) onEvent(ctx context.Context, event string, data map[string]any) error {
	name, _ := data["identifier"].(string)
	kind := KindObtain
	if r, _ := data["renewal"].(bool); r {
		kind = KindRenew
	}
	if ctx.Value(driverKey{}) != nil {
		return nil // run keeps its own accounts
	}
	switch event {
	case "cert_obtaining":
		return c.admit(ctx, name, kind)
	case "cert_failed":
		err, _ := data["error"].(error)
		if err == nil {
			err = errors.New("unknown error")
		}
		e := c.book.fail(c.counts, name, kind, err, time.Now())
		c.log.Warn("could not obtain on-demand certificate", "name", name, "kind", kind, "reason", e.Reason, "err", e.Error,
			"failures", e.Failures, "next_attempt", e.NextAttempt.UTC().Format(time.RFC3339))
	case "cert_obtained":
		c.book.succeed(name, time.Now())
	}
	return nil
}

// admit lets an attempt certmagic started on its own go ahead, or refuses
// it (ErrNoRetry ends certmagic's retry loop). Refusals wrap ErrBackoff,
// which the certmagic log adapter lowers to debug.
func (c *certmagicMode) admit(ctx context.Context, name, kind string) error {
	if n, ok := ctx.Value(certmagic.AttemptsCtxKey).(*int); ok && *n > 0 {
		return certmagic.ErrNoRetry{Err: fmt.Errorf("%w: %s: certmagic's retry refused; the retry schedule is ngstone's", ErrBackoff, name)}
	}
	if slices.Contains(c.names, name) {
		return certmagic.ErrNoRetry{Err: fmt.Errorf("%w: %s is obtained and renewed on ngstone's schedule", ErrBackoff, name)}
	}
	now := time.Now()
	if due, _ := c.book.due(name, now); !due {
		e, _ := c.book.entry(name)
		return certmagic.ErrNoRetry{Err: fmt.Errorf("%w for %s: %s", ErrBackoff, name, describeRetry(e))}
	}
	c.counts.attempt(kind)
	c.book.begin(name, kind, now)
	return nil
}

// decide admits an on-demand hostname: allowed by policy, not backing off
// after a failure, within the rate.
func (c *certmagicMode) decide(ctx context.Context, name string) error {
	if err := c.allow(ctx, name); err != nil {
		c.log.Debug("on-demand certificate refused", "host", name, "err", err)
		return err
	}
	if due, _ := c.book.due(name, time.Now()); !due {
		e, _ := c.book.entry(name)
		return fmt.Errorf("%w for %s: %s", ErrBackoff, name, describeRetry(e))
	}
	if !c.limiter.Allow() {
		c.log.Warn("on-demand certificate refused: rate limit", "host", name)
		return fmt.Errorf("%w: %s", ErrRateLimited, name)
	}
	c.log.Info("on-demand certificate allowed", "host", name)
	return nil
}

// configFor is the config that manages a certificate for names: own when
// one of them is outside DOMAIN.
func (c *certmagicMode) configFor(names ...string) *certmagic.Config {
	for _, n := range names {
		n = strings.ToLower(strings.TrimSuffix(n, "."))
		if n != "" && n != c.cfg.Domain && !strings.HasSuffix(n, "."+c.cfg.Domain) {
			return c.own.Load()
		}
	}
	return c.magic.Load()
}

func (c *certmagicMode) getCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	magic := c.configFor(hello.ServerName)
	if magic == nil {
		return nil, errNotStarted
	}
	cert, err := magic.GetCertificate(hello)
	if err != nil {
		if scheduled := c.scheduledFor(hello.ServerName); scheduled != "" {
			return nil, fmt.Errorf("%w for %s: %s", ErrNoCertificate, hello.ServerName, c.why(scheduled))
		}
		return nil, err
	}
	if cert.Leaf != nil && time.Now().After(cert.Leaf.NotAfter) && !isALPNChallenge(hello) {
		return nil, fmt.Errorf("%w for %s: the certificate expired at %s; %s", ErrNoCertificate, hello.ServerName,
			cert.Leaf.NotAfter.UTC().Format(time.RFC3339), c.why(c.scheduledFor(hello.ServerName)))
	}
	if hello.ServerName != "" {
		c.markSeen(hello.ServerName)
	}
	return cert, nil
}

func isALPNChallenge(hello *tls.ClientHelloInfo) bool {
	return len(hello.SupportedProtos) == 1 && hello.SupportedProtos[0] == acmeTLS1
}

// scheduledFor is the scheduled name whose certificate serves host, or "".
func (c *certmagicMode) scheduledFor(host string) string {
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if slices.Contains(c.names, host) {
		return host
	}
	label, rest, ok := strings.Cut(host, ".")
	if ok && label != "" && rest == c.cfg.Domain && slices.Contains(c.names, "*."+rest) {
		return "*." + rest
	}
	return ""
}

// why says where obtaining name stands, for a refusal or /healthz.
func (c *certmagicMode) why(name string) string {
	if name == "" {
		return "not a name this edge obtains in advance"
	}
	e, ok := c.book.entry(name)
	switch {
	case !ok:
		return "the first attempt to obtain it has not finished yet"
	case e.Reason == "":
		return fmt.Sprintf("attempt %d is in progress since %s", e.Failures, e.LastAttempt.UTC().Format(time.RFC3339))
	}
	return describeRetry(e)
}

// status is nil when every scheduled name has a valid certificate.
func (c *certmagicMode) status() error {
	if c.magic.Load() == nil {
		return errNotStarted
	}
	var missing []string
	for _, name := range c.names {
		cert, ok := c.cached(name)
		switch {
		case !ok:
			missing = append(missing, name+": none yet; "+c.why(name))
		case time.Now().After(cert.Leaf.NotAfter):
			missing = append(missing, name+": expired at "+cert.Leaf.NotAfter.UTC().Format(time.RFC3339)+"; "+c.why(name))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s", ErrNoCertificate, strings.Join(missing, "; "))
	}
	return nil
}

func (c *certmagicMode) nextAttempt() time.Time {
	if c.book == nil {
		return time.Time{}
	}
	return c.book.nextAttempt()
}

func (c *certmagicMode) markSeen(name string) {
	c.mu.Lock()
	c.seen[name] = true
	c.mu.Unlock()
}

func (c *certmagicMode) httpHandler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, p := range []*atomic.Pointer[certmagic.ACMEIssuer]{&c.issuer, &c.ownIssuer} {
			if iss := p.Load(); iss != nil && iss.HandleHTTPChallenge(w, r) {
				return
			}
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
	if c.stop != nil {
		c.stop()
	}
	c.wg.Wait()
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
		return fmt.Errorf("acme-ca %s: %w: %w", dirURL, ErrCAUnreachable, err)
	}
	defer resp.Body.Close()
	var dir struct {
		NewNonce string `json:"newNonce"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&dir); err != nil || resp.StatusCode != http.StatusOK || dir.NewNonce == "" {
		return fmt.Errorf("acme-ca %s: %w: not an ACME directory (%s)", dirURL, ErrCAUnreachable, resp.Status)
	}
	return nil
}

// acmeHTTPClient is an HTTP client that trusts roots (nil: system roots).
func acmeHTTPClient(roots *x509.CertPool) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// onDemandLimiter admits limit issuances at once and limit more each
// window after (a token bucket); a negative limit admits all.
func onDemandLimiter(limit int, window time.Duration) *rate.Limiter {
	if limit < 0 {
		return rate.NewLimiter(rate.Inf, 0)
	}
	return rate.NewLimiter(rate.Every(window/time.Duration(limit)), limit)
}
