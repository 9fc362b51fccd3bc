package edge

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"net"
	"path"
	"strings"
	"sync"
	"time"
)

// TokenPolicy is one agent token and what it may do (a --tokens-file entry).
type TokenPolicy struct {
	// Token is the secret agents present. Required.
	Token string `yaml:"token"`
	// Name labels the token in logs; empty means a digest of the token.
	Name string `yaml:"name"`
	// Subdomains are the names the token may bind: exact names or
	// path.Match patterns such as "team-*". Empty means any name.
	Subdomains []string `yaml:"subdomains"`
	// MaxSessions bounds the token's concurrent agent sessions (sessions of
	// a reconnecting instance do not count against it). Zero means no limit.
	MaxSessions int `yaml:"max_sessions"`
	// MaxBindings bounds the token's bound hostnames. Zero means no limit.
	MaxBindings int `yaml:"max_bindings"`
}

// allows reports whether the token may bind the subdomain name.
func (p *TokenPolicy) allows(name string) bool {
	if len(p.Subdomains) == 0 {
		return true
	}
	for _, pat := range p.Subdomains {
		if ok, _ := path.Match(pat, name); ok {
			return true
		}
	}
	return false
}

// Validate checks one policy; i is its position, for the message.
func (p *TokenPolicy) Validate(i int) error {
	if strings.TrimSpace(p.Token) == "" {
		return fmt.Errorf("tokens-file entry %d: token is empty", i+1)
	}
	for _, pat := range p.Subdomains {
		if _, err := path.Match(pat, "x"); err != nil {
			return fmt.Errorf("tokens-file entry %d: subdomain pattern %q: %v", i+1, pat, err)
		}
	}
	if p.MaxSessions < 0 || p.MaxBindings < 0 {
		return fmt.Errorf("tokens-file entry %d: limits must not be negative", i+1)
	}
	return nil
}

// openPolicy is the policy of an edge configured with no tokens at all.
var openPolicy = &TokenPolicy{}

// authenticate returns the policy of tok, comparing against every known
// token in constant time; nil means refused. With no tokens configured
// every agent is accepted.
func (e *Edge) authenticate(tok string) *TokenPolicy {
	if len(e.policies) == 0 {
		return openPolicy
	}
	var found *TokenPolicy
	for _, p := range e.policies {
		if subtle.ConstantTimeCompare([]byte(p.Token), []byte(tok)) == 1 {
			found = p
		}
	}
	return found
}

func tokenID(tok string) string {
	if tok == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(tok))
	return hex.EncodeToString(sum[:8])
}

// authLimiter refuses addresses that failed authentication too often: after
// limit failures within window, the address is refused for window.
type authLimiter struct {
	limit  int
	window time.Duration

	mu    sync.Mutex
	state map[string]*authState
}

type authState struct {
	failures    int
	since       time.Time
	bannedUntil time.Time
}

// maxAuthStates bounds the limiter's memory under a spray of addresses.
const maxAuthStates = 65536

func hostOf(addr string) string {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return h
}

// banned reports whether addr is refused now.
func (l *authLimiter) banned(addr string, now time.Time) bool {
	if l.limit <= 0 {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	st := l.state[hostOf(addr)]
	return st != nil && now.Before(st.bannedUntil)
}

// fail records a failed authentication from addr.
func (l *authLimiter) fail(addr string, now time.Time) {
	if l.limit <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state == nil || len(l.state) >= maxAuthStates {
		l.state = make(map[string]*authState)
	}
	h := hostOf(addr)
	st := l.state[h]
	if st == nil || now.Sub(st.since) > l.window {
		st = &authState{since: now}
		l.state[h] = st
	}
	st.failures++
	if st.failures >= l.limit {
		st.bannedUntil = now.Add(l.window)
	}
}

// sweep forgets addresses whose window and ban have passed.
func (l *authLimiter) sweep(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for h, st := range l.state {
		if now.Sub(st.since) > l.window && now.After(st.bannedUntil) {
			delete(l.state, h)
		}
	}
}
