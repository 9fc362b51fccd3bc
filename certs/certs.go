// Package certs provides the edge's TLS configuration, one mode per
// --tls-mode:
//
//   - certmagic (for a public edge with a DNS API): one wildcard certificate for
//     *.DOMAIN and one for DOMAIN, obtained from an ACME CA through DNS-01
//     with a DNS provider from config; with OnDemand, a certificate per
//     hostname issued at its first handshake, only for hostnames the
//     HostPolicy allows at that moment, and rate-limited;
//   - autocert: golang.org/x/crypto/acme/autocert, a certificate per host
//     through HTTP-01 (HTTPHandler) or TLS-ALPN-01 (TLSConfig), for small
//     deployments without a DNS API;
//   - files: a certificate and key from disk, reloaded when they change;
//   - self-signed: a CA made once under the data directory (ca.pem), and a
//     leaf for DOMAIN, *.DOMAIN, localhost, 127.0.0.1 and ::1, for development.
//
// Its invariant: New does no I/O and refuses every setting it can check
// without I/O, naming the mode and the setting. Start never waits for, and
// never fails on, a CA or DNS provider: the ACME modes serve what storage
// holds at once and obtain or renew in the background, backing off after
// each failure (RetryBase doubling up to RetryMax, or later if the CA says
// so), across restarts too (RetryFile under DataDir). A handshake for a
// name with no valid certificate is refused at once with ErrNoCertificate,
// counted and logged; Status says why, for /healthz. Hostnames issued at a
// handshake (on-demand, autocert) are issued only if the HostPolicy allows
// them, and never while their backoff runs. Challenges are answered only
// on the edge's own listeners (UseListeners): no mode opens a socket.
package certs

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// Modes of --tls-mode.
const (
	ModeSelfSigned = "self-signed"
	ModeFiles      = "files"
	ModeAutocert   = "autocert"
	ModeCertmagic  = "certmagic"
)

// Modes lists every mode, for help text and validation.
var Modes = []string{ModeSelfSigned, ModeFiles, ModeAutocert, ModeCertmagic}

// Config selects and configures a mode.
type Config struct {
	// Mode is one of Modes; empty means self-signed.
	Mode string
	// Domain is the edge's domain; certificates cover it and *.Domain.
	Domain string
	// DataDir holds the self-signed CA and ACME state (certmagic's storage
	// under DataDir/certmagic, autocert's cache under DataDir/autocert);
	// empty means ".".
	DataDir string
	// CertFiles and KeyFiles are the PEM files of files mode, pair by pair
	// (--tls-cert and --tls-key, repeated in the same order): the edge's
	// own pair for DOMAIN and *.DOMAIN, and pairs for the hostnames agents
	// bind of their own. A handshake gets the first pair whose certificate
	// covers its server name, as crypto/tls chooses among Certificates; the
	// first pair when none does.
	CertFiles, KeyFiles []string
	// ReloadInterval is how often files mode checks its files for change;
	// zero means 10s, negative disables polling (SIGHUP still reloads).
	ReloadInterval time.Duration

	// ACMECA is the ACME directory URL of the certmagic and autocert
	// modes; empty means Let's Encrypt's production directory. Point it at
	// a staging directory first.
	ACMECA string
	// ACMEEmail is the ACME account's contact address; empty registers an
	// account without one.
	ACMEEmail string
	// ACMECARoot is a PEM bundle of roots to trust for the ACME server's
	// own HTTPS (a private or test CA); empty means the system roots.
	ACMECARoot string

	// DNSProvider names the DNS provider that solves DNS-01 in certmagic
	// mode, one of DNSProviders; empty means none (then OnDemand must be
	// set, and challenges are HTTP-01 and TLS-ALPN-01).
	DNSProvider string
	// DNSCredentials holds the provider's settings by key (see
	// DNSProviders for the keys, e.g. "api_token"). A key missing here is
	// read from the key with "_file" appended (a file holding the value),
	// then from the provider's environment variable, then from that
	// variable with "_FILE" appended. Nil means environment only.
	DNSCredentials map[string]string
	// DNSResolvers are the DNS servers (host:port) asked to find the zone
	// and to check that a DNS-01 record has propagated; empty means the
	// system's resolvers.
	DNSResolvers []string
	// DNSPropagationTimeout bounds the wait for a DNS-01 record to be
	// visible; zero means 2m, negative skips the check.
	DNSPropagationTimeout time.Duration

	// OnDemand, in certmagic mode, issues a certificate per hostname at its
	// first handshake, if the HostPolicy allows it; false means only the
	// DOMAIN and *.DOMAIN certificates are served.
	OnDemand bool
	// OnDemandRateLimit is how many new on-demand hostnames may be
	// admitted at once, and again over each OnDemandRateWindow (a token
	// bucket); zero means 10, negative means no limit.
	OnDemandRateLimit int
	// OnDemandRateWindow is the window of OnDemandRateLimit; zero means
	// 1m.
	OnDemandRateWindow time.Duration

	// RetryBase is the wait after a failed attempt to obtain or renew a
	// certificate (certmagic, autocert); each further consecutive failure
	// doubles it, up to RetryMax. Zero means 1m.
	RetryBase time.Duration
	// RetryMax caps the wait between attempts; zero means 1h.
	RetryMax time.Duration
	// RenewCheckInterval is how often certmagic mode checks whether a
	// certificate needs renewal; zero means certmagic's 10m. A
	// certificate with less than five times this left is renewed.
	RenewCheckInterval time.Duration

	// getenv replaces os.Getenv (tests); nil means os.Getenv.
	getenv func(string) string
}

// HostPolicy decides whether a certificate may be issued for host at its
// first handshake (the on-demand modes). It returns nil to allow.
type HostPolicy func(ctx context.Context, host string) error

// Sentinel errors callers may branch on.
var (
	// ErrUnknownMode is returned by New for a mode that is not one of Modes.
	ErrUnknownMode = errors.New("unknown tls mode")
	// ErrUnknownDNSProvider is returned by New for a dns-provider that is
	// not one of DNSProviders.
	ErrUnknownDNSProvider = errors.New("unknown dns provider")
	// ErrHostNotAllowed is returned to a handshake for a hostname that is
	// neither DOMAIN nor allowed by the HostPolicy.
	ErrHostNotAllowed = errors.New("host not allowed")
	// ErrRateLimited is returned to a handshake for a new on-demand
	// hostname beyond OnDemandRateLimit.
	ErrRateLimited = errors.New("on-demand issuance rate limited")
)

// errNotStarted answers a handshake that comes before Start.
var errNotStarted = errors.New("certificates not started")

// provider is one mode's implementation.
type provider interface {
	start(ctx context.Context) error
	getCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error)
	reload() error
	close() error
	// notAfter returns the expiry of each certificate served, by name.
	notAfter() map[string]time.Time
}

// The optional parts of a provider.
type (
	// listenerUser answers challenges on the edge's listeners.
	listenerUser interface {
		useListeners(httpAddr, httpsAddr net.Addr)
	}
	// statusReporter says why it cannot serve every name it must.
	statusReporter interface{ status() error }
	// retryScheduler has failed names waiting for a retry.
	retryScheduler interface{ nextAttempt() time.Time }
)

// Manager serves the certificates of one mode.
type Manager struct {
	cfg    Config
	log    *slog.Logger
	policy HostPolicy
	p      provider
	counts *counters

	closeOnce sync.Once
}

// New checks cfg and returns a Manager; it does no I/O.
func New(cfg Config, log *slog.Logger, policy HostPolicy) (*Manager, error) {
	if cfg.Mode == "" {
		cfg.Mode = ModeSelfSigned
	}
	if cfg.DataDir == "" {
		cfg.DataDir = "."
	}
	if cfg.getenv == nil {
		cfg.getenv = os.Getenv
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if policy == nil {
		policy = func(context.Context, string) error { return nil }
	}
	cfg.Domain = strings.ToLower(strings.TrimSuffix(cfg.Domain, "."))
	m := &Manager{cfg: cfg, log: log.With("component", "certs", "mode", cfg.Mode), policy: policy, counts: newCounters()}
	p, err := m.newProvider()
	if err != nil {
		return nil, err
	}
	m.p = p
	return m, nil
}

func (m *Manager) newProvider() (provider, error) {
	c := m.cfg
	if c.Domain == "" {
		return nil, fmt.Errorf("tls-mode %s: domain is required", c.Mode)
	}
	switch c.Mode {
	case ModeSelfSigned:
		return &selfSigned{cfg: c, log: m.log, allow: m.allowHost}, nil
	case ModeFiles:
		if len(c.CertFiles) == 0 || len(c.KeyFiles) == 0 {
			return nil, fmt.Errorf("tls-mode files: tls-cert and tls-key are both required")
		}
		if len(c.CertFiles) != len(c.KeyFiles) {
			return nil, fmt.Errorf("tls-mode files: %d tls-cert but %d tls-key: give them in pairs", len(c.CertFiles), len(c.KeyFiles))
		}
		return &files{cfg: c, log: m.log}, nil
	case ModeCertmagic:
		return newCertmagic(c, m.log, m.allowHost, m.counts)
	case ModeAutocert:
		return newAutocert(c, m.log, m.allowHost, m.counts)
	}
	return nil, fmt.Errorf("tls-mode %q: %w (one of %v)", c.Mode, ErrUnknownMode, Modes)
}

// allowHost is the policy of the modes that issue at a handshake: DOMAIN
// itself, and any other name the HostPolicy allows now (a name under
// DOMAIN, or an agent's own hostname, bound in the registry).
func (m *Manager) allowHost(ctx context.Context, host string) error {
	host = hostOnly(host)
	if host == m.cfg.Domain {
		return nil
	}
	// A name under the domain, or an agent's own hostname: the edge's
	// policy asks the registry whether a tunnel is bound to it.
	if err := m.policy(ctx, host); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrHostNotAllowed, host, err)
	}
	return nil
}

// hostOnly is host without a port (an HTTP-01 request's Host may carry
// one) or trailing dot, in lower case.
func hostOnly(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	return strings.ToLower(strings.TrimSuffix(host, "."))
}

// UseListeners tells the Manager the bound addresses of the edge's plain
// and TLS listeners (nil: none), where the ACME modes answer HTTP-01 and
// TLS-ALPN-01 challenges; a challenge without its listener is not used.
// Call it before Start.
func (m *Manager) UseListeners(httpAddr, httpsAddr net.Addr) {
	if l, ok := m.p.(listenerUser); ok {
		l.useListeners(httpAddr, httpsAddr)
	}
}

// Status is nil when the Manager has a valid certificate for every name
// it serves without issuing at a handshake; else an error (wrapping
// ErrNoCertificate) that names each missing one and where obtaining it
// stands.
func (m *Manager) Status() error {
	if s, ok := m.p.(statusReporter); ok {
		return s.status()
	}
	return nil
}

// Stats returns the counts of attempts, failures and refused handshakes.
func (m *Manager) Stats() Stats {
	s := m.counts.stats()
	if r, ok := m.p.(retryScheduler); ok {
		s.NextAttempt = r.nextAttempt()
	}
	return s
}

// Start makes or loads the certificates and returns; in the ACME modes it
// does not wait for a CA (see the package doc). Background work (file
// polling, issuance, renewal) runs until Close.
func (m *Manager) Start(ctx context.Context) error {
	if err := m.p.start(ctx); err != nil {
		return fmt.Errorf("tls-mode %s: %w", m.cfg.Mode, err)
	}
	return nil
}

// TLSConfig returns the configuration for the public HTTPS listener: ALPN
// offers h2 and http/1.1, and acme-tls/1 in the modes that answer
// TLS-ALPN-01 challenges.
func (m *Manager) TLSConfig() *tls.Config {
	protos := []string{"h2", "http/1.1"}
	if m.cfg.Mode == ModeAutocert || m.cfg.Mode == ModeCertmagic {
		protos = append(protos, acmeTLS1)
	}
	return &tls.Config{
		MinVersion:     tls.VersionTLS12,
		NextProtos:     protos,
		GetCertificate: m.getCertificate,
	}
}

// getCertificate answers a handshake without SNI (a client that dialed an
// IP address, such as an agent given --edge IP:PORT) as one for DOMAIN:
// the ACME modes would otherwise have no name to pick a certificate by.
func (m *Manager) getCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	if hello.ServerName == "" {
		h := *hello
		h.ServerName = m.cfg.Domain
		hello = &h
	}
	cert, err := m.p.getCertificate(hello)
	if err != nil {
		m.counts.refusal(m.log, hello.ServerName, err)
	}
	return cert, err
}

// acmeTLS1 is the ALPN protocol of the TLS-ALPN-01 challenge (RFC 8737).
const acmeTLS1 = "acme-tls/1"

// HTTPHandler wraps the plain-HTTP handler so that ACME HTTP-01 challenges
// are answered in the modes that need them; other modes return next as is.
func (m *Manager) HTTPHandler(next http.Handler) http.Handler {
	if h, ok := m.p.(interface {
		httpHandler(http.Handler) http.Handler
	}); ok {
		return h.httpHandler(next)
	}
	return next
}

// ErrorLog returns a logger for http.Server.ErrorLog of the HTTPS listener:
// TLS handshake noise (scanners, clients that drop) goes to the injected
// logger at debug level.
func (m *Manager) ErrorLog() *log.Logger {
	return slog.NewLogLogger(m.log.Handler(), slog.LevelDebug)
}

// NotAfter returns the expiry time of each certificate the Manager serves,
// keyed by the certificate's first name (e.g. "*.example.com"), for the
// certificate-expiry metric. On-demand and autocert certificates appear once
// they have been served.
func (m *Manager) NotAfter() map[string]time.Time { return m.p.notAfter() }

// Reload re-reads certificates from disk (files mode); other modes ignore it.
func (m *Manager) Reload() error { return m.p.reload() }

// Close stops background work and waits for it.
func (m *Manager) Close() error {
	var err error
	m.closeOnce.Do(func() { err = m.p.close() })
	return err
}
