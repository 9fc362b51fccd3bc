package edge

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/ngstone/ngstone/mux"
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
	// Hostnames are the hostnames of their own, outside the edge's domain,
	// the token may bind (--hostname): exact names or path.Match patterns
	// such as "*.example.org" ('*' spans dots too). Empty means none.
	Hostnames []string `yaml:"hostnames"`
	// MaxSessions bounds the token's concurrent agent sessions (sessions of
	// a reconnecting instance do not count against it). Zero means no limit.
	MaxSessions int `yaml:"max_sessions"`
	// MaxBindings bounds the token's bound hostnames. Zero means no limit.
	MaxBindings int `yaml:"max_bindings"`
	// TCPPorts are the public TCP ports the token may hold (PORT or LO-HI
	// items, within the edge's --tcp-ports). Empty means any of them.
	TCPPorts []string `yaml:"tcp_ports"`
}

// allowsPort reports whether the token may hold public TCP port p.
func (p *TokenPolicy) allowsPort(port int) bool {
	if len(p.TCPPorts) == 0 {
		return true
	}
	rs, err := mux.ParsePorts(p.TCPPorts...)
	return err == nil && mux.PortsContain(rs, port)
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

// allowsHostname reports whether the token may bind host, a hostname of
// the agent's own.
func (p *TokenPolicy) allowsHostname(host string) bool {
	for _, pat := range p.Hostnames {
		if ok, _ := path.Match(strings.ToLower(pat), host); ok {
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
	for _, pat := range p.Hostnames {
		if _, err := path.Match(pat, "x"); err != nil || !strings.Contains(pat, ".") {
			return fmt.Errorf("tokens-file entry %d: hostname pattern %q: want a name such as app.example.org or *.example.org", i+1, pat)
		}
	}
	if _, err := mux.ParsePorts(p.TCPPorts...); err != nil {
		return fmt.Errorf("tokens-file entry %d: tcp_ports: %v", i+1, err)
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
// limit failures within window, the address is refused for window. IPv6
// addresses count by their /64, which one host usually holds whole.
//
// Its memory is bounded without ever lifting a ban early: failures and bans
// are kept in two tables of maxAuthStates entries each, and a full table
// forgets its least recently touched entry. Forgetting a failure count is
// cheap for an attacker to refill but lifts nothing; a ban is forgotten
// only when maxAuthStates newer bans push it out, each earned with limit
// failures from an address of its own.
type authLimiter struct {
	limit  int
	window time.Duration

	mu       sync.Mutex
	failures *simplelru.LRU[string, *authFailures]
	bans     *simplelru.LRU[string, *authBan]
}

// newAuthLimiter refuses an address after limit failures within window
// (limit 0: never).
func newAuthLimiter(limit int, window time.Duration) *authLimiter {
	failures, _ := simplelru.NewLRU[string, *authFailures](maxAuthStates, nil)
	bans, _ := simplelru.NewLRU[string, *authBan](maxAuthStates, nil)
	return &authLimiter{limit: limit, window: window, failures: failures, bans: bans}
}

type authFailures struct {
	n     int
	since time.Time
}

type authBan struct {
	until    time.Time
	answered time.Time // when a connection from it was last told so
}

// maxAuthStates bounds each of the limiter's tables.
const maxAuthStates = 65536

// banAnswerEvery bounds how often a banned address is answered with the
// reason (a TLS handshake and a control frame) instead of a closed
// connection.
const banAnswerEvery = time.Second

func hostOf(addr string) string {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return h
}

// limiterKey is the address a failure, a connection or a request in flight
// counts against: an IPv4 address, or an IPv6 address's /64, which one host
// usually holds whole (counted by the address, a /64 would get past every
// per-address bound).
func limiterKey(addr string) string {
	h := hostOf(addr)
	ip, err := netip.ParseAddr(h)
	if err != nil || ip.Is4() || ip.Is4In6() {
		return h
	}
	p, _ := ip.Prefix(64)
	return p.String()
}

// banned reports whether addr is refused now, until when, and whether this
// connection should be told so (at most once every banAnswerEvery).
func (l *authLimiter) banned(addr string, now time.Time) (until time.Time, answer, ok bool) {
	if l.limit <= 0 {
		return time.Time{}, false, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.bans.Get(limiterKey(addr))
	if !ok || !now.Before(b.until) {
		return time.Time{}, false, false
	}
	if answer = now.Sub(b.answered) >= banAnswerEvery; answer {
		b.answered = now
	}
	return b.until, answer, true
}

// fail records a failed authentication from addr; it reports whether that
// failure banned the address.
func (l *authLimiter) fail(addr string, now time.Time) (banned bool) {
	if l.limit <= 0 {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	k := limiterKey(addr)
	f, ok := l.failures.Get(k)
	if !ok || now.Sub(f.since) > l.window {
		f = &authFailures{since: now}
		l.failures.Add(k, f)
	}
	f.n++
	if f.n < l.limit {
		return false
	}
	l.failures.Remove(k)
	l.bans.Add(k, &authBan{until: now.Add(l.window)})
	return true
}

// sweep forgets failures whose window and bans whose time have passed.
func (l *authLimiter) sweep(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	drop(l.failures, func(f *authFailures) bool { return now.Sub(f.since) > l.window })
	drop(l.bans, func(b *authBan) bool { return !now.Before(b.until) })
}

// drop removes the entries of c that done reports true for.
func drop[V any](c *simplelru.LRU[string, *V], done func(*V) bool) {
	for _, k := range c.Keys() {
		if v, ok := c.Peek(k); ok && done(v) {
			c.Remove(k)
		}
	}
}
