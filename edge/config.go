package edge

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// Config is everything an edge needs. DefaultConfig fills it for production;
// the zero value of each field is described on it.
type Config struct {
	// Domain is the public domain; tunnels are NAME.Domain. Required.
	Domain string
	// HTTPAddr is the plain-HTTP visitor listener; empty disables it.
	HTTPAddr string
	// HTTPSAddr is the HTTPS visitor listener; empty disables it.
	HTTPSAddr string
	// ControlAddr is the agents' TLS listener. Required.
	ControlAddr string
	// AdminAddr is the admin API listener; empty disables it.
	AdminAddr string
	// AdminToken, when set, is the bearer token every admin endpoint but
	// /healthz requires. Empty leaves the admin API open, which Validate
	// allows only on a loopback AdminAddr.
	AdminToken string `json:"-"`
	// Version and Commit label ngstone_build_info; empty means "dev" and "".
	Version, Commit string
	// TLS selects how certificates are obtained.
	TLS certs.Config
	// Tokens are the agent tokens accepted in hello. Empty means any agent
	// may connect (an open edge, for development).
	Tokens []string
	// TokenPolicies are tokens with limits (the --tokens-file entries),
	// accepted in addition to Tokens.
	TokenPolicies []TokenPolicy
	// AuthFailureLimit failed hellos from one address within
	// AuthFailureWindow get that address refused for AuthFailureWindow.
	// Zero disables the limit.
	AuthFailureLimit int
	// AuthFailureWindow is the limiter's window; zero means 1m.
	AuthFailureWindow time.Duration
	// MaxStreamsPerSession bounds a session's concurrent visitor requests;
	// visitors past it get 503 with Retry-After. Zero means no limit.
	MaxStreamsPerSession int
	// IdleStreams bounds the streams a session keeps open between
	// exchanges, for the next ones; zero means 64.
	IdleStreams int
	// IdleStreamTimeout closes a stream that carried no exchange for that
	// long; zero means 30s.
	IdleStreamTimeout time.Duration
	// MaxConns bounds concurrent visitor connections in total, and
	// MaxConnsPerIP per client address; connections past them are closed at
	// once. Zero means no limit.
	MaxConns, MaxConnsPerIP int
	// ProxyProtocol reads a PROXY protocol header (v1 or v2) on the visitor
	// listeners from the load balancers in ProxyProtocolFrom, whose address
	// is then the visitor's (for X-Forwarded-For, limits and --allow-cidr);
	// a connection from any other source that sends one is refused.
	ProxyProtocol     bool
	ProxyProtocolFrom []netip.Prefix
	// MaxRequestsPerIP bounds one visitor address's requests in flight to
	// one tunnel; past it visitors get 429 visitor_limit, so that one
	// address cannot hold all of a session's streams. Zero means no limit.
	MaxRequestsPerIP int
	// MaxAgentConns bounds concurrent control connections in total, and
	// MaxAgentConnsPerIP per address, before any TLS work; connections past
	// them are closed at once. Zero means no limit.
	MaxAgentConns, MaxAgentConnsPerIP int
	// WriteTimeout cuts a visitor that has read nothing of its response
	// for this long; it is counted afresh at every write, so a slow reader
	// is not cut. Zero means 60s.
	WriteTimeout time.Duration
	// ReadTimeout cuts a visitor that has sent nothing of its request body
	// for this long, counted afresh at every read. Zero means 60s.
	ReadTimeout time.Duration
	// MaxResponseHead bounds the head of an agent's response, informational
	// heads included (502 bad_response past it); the agent learns it in
	// hello_ok and holds local services to it. Zero means 1 MiB.
	MaxResponseHead int64
	// ReadHeaderTimeout bounds a visitor's TLS handshake and request
	// headers (slow clients are cut off). Zero means 10s.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes idle keep-alive visitor connections. Zero means 2m.
	IdleTimeout time.Duration
	// MaxRequestBody bounds a visitor request body in bytes (413 past it).
	// Zero means no limit.
	MaxRequestBody int64
	// VerifyWebhookMaxBody bounds the body the edge reads to check a
	// tunnel's webhook signature (403 webhook_unverified past it). Zero
	// means 10 MiB.
	VerifyWebhookMaxBody int64
	// OAuthProviders are the sign-in providers agents may name (--oauth);
	// none means a bind with OAuth is refused. The callback host is
	// auth.DOMAIN, which ReservedNames must hold.
	OAuthProviders []OAuthProvider
	// OAuthSessionDuration bounds a visitor's sign-in; OAuthIdleTimeout
	// ends one unused for that long. Zero means 24h and 2h.
	OAuthSessionDuration, OAuthIdleTimeout time.Duration
	// OAuthKey (32 bytes) seals sign-in cookies. Nil derives it from the
	// cluster key, or keeps one in the data dir (oauth.key).
	OAuthKey []byte `json:"-"`
	// ReservedNames cannot be bound. Nil means mux.DefaultReserved;
	// an empty non-nil slice reserves nothing.
	ReservedNames []string
	// DrainTimeout bounds how long an evicted or abandoned session may
	// finish requests it already accepted; zero closes it at once.
	DrainTimeout time.Duration
	// HeartbeatTimeout is the freshness window: a session with no heartbeat
	// for this long is dead. Zero means 45s.
	HeartbeatTimeout time.Duration
	// TunnelTimeout bounds how long the edge waits for an agent's response
	// headers, and for it to take any of a request body (504
	// tunnel_timeout). Zero means 60s.
	TunnelTimeout time.Duration
	// HelloTimeout bounds the time from a control connection's accept to a
	// valid hello, TLS handshake included. Zero means 10s.
	HelloTimeout time.Duration
	// ShutdownGrace bounds how long a graceful shutdown waits for in-flight
	// requests. Zero means 30s.
	ShutdownGrace time.Duration
	// HandshakeSettle is how long a graceful shutdown, having stopped new
	// visitor handshakes, still takes the ones under way: a visitor whose
	// SYN-ACK left before the stop is connected in its own eyes and sends
	// its request. One whose round trip is longer than this is reset.
	// Zero means 250ms; within ShutdownGrace.
	HandshakeSettle time.Duration
	// TCPPorts are the public ports TCP tunnels may be given. The edge
	// listens on every one of them, on the host of HTTPSAddr (else of
	// HTTPAddr). Empty means no TCP tunnels.
	TCPPorts []mux.PortRange
	// TCPPortReserve keeps a port for the token that held it for this
	// long after its last release, so that the token's next agent for the
	// same local address gets it back and no other token takes it. Zero
	// keeps no port after its release.
	TCPPortReserve time.Duration
	// TCPIdleTimeout closes a TCP tunnel's connection that carried no byte
	// either way for this long. Zero means 1h.
	TCPIdleTimeout time.Duration
	// Mux tunes yamux; zero fields take mux defaults.
	Mux mux.Config
	// Store holds the bindings; nil means a registry.Memory of this edge,
	// or with RegistryFile a registry.Bolt. Cluster, when set, replaces it.
	Store registry.Store `json:"-"`
	// RegistryFile is the file of a single edge's registry, which keeps
	// the bindings across restarts (the CLI's --data-dir/registry.db);
	// empty keeps them in memory. Not with Cluster.
	RegistryFile string
	// Cluster shares the registry with other edges; nil runs alone.
	Cluster *ClusterConfig `json:"-"`
}

// DefaultConfig returns the documented defaults of `ngstone edge`.
func DefaultConfig() Config {
	return Config{
		HTTPAddr:         ":80",
		HTTPSAddr:        ":443",
		ControlAddr:      ":4443",
		AdminAddr:        "127.0.0.1:9180",
		TLS:              certs.Config{Mode: certs.ModeSelfSigned, DataDir: "."},
		ReservedNames:    append([]string(nil), mux.DefaultReserved...),
		DrainTimeout:     10 * time.Second,
		HeartbeatTimeout: 45 * time.Second,
		TunnelTimeout:    60 * time.Second,
		HelloTimeout:     10 * time.Second,
		ShutdownGrace:    30 * time.Second,
		HandshakeSettle:  250 * time.Millisecond,
		Mux:              mux.DefaultConfig(),
		TCPPortReserve:   24 * time.Hour,
		TCPIdleTimeout:   time.Hour,

		ReadHeaderTimeout:    10 * time.Second,
		IdleTimeout:          2 * time.Minute,
		AuthFailureLimit:     5,
		AuthFailureWindow:    time.Minute,
		MaxStreamsPerSession: 1024,
		IdleStreams:          64,
		IdleStreamTimeout:    30 * time.Second,
		MaxConns:             20000,
		MaxConnsPerIP:        1000,
		MaxRequestsPerIP:     64,
		MaxAgentConns:        10000,
		MaxAgentConnsPerIP:   256,
		WriteTimeout:         60 * time.Second,
		ReadTimeout:          60 * time.Second,
		MaxResponseHead:      mux.MaxResponseHead,
		VerifyWebhookMaxBody: 10 << 20,
		OAuthSessionDuration: 24 * time.Hour,
		OAuthIdleTimeout:     2 * time.Hour,
	}
}

// withDefaults fills zero durations and a nil reserved list.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	for _, f := range []struct{ v, def *time.Duration }{
		{&c.HeartbeatTimeout, &d.HeartbeatTimeout}, {&c.TunnelTimeout, &d.TunnelTimeout},
		{&c.HelloTimeout, &d.HelloTimeout}, {&c.ShutdownGrace, &d.ShutdownGrace},
		{&c.HandshakeSettle, &d.HandshakeSettle},
		{&c.ReadHeaderTimeout, &d.ReadHeaderTimeout}, {&c.IdleTimeout, &d.IdleTimeout},
		{&c.AuthFailureWindow, &d.AuthFailureWindow}, {&c.WriteTimeout, &d.WriteTimeout},
		{&c.ReadTimeout, &d.ReadTimeout}, {&c.IdleStreamTimeout, &d.IdleStreamTimeout},
		{&c.TCPIdleTimeout, &d.TCPIdleTimeout},
		{&c.OAuthSessionDuration, &d.OAuthSessionDuration}, {&c.OAuthIdleTimeout, &d.OAuthIdleTimeout},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	if c.ReservedNames == nil {
		c.ReservedNames = d.ReservedNames
	}
	if c.VerifyWebhookMaxBody <= 0 {
		c.VerifyWebhookMaxBody = d.VerifyWebhookMaxBody
	}
	if c.MaxResponseHead <= 0 {
		c.MaxResponseHead = d.MaxResponseHead
	}
	if c.IdleStreams <= 0 {
		c.IdleStreams = d.IdleStreams
	}
	c.TLS.Domain = c.Domain
	return c
}

// Validate reports the first invalid field, naming it as the CLI flag.
func (c Config) Validate() error {
	if c.Domain == "" {
		return errors.New("domain: required (the public domain, e.g. tunnels.example.com)")
	}
	if h, err := NormalizeHost(c.Domain); err != nil || h != c.Domain {
		return fmt.Errorf("domain %q: must be a lower-case DNS name without port or trailing dot", c.Domain)
	}
	if c.ControlAddr == "" {
		return errors.New("control-addr: required")
	}
	for flag, addr := range map[string]string{"http-addr": c.HTTPAddr, "https-addr": c.HTTPSAddr, "control-addr": c.ControlAddr, "admin-addr": c.AdminAddr} {
		if addr == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("%s %q: want HOST:PORT or :PORT", flag, addr)
		}
	}
	if c.AdminAddr != "" && c.AdminToken == "" && !isLoopbackAddr(c.AdminAddr) {
		return fmt.Errorf("admin-addr %q is not a loopback address: set admin-token (NGSTONE_ADMIN_TOKEN) so the admin API is not open to the network", c.AdminAddr)
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("drain-timeout %s: must not be negative", c.DrainTimeout)
	}
	if c.HeartbeatTimeout < 0 {
		return fmt.Errorf("heartbeat-timeout %s: must not be negative", c.HeartbeatTimeout)
	}
	if c.ProxyProtocol && len(c.ProxyProtocolFrom) == 0 {
		return errors.New("proxy-protocol: name the load balancers it comes from with proxy-protocol-from (e.g. 10.0.0.0/8)")
	}
	if c.TCPPortReserve < 0 {
		return fmt.Errorf("tcp-port-reserve %s: must not be negative", c.TCPPortReserve)
	}
	if c.RegistryFile != "" && (c.Cluster != nil || c.Store != nil) {
		return errors.New("a registry file is for an edge that runs alone, on its own store")
	}
	for i := range c.TokenPolicies {
		if err := c.TokenPolicies[i].Validate(i); err != nil {
			return err
		}
	}
	if c.MaxStreamsPerSession < 0 || c.MaxConns < 0 || c.MaxConnsPerIP < 0 || c.MaxRequestBody < 0 || c.AuthFailureLimit < 0 ||
		c.MaxRequestsPerIP < 0 || c.MaxAgentConns < 0 || c.MaxAgentConnsPerIP < 0 {
		return errors.New("limits (max-streams-per-session, max-conns, max-conns-per-ip, max-requests-per-ip, max-agent-conns, max-agent-conns-per-ip, max-request-body, auth-failure-limit) must not be negative")
	}
	if c.MaxResponseHead > mux.MaxResponseHead {
		return fmt.Errorf("max-response-head %d: at most %d (what an agent holds its local service to)", c.MaxResponseHead, mux.MaxResponseHead)
	}
	for _, n := range c.ReservedNames {
		if err := mux.ValidateSubdomain(n, nil); err != nil {
			return fmt.Errorf("reserved-names %q: %v", n, err)
		}
	}
	return c.validateOAuth()
}

// validateOAuth checks the sign-in providers: each valid, each name once,
// and the callback host reserved, so that no agent can bind it.
func (c Config) validateOAuth() error {
	seen := map[string]bool{}
	for _, p := range c.OAuthProviders {
		if err := p.validate(); err != nil {
			return err
		}
		if seen[p.Name] {
			return fmt.Errorf("oauth-provider %s: named twice", p.Name)
		}
		seen[p.Name] = true
	}
	if len(c.OAuthProviders) > 0 && !slices.Contains(c.ReservedNames, oauthHost) {
		return fmt.Errorf("oauth-provider: keep %q in reserved-names: %s.%s is where providers send visitors back", oauthHost, oauthHost, c.Domain)
	}
	if c.OAuthKey != nil && len(c.OAuthKey) != 32 {
		return fmt.Errorf("oauth key: want 32 bytes, have %d", len(c.OAuthKey))
	}
	return nil
}

// isLoopbackAddr reports whether HOST:PORT listens on loopback only; an
// empty host listens on every interface.
func isLoopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
