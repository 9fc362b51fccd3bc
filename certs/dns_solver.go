package certs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/certmagic"
	"github.com/mholt/acmez/v3/acme"
	"github.com/miekg/dns"
	"go.uber.org/zap"
)

// dnsSolver is certmagic's DNS-01 solver with errors that name what was
// asked: certmagic's propagation timeout ends in "last error: <nil>" when
// the resolvers answered but without the record, and its clean-up of a
// record it never presented fails with "no memory of presenting", which
// acmez logs as an error after every failed Present.
type dnsSolver struct {
	inner     *certmagic.DNS01Solver
	provider  string
	resolvers []string // as configured; empty: the system's
	timeout   time.Duration

	mu        sync.Mutex
	presented map[string]bool // by challenge key authorization
}

func newDNSSolver(cfg Config, dp certmagic.DNSProvider, zl *zap.Logger) *dnsSolver {
	propagation := cfg.DNSPropagationTimeout
	if propagation < 0 {
		propagation = -1 // the one value certmagic reads as "skip the check"
	}
	timeout := propagation
	if timeout == 0 {
		timeout = 2 * time.Minute
	}
	return &dnsSolver{
		inner: &certmagic.DNS01Solver{DNSManager: certmagic.DNSManager{
			DNSProvider:        dp,
			Resolvers:          cfg.DNSResolvers,
			PropagationTimeout: propagation,
			Logger:             zl,
		}},
		provider:  cfg.DNSProvider,
		resolvers: cfg.DNSResolvers,
		timeout:   timeout,
		presented: map[string]bool{},
	}
}

func (s *dnsSolver) Present(ctx context.Context, ch acme.Challenge) error {
	if err := s.inner.Present(ctx, ch); err != nil {
		if strings.Contains(err.Error(), "could not determine zone") {
			// certmagic's zone lookup error wraps nothing (%v).
			err = fmt.Errorf("%w: %w", ErrDNSUnreachable, err)
		}
		return fmt.Errorf("dns-provider %s: set TXT %s (zone looked up at resolvers %v): %w", s.provider, ch.DNS01TXTRecordName(), s.resolverList(), err)
	}
	s.mu.Lock()
	s.presented[ch.DNS01KeyAuthorization()] = true
	s.mu.Unlock()
	return nil
}

func (s *dnsSolver) Wait(ctx context.Context, ch acme.Challenge) error {
	err := s.inner.Wait(ctx, ch)
	if err == nil || ctx.Err() != nil || errors.Unwrap(err) != nil {
		return err
	}
	// certmagic's own timeout: say what the resolvers answered.
	name := ch.DNS01TXTRecordName()
	return fmt.Errorf("%w: TXT %s did not show the challenge's value within %v at %s: %s",
		ErrDNSPropagation, name, s.timeout, s.askedWhere(), s.answers(ctx, name, ch.DNS01KeyAuthorization()))
}

// CleanUp removes only what Present set.
func (s *dnsSolver) CleanUp(ctx context.Context, ch acme.Challenge) error {
	key := ch.DNS01KeyAuthorization()
	s.mu.Lock()
	presented := s.presented[key]
	delete(s.presented, key)
	s.mu.Unlock()
	if !presented {
		return nil
	}
	return s.inner.CleanUp(ctx, ch)
}

func (s *dnsSolver) resolverList() []string {
	return certmagic.RecursiveNameservers(s.resolvers)
}

func (s *dnsSolver) askedWhere() string {
	if len(s.resolvers) == 0 {
		return fmt.Sprintf("the zone's authoritative nameservers (found through the system resolvers %v; set dns-resolvers to choose)", s.resolverList())
	}
	return fmt.Sprintf("dns-resolvers %v", s.resolvers)
}

// answers asks each resolver once for name's TXT records and says what
// each answered.
func (s *dnsSolver) answers(ctx context.Context, name, want string) string {
	var out []string
	c := &dns.Client{Timeout: 5 * time.Second}
	for _, r := range s.resolverList() {
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(name), dns.TypeTXT)
		in, _, err := c.ExchangeContext(ctx, m, r)
		out = append(out, r+" "+describeTXTAnswer(in, err, want))
	}
	return strings.Join(out, "; ")
}

func describeTXTAnswer(in *dns.Msg, err error, want string) string {
	if err != nil {
		return "did not answer: " + err.Error()
	}
	if in.Rcode != dns.RcodeSuccess {
		return "answered " + dns.RcodeToString[in.Rcode]
	}
	n := 0
	for _, rr := range in.Answer {
		if t, ok := rr.(*dns.TXT); ok {
			if strings.Join(t.Txt, "") == want {
				return "answered with the value now (it came late)"
			}
			n++
		}
	}
	return fmt.Sprintf("answered %d TXT record(s), none with this challenge's value", n)
}
