package certs

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/mholt/acmez/v3/acme"
)

// Kinds of attempt, the kind label of Stats.
const (
	KindObtain = "obtain"
	KindRenew  = "renew"
)

// Reasons an attempt to obtain or renew a certificate failed, the reason
// label of Stats.Failures: a fixed set, so metrics stay bounded.
const (
	ReasonDNSUnreachable  = "dns_unreachable"  // the DNS provider's server or API did not answer
	ReasonDNSAuth         = "dns_auth"         // the DNS provider refused the credentials
	ReasonDNSUpdate       = "dns_update"       // the DNS provider refused or failed the change
	ReasonDNSPropagation  = "dns_propagation"  // the record never became visible at the resolvers
	ReasonACMEUnreachable = "acme_unreachable" // the CA did not answer
	ReasonRateLimited     = "rate_limited"     // the CA said to slow down
	ReasonValidation      = "validation"       // the CA could not validate the challenge
	ReasonACME            = "acme_error"       // the CA refused for another reason
	ReasonOther           = "other"
)

// Reasons a TLS handshake was refused, the reason label of Stats.Refused.
const (
	RefusedNoCertificate  = "no_certificate" // no valid certificate for the name yet (or any more)
	RefusedBackoff        = "backoff"        // issuing for the name failed recently; waiting
	RefusedHostNotAllowed = "host_not_allowed"
	RefusedRateLimited    = "rate_limited" // on-demand admission rate
	RefusedError          = "error"
)

// Sentinel errors of certificate attempts and handshakes.
var (
	// ErrNoCertificate answers a handshake for a name that has no valid
	// certificate: none obtained yet, or the one there expired.
	ErrNoCertificate = errors.New("no valid certificate")
	// ErrBackoff answers a handshake, or refuses an attempt, for a name
	// whose last attempt failed and whose backoff has not passed.
	ErrBackoff = errors.New("certificate attempts backing off")
	// ErrDNSUnreachable: the DNS provider's server or API did not answer.
	ErrDNSUnreachable = errors.New("dns provider unreachable")
	// ErrDNSAuth: the DNS provider refused the credentials.
	ErrDNSAuth = errors.New("dns provider refused the credentials")
	// ErrDNSUpdate: the DNS provider refused or failed a change.
	ErrDNSUpdate = errors.New("dns provider refused the change")
	// ErrDNSPropagation: a DNS-01 record never became visible.
	ErrDNSPropagation = errors.New("dns-01 record not visible")
	// ErrCAUnreachable: the ACME directory did not answer.
	ErrCAUnreachable = errors.New("acme ca unreachable")
)

// failureReason classifies an attempt's error, and says when the CA asked
// to be tried again (zero: it did not say).
func failureReason(err error) (string, time.Time) {
	var p acme.Problem
	switch {
	case errors.Is(err, ErrDNSUnreachable):
		return ReasonDNSUnreachable, time.Time{}
	case errors.Is(err, ErrDNSAuth):
		return ReasonDNSAuth, time.Time{}
	case errors.Is(err, ErrDNSUpdate):
		return ReasonDNSUpdate, time.Time{}
	case errors.Is(err, ErrDNSPropagation):
		return ReasonDNSPropagation, time.Time{}
	case errors.Is(err, ErrCAUnreachable):
		return ReasonACMEUnreachable, time.Time{}
	case errors.As(err, &p):
		return problemReason(p)
	case isNetError(err):
		return ReasonACMEUnreachable, time.Time{}
	}
	return ReasonOther, time.Time{}
}

func problemReason(p acme.Problem) (string, time.Time) {
	t := strings.TrimPrefix(p.Type, acme.ProblemTypeNamespace)
	switch {
	case t == "rateLimited" || p.Status == 429:
		return ReasonRateLimited, parseRetryAfter(p.Detail, time.Now())
	case t == "connection" || t == "dns" || t == "unauthorized" || t == "incorrectResponse" || t == "caa" || t == "tls":
		return ReasonValidation, time.Time{}
	}
	return ReasonACME, time.Time{}
}

func isNetError(err error) bool {
	var ne net.Error
	var ue *url.Error
	return errors.As(err, &ne) || errors.As(err, &ue) || errors.Is(err, context.DeadlineExceeded)
}

// refusalReason classifies a refused handshake's error.
func refusalReason(err error) string {
	switch {
	case errors.Is(err, ErrNoCertificate):
		return RefusedNoCertificate
	case errors.Is(err, ErrBackoff):
		return RefusedBackoff
	case errors.Is(err, ErrHostNotAllowed):
		return RefusedHostNotAllowed
	case errors.Is(err, ErrRateLimited):
		return RefusedRateLimited
	}
	return RefusedError
}

// Count is one counter of Stats.
type Count struct {
	Kind, Reason string
	N            uint64
}

// Stats are the Manager's counters since New, for metrics.
type Stats struct {
	// Attempts to obtain or renew, by Kind (Reason empty).
	Attempts []Count
	// Failures of those attempts, by Kind and Reason.
	Failures []Count
	// Refused TLS handshakes, by Reason (Kind empty).
	Refused []Count
	// NextAttempt is the earliest scheduled retry of a failed name; zero
	// when nothing is failing.
	NextAttempt time.Time
}

// counters holds Stats' counts. Keys are the fixed kinds and reasons, so
// the maps stay small.
type counters struct {
	mu       sync.Mutex
	attempts map[string]uint64
	failures map[[2]string]uint64
	refused  map[string]uint64
	// logged is when each refusal reason was last logged: one line per
	// reason per refusalLogEvery, however many handshakes.
	logged map[string]time.Time
}

// refusalLogEvery spaces out the log lines of refused handshakes.
const refusalLogEvery = 30 * time.Second

func newCounters() *counters {
	return &counters{attempts: map[string]uint64{}, failures: map[[2]string]uint64{}, refused: map[string]uint64{}, logged: map[string]time.Time{}}
}

func (c *counters) attempt(kind string) {
	c.mu.Lock()
	c.attempts[kind]++
	c.mu.Unlock()
}

func (c *counters) failure(kind, reason string) {
	c.mu.Lock()
	c.failures[[2]string{kind, reason}]++
	c.mu.Unlock()
}

// refusal counts a refused handshake and logs it, at most once per
// refusalLogEvery and reason. Names outside the policy are scanners'
// noise: debug only.
func (c *counters) refusal(log *slog.Logger, host string, err error) {
	reason := refusalReason(err)
	now := time.Now()
	c.mu.Lock()
	c.refused[reason]++
	n := c.refused[reason]
	speak := now.Sub(c.logged[reason]) >= refusalLogEvery
	if speak {
		c.logged[reason] = now
	}
	c.mu.Unlock()
	level := slog.LevelWarn
	if reason == RefusedHostNotAllowed || reason == RefusedRateLimited {
		level = slog.LevelDebug
	} else if !speak {
		return
	}
	log.Log(context.Background(), level, "TLS handshake refused", "host", host, "reason", reason, "refused_total", n, "err", err)
}

func (c *counters) stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	var s Stats
	for k, n := range c.attempts {
		s.Attempts = append(s.Attempts, Count{Kind: k, N: n})
	}
	for k, n := range c.failures {
		s.Failures = append(s.Failures, Count{Kind: k[0], Reason: k[1], N: n})
	}
	for r, n := range c.refused {
		s.Refused = append(s.Refused, Count{Reason: r, N: n})
	}
	return s
}
