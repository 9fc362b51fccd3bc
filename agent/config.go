package agent

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// Config is everything an agent needs. DefaultConfig gives the documented
// defaults; the zero value of each field is described on it.
//
// An agent serves one tunnel or several on one session (one instance):
// the embedded Tunnel (`ngstone http`), or Tunnels when it has any
// (`ngstone start`).
type Config struct {
	// Tunnel is the agent's one tunnel when Tunnels is empty.
	Tunnel
	// Tunnels are the agent's tunnels, each named, each bound, taken back
	// and released on its own; empty means the one of Tunnel.
	Tunnels []Tunnel
	// Edge is the edge's control address, HOST:PORT. Required.
	Edge string
	// Token is presented in hello; empty for an open edge.
	Token string
	// CAFile is a PEM bundle trusted for the edge's certificate; empty
	// means the system roots.
	CAFile string
	// RootCAs, when set, is trusted instead of CAFile (the embedded edge).
	RootCAs *x509.CertPool `json:"-"`
	// ServerName is the name the edge's certificate must match (and the
	// TLS server name sent); empty means the host part of Edge. Set it when
	// dialing the edge by address: --edge 203.0.113.7:4443 --server-name
	// tunnels.example.com.
	ServerName string
	// Insecure skips verification of the edge's certificate.
	Insecure bool
	// HeartbeatInterval is how often the agent heartbeats. Zero means 15s.
	HeartbeatInterval time.Duration
	// HeartbeatTimeout: with no answer to heartbeats for this long the
	// agent declares its session dead and dials anew. Zero means 45s.
	HeartbeatTimeout time.Duration
	// DialTimeout bounds one connect to the edge as a whole: its staggered
	// attempts, each a TCP dial, TLS handshake, hello and binds. Zero
	// means 10s.
	DialTimeout time.Duration
	// BackoffBase and BackoffCap shape the decorrelated-jitter reconnect
	// backoff. Zero means 500ms and 30s.
	BackoffBase, BackoffCap time.Duration
	// DrainTimeout bounds how long an abandoned session keeps answering
	// requests it already accepted, and how long a graceful stop waits for
	// in-flight requests. Zero means 10s.
	DrainTimeout time.Duration
	// Mux tunes yamux; zero fields take mux defaults.
	Mux mux.Config
	// InstanceID identifies this agent process across reconnects; empty
	// means New mints one.
	InstanceID string
	// InspectAddr, when set, is where the agent serves its inspector: a
	// web page and JSON API of the last requests relayed, with their
	// bodies, and their replay (loopback addresses only).
	InspectAddr string
	// InspectPorts: when InspectAddr's port is taken, the agent tries the
	// next ones, up to this many more. Zero means InspectAddr only.
	InspectPorts int
	// LogRequests logs a line for each request relayed, when its exchange
	// ends: method, path, the status sent back, the agent's own error code
	// if it answered for the local service, and the duration. An upgraded
	// connection (WebSocket) is logged when it closes.
	LogRequests bool
	// OnStatus, when set, is called on every change of status, from the
	// agent's goroutine; it must not block.
	OnStatus func(Status) `json:"-"`
}

// Tunnel is one public name and the local service behind it, with what
// applies to its requests.
type Tunnel struct {
	// Name names the tunnel in the inspector, the local API and messages
	// (a key of the tunnels: file); empty for the command line's.
	Name string
	// Proto is what the tunnel carries: "http" (HTTP to a public name),
	// "tcp" (the bytes of each connection, to a public TCP port of the
	// edge), or "tls" (TLS connections to a public name, passed through
	// whole by SNI: the local service has the certificate). Empty means
	// http.
	Proto string
	// RemotePort, for a TCP tunnel, is the public port to bind; zero takes
	// the port the edge keeps for the token and this tunnel's local
	// address (or name), else a free one.
	RemotePort int
	// Local is the local service: PORT, HOST:PORT or an http(s) URL (a
	// TCP tunnel's: PORT or HOST:PORT). Required.
	Local string
	// ProxyProtocol, for a TCP or TLS tunnel, sends the local service a
	// PROXY protocol v2 header before the visitor's bytes, with the
	// visitor's address and the edge's address it connected to. False
	// sends the bytes alone.
	ProxyProtocol bool
	// Subdomain is the name to bind; empty asks the edge for a random one.
	Subdomain string
	// Hostname, instead of Subdomain, asks for a whole hostname of the
	// agent's own (app.example.org, a CNAME to the edge), which the token
	// must allow. Empty means none.
	Hostname string
	// AllowCIDR and DenyCIDR restrict the visitors the edge lets reach the
	// tunnel (prefixes such as 192.0.2.0/24 or 2001:db8::/32): a visitor
	// in a DenyCIDR prefix, or outside every AllowCIDR prefix when there are
	// any, gets 403 ip_denied from the edge. Empty lets everyone in.
	AllowCIDR, DenyCIDR []string
	// VerifyWebhook has the edge check each request's signature before it
	// crosses the tunnel: "github", "stripe", "slack", or "hmac" (of the
	// body, in the field VerifyWebhookHeader), made with
	// VerifyWebhookSecret; a request that fails gets 403
	// webhook_unverified. Empty checks nothing.
	VerifyWebhook, VerifyWebhookSecret, VerifyWebhookHeader string
	// OAuth has the edge let in only visitors signed in with the provider
	// of that name (one the edge's operator configured) and, when any of
	// the lists is set, whose email is in OAuthAllowEmail, whose domain is
	// in OAuthAllowDomain, or who has a claim of OAuthAllowClaim
	// ("groups=dev"); others get 403 oauth_denied. OAuthAllowPreflight lets
	// CORS preflights through unsigned. Empty lets anyone in.
	OAuth                                              string
	OAuthAllowEmail, OAuthAllowDomain, OAuthAllowClaim []string
	OAuthAllowPreflight                                bool
	// RequestHeaderAdd ("Name: value") and RequestHeaderRemove (names) are
	// applied to each request before it goes to the local service,
	// ResponseHeaderAdd and ResponseHeaderRemove to each response before it
	// goes back. The fields the edge sets about the visitor
	// (X-Forwarded-*) and the message's framing cannot be touched.
	RequestHeaderAdd, RequestHeaderRemove   []string
	ResponseHeaderAdd, ResponseHeaderRemove []string
	// UpstreamTimeout bounds the wait for the local service's response
	// headers, and for it to take any of a request body (504
	// upstream_timeout). Zero means 30s.
	UpstreamTimeout time.Duration
	// UpstreamDialTimeout bounds a connection to the local service
	// (502 upstream_unreachable). Zero means 5s.
	UpstreamDialTimeout time.Duration
	// UpstreamCAFile is a PEM bundle trusted for an https:// local
	// service's certificate; empty means the system roots.
	UpstreamCAFile string
	// UpstreamInsecure skips verification of an https:// local service's
	// certificate (a development server's self-signed one).
	UpstreamInsecure bool
	// UpstreamProtocol is what the agent speaks to the local service:
	// "http1" (HTTP/1.1), or "http2" (h2c, HTTP/2 without TLS, to an
	// http:// local service; h2 through ALPN to an https:// one), which
	// gRPC servers need. Empty means http1.
	UpstreamProtocol string
	// BasicAuth, when set, lists the USER:PASSWORD pairs of HTTP basic
	// authentication: a request that carries none of them gets 401
	// basic_auth_required from the agent and never reaches the local
	// service.
	BasicAuth []string `json:"-"`
	// Pool shares the tunnel's name (or port) with the other agents of the
	// token that ask for it with Pool: the edge spreads visitors over them
	// and takes out one whose local service fails. It needs a name
	// (Subdomain, Hostname; RemotePort for TCP).
	Pool bool
	// PoolHealthPath, for an HTTP pool, is a path of the local service
	// the agent asks every PoolHealthInterval: an answer other than 2xx
	// takes the agent out of the pool until it answers 2xx again. Empty:
	// the agent checks that its local service accepts connections.
	PoolHealthPath string
	// PoolHealthInterval is how often a pool member checks its local
	// service. Zero means 2s.
	PoolHealthInterval time.Duration
	// HostHeader replaces the Host field of requests to the local service:
	// "rewrite" gives the local service's own host and port (what a dev
	// server that checks Host expects), another value that host. Empty
	// keeps the visitor's; X-Forwarded-Host always carries it.
	HostHeader string
}

// AsksName reports whether one of c's tunnels asks for a name of its own
// (a random name has nothing to take back after a restart); a TCP tunnel
// always does: the port the edge keeps for it.
func (c Config) AsksName() bool {
	return slices.ContainsFunc(c.tunnels(), func(t Tunnel) bool { return t.Subdomain != "" || t.Hostname != "" || t.isTCP() })
}

// TCPTunnels counts c's TCP tunnels.
func (c Config) TCPTunnels() int {
	n := 0
	for _, t := range c.tunnels() {
		if t.isTCP() {
			n++
		}
	}
	return n
}

// tunnels returns the agent's tunnels: Tunnels, or the embedded one.
func (c Config) tunnels() []Tunnel {
	if len(c.Tunnels) > 0 {
		return c.Tunnels
	}
	return []Tunnel{c.Tunnel}
}

// The tunnels' protocols (Tunnel.Proto).
const (
	ProtoHTTP = "http"
	ProtoTCP  = mux.ProtoTCP
	ProtoTLS  = mux.ProtoTLS
)

// isTCP reports whether t relays a public TCP port.
func (t Tunnel) isTCP() bool { return t.Proto == ProtoTCP }

// relaysBytes reports whether t relays connections byte for byte: a TCP
// port's, or a TLS passthrough's.
func (t Tunnel) relaysBytes() bool { return t.Proto == ProtoTCP || t.Proto == ProtoTLS }

// label is what the edge keeps a TCP tunnel's port for, with its token:
// its name, or the command line's local address.
func (t Tunnel) label() string {
	if t.Name != "" {
		return "name:" + t.Name
	}
	return "local:" + t.Local
}

// The upstream protocols (Config.UpstreamProtocol).
const (
	ProtocolHTTP1 = "http1"
	ProtocolHTTP2 = "http2"
)

// DefaultInspectAddr is where the inspector listens by default; when its
// port is taken the agent tries the next DefaultInspectPorts.
const (
	DefaultInspectAddr  = "127.0.0.1:4040"
	DefaultInspectPorts = 9
)

// DefaultConfig returns the documented defaults of `ngstone http`: the
// CLI's flags start from it, and so do the tests' agents.
func DefaultConfig() Config {
	return Config{
		Tunnel:            DefaultTunnel(),
		InspectAddr:       DefaultInspectAddr,
		InspectPorts:      DefaultInspectPorts,
		HeartbeatInterval: 15 * time.Second,
		HeartbeatTimeout:  45 * time.Second,
		DialTimeout:       10 * time.Second,
		BackoffBase:       500 * time.Millisecond,
		BackoffCap:        30 * time.Second,
		DrainTimeout:      10 * time.Second,
		Mux:               mux.DefaultConfig(),
	}
}

// DefaultTunnel returns a tunnel's documented defaults.
func DefaultTunnel() Tunnel {
	return Tunnel{UpstreamTimeout: 30 * time.Second, UpstreamDialTimeout: 5 * time.Second, UpstreamProtocol: ProtocolHTTP1,
		PoolHealthInterval: 2 * time.Second}
}

func setDefault(v *time.Duration, def time.Duration) {
	if *v <= 0 {
		*v = def
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	c.Tunnel = c.Tunnel.withDefaults()
	c.Tunnels = slices.Clone(c.Tunnels)
	for i := range c.Tunnels {
		c.Tunnels[i] = c.Tunnels[i].withDefaults()
	}
	setDefault(&c.HeartbeatInterval, d.HeartbeatInterval)
	setDefault(&c.HeartbeatTimeout, d.HeartbeatTimeout)
	setDefault(&c.DialTimeout, d.DialTimeout)
	setDefault(&c.BackoffBase, d.BackoffBase)
	setDefault(&c.BackoffCap, d.BackoffCap)
	setDefault(&c.DrainTimeout, d.DrainTimeout)
	return c
}

func (t Tunnel) withDefaults() Tunnel {
	d := DefaultTunnel()
	setDefault(&t.UpstreamTimeout, d.UpstreamTimeout)
	setDefault(&t.UpstreamDialTimeout, d.UpstreamDialTimeout)
	setDefault(&t.PoolHealthInterval, d.PoolHealthInterval)
	return t
}

// Validate reports the first invalid field, naming it as the CLI flag
// (and the tunnel, for one of several).
func (c Config) Validate() error {
	if c.Edge == "" {
		return errors.New("edge: required (the edge's control address, HOST:PORT)")
	}
	if _, _, err := net.SplitHostPort(c.Edge); err != nil {
		return fmt.Errorf("edge %q: want HOST:PORT", c.Edge)
	}
	if err := validateTunnels(c.tunnels()); err != nil {
		return err
	}
	if c.HeartbeatInterval > 0 && c.HeartbeatTimeout > 0 && c.HeartbeatTimeout <= c.HeartbeatInterval {
		return fmt.Errorf("heartbeat-timeout %s: must be longer than heartbeat-interval %s", c.HeartbeatTimeout, c.HeartbeatInterval)
	}
	if c.InspectAddr != "" {
		host, _, err := net.SplitHostPort(c.InspectAddr)
		if ip := net.ParseIP(host); err != nil || (host != "localhost" && (ip == nil || !ip.IsLoopback())) {
			return fmt.Errorf("inspect-addr %q: want a loopback HOST:PORT such as 127.0.0.1:4040 (the inspector shows request bodies and replays requests)", c.InspectAddr)
		}
	}
	if c.InspectPorts < 0 || c.InspectPorts > maxInspectPorts {
		return fmt.Errorf("inspect ports %d: want 0 to %d", c.InspectPorts, maxInspectPorts)
	}
	if c.InstanceID != "" && !mux.ValidInstanceID(c.InstanceID) {
		return fmt.Errorf("instance id %q: want 32 lower-case hex characters", c.InstanceID)
	}
	return nil
}

// maxTunnels bounds the tunnels of one agent: each is a binding the edge
// keeps, and a bind on the session's control stream.
const maxTunnels = 64

// validateTunnels checks each tunnel, and that no two share a name or ask
// for the same one.
func validateTunnels(ts []Tunnel) error {
	if len(ts) > maxTunnels {
		return fmt.Errorf("tunnels: %d, at most %d in one agent", len(ts), maxTunnels)
	}
	names := map[string]string{} // the name asked for -> the tunnel that asks
	seen := map[string]bool{}
	for _, t := range ts {
		if len(ts) > 1 {
			if t.Name == "" {
				return errors.New("tunnels: each of several tunnels needs a name")
			}
			if seen[t.Name] {
				return fmt.Errorf("tunnel %q: two tunnels of that name", t.Name)
			}
			seen[t.Name] = true
		}
		if err := t.validate(); err != nil {
			if t.Name != "" {
				return fmt.Errorf("tunnel %q: %w", t.Name, err)
			}
			return err
		}
		want := strings.ToLower(strings.TrimSuffix(t.Hostname, "."))
		if want == "" {
			want = t.Subdomain
		}
		if t.isTCP() && t.RemotePort != 0 {
			want = mux.TCPKey(t.RemotePort)
		}
		if want == "" {
			continue
		}
		if other, ok := names[want]; ok {
			key := "subdomain"
			switch {
			case t.isTCP():
				key = "remote-port"
			case t.Hostname != "":
				key = "hostname"
			}
			shown := want
			if p, ok := mux.ParseTCPKey(want); ok {
				shown = strconv.Itoa(p)
			}
			return fmt.Errorf("tunnel %q: %s %s is tunnel %q's too: each tunnel needs a name of its own", t.Name, key, shown, other)
		}
		names[want] = t.Name
	}
	return nil
}

// validate reports the first invalid field of one tunnel.
func (t Tunnel) validate() error {
	if err := t.validatePool(); err != nil {
		return err
	}
	switch t.Proto {
	case "", ProtoHTTP:
		if t.RemotePort != 0 {
			return errors.New("remote-port: a TCP tunnel's (ngstone tcp); an HTTP tunnel has --subdomain or --hostname")
		}
		if t.ProxyProtocol {
			return errors.New("proxy-protocol: a TCP or TLS tunnel's; an HTTP one's local service gets X-Forwarded-For")
		}
	case ProtoTCP, ProtoTLS:
		return t.validateRelay()
	default:
		return fmt.Errorf("proto %q: want %s, %s or %s", t.Proto, ProtoHTTP, ProtoTCP, ProtoTLS)
	}
	local, err := ParseLocal(t.Local)
	if err != nil {
		return err
	}
	if local.Scheme != "https" {
		switch {
		case t.UpstreamCAFile != "":
			return fmt.Errorf("upstream-ca-file: the local service %s is not https://", local)
		case t.UpstreamInsecure:
			return fmt.Errorf("upstream-insecure: the local service %s is not https://", local)
		}
	}
	switch t.UpstreamProtocol {
	case "", ProtocolHTTP1, ProtocolHTTP2:
	default:
		return fmt.Errorf("upstream-protocol %q: want %s or %s", t.UpstreamProtocol, ProtocolHTTP1, ProtocolHTTP2)
	}
	if err := t.validateName(); err != nil {
		return err
	}
	if err := t.validatePrefixes(); err != nil {
		return err
	}
	if err := t.validateWebhook(); err != nil {
		return err
	}
	if o := t.oauth(); o != nil {
		if err := o.Validate(); err != nil {
			return err
		}
	} else if len(t.OAuthAllowEmail)+len(t.OAuthAllowDomain)+len(t.OAuthAllowClaim) > 0 || t.OAuthAllowPreflight {
		return errors.New("oauth-allow-*: give --oauth PROVIDER too")
	}
	if _, err := parseHeaderRules(t); err != nil {
		return err
	}
	for _, pair := range t.BasicAuth {
		user, pass, ok := strings.Cut(pair, ":")
		switch {
		case !ok || user == "":
			return errors.New("basic-auth: want USER:PASSWORD")
		case len(pass) < minBasicAuthPassword:
			return fmt.Errorf("basic-auth: the password of %q is shorter than %d characters (the URL is public)", user, minBasicAuthPassword)
		}
	}
	if t.HostHeader != "" && !validHostHeader(t.HostHeader) {
		return fmt.Errorf("host-header %q: want rewrite, or a HOST[:PORT]", t.HostHeader)
	}
	return nil
}

// validateRelay reports the first invalid field of a TCP or TLS
// passthrough tunnel: what only HTTP has is refused rather than ignored.
func (t Tunnel) validateRelay() error {
	if _, err := ParseLocal(t.Local); err != nil {
		return err
	}
	what := strings.ToUpper(t.Proto)
	switch {
	case strings.Contains(t.Local, "://"):
		return fmt.Errorf("local address %q: a %s tunnel's is PORT or HOST:PORT", t.Local, what)
	case t.RemotePort < 0 || t.RemotePort > 65535:
		return fmt.Errorf("remote-port %d: want 1 to 65535", t.RemotePort)
	case t.isTCP() && (t.Subdomain != "" || t.Hostname != ""):
		return errors.New("subdomain, hostname: a TCP tunnel has a public port (--remote-port), not a name")
	case !t.isTCP() && t.RemotePort != 0:
		return errors.New("remote-port: a TCP tunnel's; a TLS tunnel has --subdomain or --hostname")
	case len(t.BasicAuth) > 0 || t.HostHeader != "" || len(t.RequestHeaderAdd)+len(t.RequestHeaderRemove)+len(t.ResponseHeaderAdd)+len(t.ResponseHeaderRemove) > 0:
		return fmt.Errorf("basic-auth, host-header and the header rules are HTTP's: a %s tunnel relays bytes as they are", what)
	case t.UpstreamCAFile != "" || t.UpstreamInsecure || t.UpstreamProtocol == ProtocolHTTP2:
		return fmt.Errorf("upstream-ca-file, upstream-insecure and upstream-protocol are HTTP's: a %s tunnel relays bytes as they are", what)
	case t.VerifyWebhook != "" || t.VerifyWebhookSecret != "" || t.VerifyWebhookHeader != "":
		return fmt.Errorf("verify-webhook is HTTP's: a %s tunnel relays bytes as they are", what)
	case t.OAuth != "" || len(t.OAuthAllowEmail)+len(t.OAuthAllowDomain)+len(t.OAuthAllowClaim) > 0 || t.OAuthAllowPreflight:
		return fmt.Errorf("oauth is HTTP's: a %s tunnel relays bytes as they are", what)
	}
	if err := t.validateName(); err != nil {
		return err
	}
	return t.validatePrefixes()
}

// validatePool checks the tunnel's pool settings, if any.
func (t Tunnel) validatePool() error {
	switch {
	case !t.Pool && t.PoolHealthPath != "":
		return errors.New("pool-health-path: for a pool's member, with --pool")
	case !t.Pool:
		return nil
	case t.isTCP() && t.RemotePort == 0:
		return errors.New("pool: a pool shares one port: give --remote-port")
	case !t.isTCP() && t.Subdomain == "" && t.Hostname == "":
		return errors.New("pool: a pool shares one name: give --subdomain or --hostname")
	case t.PoolHealthPath != "" && t.Proto != "" && t.Proto != ProtoHTTP:
		return errors.New("pool-health-path: an HTTP tunnel's; a TCP or TLS member is checked by a connection to its local service")
	case t.PoolHealthPath != "" && (!strings.HasPrefix(t.PoolHealthPath, "/") || !validHealthPath(t.PoolHealthPath)):
		return fmt.Errorf("pool-health-path %q: want a path such as /healthz", t.PoolHealthPath)
	}
	return nil
}

// validHealthPath reports whether p is a request target of visible
// characters.
func validHealthPath(p string) bool {
	for i := 0; i < len(p); i++ {
		if p[i] <= ' ' || p[i] >= 0x7f {
			return false
		}
	}
	_, err := url.ParseRequestURI(p)
	return err == nil
}

// validateName checks the name the tunnel asks for, if any.
func (t Tunnel) validateName() error {
	if t.Subdomain != "" {
		if err := mux.ValidateSubdomain(t.Subdomain, nil); err != nil {
			return fmt.Errorf("subdomain: %v", err)
		}
	}
	if t.Hostname != "" {
		if t.Subdomain != "" {
			return errors.New("hostname: give --subdomain or --hostname, not both")
		}
		if err := mux.ValidateHostname(strings.TrimSuffix(strings.ToLower(t.Hostname), ".")); err != nil {
			return fmt.Errorf("hostname: %v (want a name such as app.example.org)", err)
		}
	}
	return nil
}

// validateWebhook checks the tunnel's webhook verification, if any.
func (t Tunnel) validateWebhook() error {
	if w := t.webhook(); w != nil {
		return w.Validate()
	}
	if t.VerifyWebhookSecret != "" || t.VerifyWebhookHeader != "" {
		return errors.New("verify-webhook-secret-file, verify-webhook-header: give --verify-webhook PROVIDER too")
	}
	return nil
}

// webhook is what the tunnel's bind asks the edge to verify; nil if none.
func (t Tunnel) webhook() *mux.Webhook {
	if t.VerifyWebhook == "" {
		return nil
	}
	return &mux.Webhook{Provider: t.VerifyWebhook, Secret: t.VerifyWebhookSecret, Header: t.VerifyWebhookHeader}
}

// oauth is the sign-in the tunnel's bind asks of the edge; nil if none.
func (t Tunnel) oauth() *mux.OAuth {
	if t.OAuth == "" {
		return nil
	}
	return &mux.OAuth{Provider: t.OAuth, AllowEmails: t.OAuthAllowEmail, AllowDomains: t.OAuthAllowDomain,
		AllowClaims: t.OAuthAllowClaim, AllowPreflight: t.OAuthAllowPreflight}
}

// validatePrefixes checks the tunnel's visitor prefixes.
func (t Tunnel) validatePrefixes() error {
	for flag, list := range map[string][]string{"allow-cidr": t.AllowCIDR, "deny-cidr": t.DenyCIDR} {
		for _, p := range list {
			if _, err := mux.ParsePrefix(p); err != nil {
				return fmt.Errorf("%s %q: %w", flag, p, err)
			}
		}
	}
	return nil
}

// maxInspectPorts bounds the ports the agent tries for its inspector.
const maxInspectPorts = 100

// ParseLocal turns PORT, HOST:PORT or a URL into the local service's URL.
func ParseLocal(s string) (*url.URL, error) {
	if s == "" {
		return nil, errors.New("local address: required (PORT, HOST:PORT or URL)")
	}
	if p, err := strconv.Atoi(s); err == nil {
		if p < 1 || p > 65535 {
			return nil, fmt.Errorf("local port %d: want 1 to 65535", p)
		}
		return &url.URL{Scheme: "http", Host: "localhost:" + s}, nil
	}
	if !strings.Contains(s, "://") {
		if _, _, err := net.SplitHostPort(s); err != nil {
			return nil, fmt.Errorf("local address %q: want PORT, HOST:PORT or URL", s)
		}
		return &url.URL{Scheme: "http", Host: s}, nil
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("local URL %q: want http://HOST[:PORT] or https://HOST[:PORT]", s)
	}
	return u, nil
}

// hostHeader is the Host the local service gets for --host-header v.
func hostHeader(v string, local *url.URL) string {
	if v == "rewrite" {
		return local.Host
	}
	return v
}

// validHostHeader reports whether v can be a Host field's value: letters,
// digits and the punctuation of names, ports and bracketed IPv6 addresses.
func validHostHeader(v string) bool {
	for _, c := range v {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.ContainsRune(".-_:[]", c):
		default:
			return false
		}
	}
	return v != ""
}
