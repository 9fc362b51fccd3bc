package config

import (
	"fmt"
	"slices"
	"strings"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/mux"
)

// Edge loads `ngstone edge` settings.
type Edge struct{ l *loader }

// NewEdge registers the edge's flags on fs.
func NewEdge(fs *pflag.FlagSet) *Edge {
	d := edge.DefaultConfig()
	fs.String("domain", "", "public domain; tunnels are served at NAME.DOMAIN (required)")
	fs.String("http-addr", d.HTTPAddr, "plain-HTTP visitor listener (empty disables)")
	fs.String("https-addr", d.HTTPSAddr, "HTTPS visitor listener (empty disables)")
	fs.String("control-addr", d.ControlAddr, "TLS listener for agents")
	fs.String("admin-addr", d.AdminAddr, "admin API listener: /healthz, /metrics, /api/tunnels (empty disables)")
	fs.String("admin-token", "", "bearer token the admin API requires except on /healthz (required when admin-addr is not loopback; NGSTONE_ADMIN_TOKEN_FILE reads it from a file)")
	fs.String("tls-mode", d.TLS.Mode, "certificates: "+strings.Join(certs.Modes, ", "))
	fs.StringArray("tls-cert", nil, "certificate PEM file (tls-mode files; repeat with tls-key for more pairs, e.g. for agents' own hostnames: each handshake gets the pair covering its name)")
	fs.StringArray("tls-key", nil, "private key PEM file of the tls-cert at the same position (tls-mode files)")
	fs.String("data-dir", d.TLS.DataDir, "directory for the self-signed CA (ca.pem), ACME state, and the registry (registry.db) of an edge that runs alone")
	fs.StringArray("token", nil, "agent token to accept (repeatable; none means any agent may connect)")
	fs.String("tokens-file", "", "YAML file of agent tokens")
	fs.StringSlice("reserved-names", d.ReservedNames, "subdomains no agent may bind")
	fs.Duration("drain-timeout", d.DrainTimeout, "how long an evicted session may finish accepted requests (0 closes at once)")
	fs.Duration("heartbeat-timeout", d.HeartbeatTimeout, "a session with no heartbeat for this long is dead")
	fs.Duration("tunnel-timeout", d.TunnelTimeout, "how long to wait for an agent's response headers, for it to accept the stream of an upload over 256 KiB, and for it to take any of a request body (504 tunnel_timeout)")
	fs.Duration("hello-timeout", d.HelloTimeout, "how long an agent has from connect to hello")
	fs.Duration("shutdown-grace", d.ShutdownGrace, "how long a graceful shutdown waits for in-flight requests")
	fs.String("acme-ca", "", "ACME directory URL (certmagic, autocert; default Let's Encrypt production: try a staging directory first)")
	fs.String("acme-email", "", "ACME account contact address")
	fs.String("acme-ca-root", "", "PEM file of roots to trust for the ACME server itself (private or test CA)")
	fs.String("dns-provider", "", "DNS-01 provider for the wildcard certificate in certmagic mode: cloudflare or rfc2136")
	fs.StringToString("dns-credentials", nil, "DNS provider settings KEY=VALUE (e.g. api_token=...; KEY_file=PATH reads a file; the provider's environment variables also work)")
	fs.StringSlice("dns-resolvers", nil, "DNS servers HOST:PORT used to check DNS-01 propagation (default: the system's)")
	fs.Duration("dns-propagation-timeout", 0, "bound on waiting for a DNS-01 record to appear (0 means 2m)")
	fs.Bool("on-demand", false, "certmagic mode: issue a certificate per bound hostname at its first handshake")
	fs.Int("on-demand-rate-limit", 0, "on-demand issuances admitted at once, and again over each window (0 means 10)")
	fs.Duration("on-demand-rate-window", 0, "window of on-demand-rate-limit (0 means 1m)")
	fs.Duration("acme-retry-base", 0, "wait after a failed attempt to obtain or renew a certificate, doubled at each further failure (0 means 1m)")
	fs.Duration("acme-retry-max", 0, "longest wait between attempts to obtain or renew a certificate (0 means 1h)")
	fs.Int("auth-failure-limit", d.AuthFailureLimit, "failed hellos from one address within auth-failure-window before it is refused for that long (0 disables)")
	fs.Duration("auth-failure-window", d.AuthFailureWindow, "window of auth-failure-limit, and how long a refused address stays refused")
	fs.Int("max-streams-per-session", d.MaxStreamsPerSession, "concurrent visitor requests per agent session; more get 503 (0 = no limit)")
	fs.Int("max-conns", d.MaxConns, "concurrent visitor connections in total (0 = no limit)")
	fs.Int("max-conns-per-ip", d.MaxConnsPerIP, "concurrent visitor connections per client address, an IPv6 one by its /64 (0 = no limit)")
	fs.Bool("proxy-protocol", false, "read a PROXY protocol header (v1 or v2) on the visitor listeners from the sources in proxy-protocol-from")
	fs.StringSlice("proxy-protocol-from", nil, "prefixes of the load balancers that send PROXY protocol (e.g. 10.0.0.0/8); others may not")
	fs.Int("max-requests-per-ip", d.MaxRequestsPerIP, "concurrent requests of one visitor address (IPv6: its /64) to one tunnel; more get 429 visitor_limit (0 = no limit)")
	fs.Int("max-agent-conns", d.MaxAgentConns, "concurrent agent connections to control-addr in total, counted before TLS (0 = no limit)")
	fs.Int("max-agent-conns-per-ip", d.MaxAgentConnsPerIP, "concurrent agent connections per address, an IPv6 one by its /64 (0 = no limit)")
	fs.Duration("write-timeout", d.WriteTimeout, "cut a visitor that reads nothing of its response for this long (counted afresh at each write)")
	fs.Duration("read-timeout", d.ReadTimeout, "cut a visitor that sends nothing of its request body for this long (counted afresh at each read)")
	fs.Int64("max-response-head", d.MaxResponseHead, "largest response head in bytes the edge takes from an agent, 1xx heads included; larger get 502 bad_response (at most 1 MiB)")
	fs.Int64("max-request-body", 0, "largest visitor request body in bytes; larger get 413 (0 = no limit)")
	fs.Int64("verify-webhook-max-body", d.VerifyWebhookMaxBody, "largest body in bytes the edge reads to check a tunnel's webhook signature (--verify-webhook); larger get 403 webhook_unverified")
	fs.Duration("read-header-timeout", d.ReadHeaderTimeout, "how long a visitor may take to send TLS handshake and request headers")
	fs.Duration("idle-timeout", d.IdleTimeout, "how long an idle visitor keep-alive connection stays open")
	fs.StringSlice("tcp-ports", nil, "public ports of TCP tunnels, PORT or LO-HI items (e.g. 20000-20999); the edge listens on each, on the host of https-addr (default: none, no TCP tunnels)")
	fs.Duration("tcp-port-reserve", d.TCPPortReserve, "how long a TCP port stays kept for the token that held it after its release, so its next agent gets it back (0 keeps none)")
	fs.Duration("tcp-idle-timeout", d.TCPIdleTimeout, "close a TCP tunnel's connection that carried no byte either way for this long")
	fs.StringArray("oauth-provider", nil, "a sign-in provider agents may ask for with --oauth (repeatable: google, github, or an OIDC issuer's name); its settings are in the config file's oauth-providers: section")
	fs.Duration("oauth-session-duration", d.OAuthSessionDuration, "how long a visitor's sign-in lasts")
	fs.Duration("oauth-idle-timeout", d.OAuthIdleTimeout, "end a visitor's sign-in unused for this long")
	clusterFlags(fs)
	groupEdgeFlags(fs)
	l := newLoader(fs)
	l.sections = []string{"oauth-providers"}
	return &Edge{l: l}
}

// groupEdgeFlags sorts the edge's flags into the sections of its --help;
// the rest (domain, config, logs) are general.
func groupEdgeFlags(fs *pflag.FlagSet) {
	group(fs, "Visitors", "http-addr", "https-addr", "reserved-names", "tunnel-timeout", "read-header-timeout",
		"idle-timeout", "shutdown-grace", "proxy-protocol", "proxy-protocol-from", "tcp-ports", "tcp-port-reserve",
		"tcp-idle-timeout", "oauth-provider", "oauth-session-duration", "oauth-idle-timeout")
	group(fs, "TLS", "tls-mode", "tls-cert", "tls-key", "data-dir", "acme-ca", "acme-email", "acme-ca-root",
		"dns-provider", "dns-credentials", "dns-resolvers", "dns-propagation-timeout", "on-demand",
		"on-demand-rate-limit", "on-demand-rate-window", "acme-retry-base", "acme-retry-max")
	group(fs, "Agents", "control-addr", "token", "tokens-file", "heartbeat-timeout", "hello-timeout", "drain-timeout",
		"auth-failure-limit", "auth-failure-window")
	group(fs, "Cluster", "cluster-etcd", "cluster-etcd-ca", "cluster-etcd-cert", "cluster-etcd-key",
		"cluster-etcd-username", "cluster-etcd-password", "cluster-prefix", "node-name", "cluster-addr",
		"cluster-advertise", "cluster-key", "cluster-lease-ttl", "cluster-route-staleness")
	group(fs, "Limits", "max-streams-per-session", "max-conns", "max-conns-per-ip", "max-requests-per-ip",
		"max-agent-conns", "max-agent-conns-per-ip", "write-timeout", "read-timeout", "max-response-head",
		"max-request-body", "verify-webhook-max-body")
	group(fs, "Admin", "admin-addr", "admin-token")
}

// Load reads flags, environment and file into an edge.Config.
func (c *Edge) Load() (edge.Config, Log, error) {
	l := c.l
	if err := l.bind(); err != nil {
		return edge.Config{}, Log{}, err
	}
	lg, err := l.log()
	if err != nil {
		return edge.Config{}, lg, err
	}
	var e errs
	cfg := edge.DefaultConfig()
	cfg.Domain = strings.ToLower(strings.TrimSuffix(l.string("domain"), "."))
	cfg.HTTPAddr = l.string("http-addr")
	cfg.HTTPSAddr = l.string("https-addr")
	cfg.ControlAddr = l.string("control-addr")
	cfg.AdminAddr = l.string("admin-addr")
	adminToken, err := l.secret("admin-token")
	e.set(err)
	cfg.AdminToken = adminToken
	cfg.TLS.Mode = l.string("tls-mode")
	cfg.TLS.CertFiles = l.wholeStrings("tls-cert")
	cfg.TLS.KeyFiles = l.wholeStrings("tls-key")
	cfg.TLS.DataDir = l.string("data-dir")
	cfg.TLS.ACMECA = l.string("acme-ca")
	cfg.TLS.ACMEEmail = l.string("acme-email")
	cfg.TLS.ACMECARoot = l.string("acme-ca-root")
	cfg.TLS.DNSProvider = l.string("dns-provider")
	creds, err := l.stringMap("dns-credentials")
	e.set(err)
	cfg.TLS.DNSCredentials = creds
	cfg.TLS.DNSResolvers = l.strings("dns-resolvers")
	cfg.TLS.DNSPropagationTimeout = e.dur(l, "dns-propagation-timeout")
	cfg.TLS.OnDemand = e.boolean(l, "on-demand")
	cfg.TLS.OnDemandRateLimit = e.integer(l, "on-demand-rate-limit")
	cfg.TLS.OnDemandRateWindow = e.dur(l, "on-demand-rate-window")
	cfg.TLS.RetryBase = e.dur(l, "acme-retry-base")
	cfg.TLS.RetryMax = e.dur(l, "acme-retry-max")
	cfg.Tokens = l.strings("token")
	if path := l.string("tokens-file"); path != "" {
		pol, err := LoadTokensFile(path)
		e.set(err)
		cfg.TokenPolicies = pol
	}
	cfg.AuthFailureLimit = e.integer(l, "auth-failure-limit")
	cfg.AuthFailureWindow = e.dur(l, "auth-failure-window")
	cfg.MaxStreamsPerSession = e.integer(l, "max-streams-per-session")
	cfg.MaxConns = e.integer(l, "max-conns")
	cfg.MaxConnsPerIP = e.integer(l, "max-conns-per-ip")
	cfg.ProxyProtocol = e.boolean(l, "proxy-protocol")
	for _, p := range l.strings("proxy-protocol-from") {
		pfx, err := mux.ParsePrefix(p)
		if err != nil {
			e.set(fmt.Errorf("proxy-protocol-from %q: %w", p, err))
			continue
		}
		cfg.ProxyProtocolFrom = append(cfg.ProxyProtocolFrom, pfx)
	}
	cfg.MaxRequestsPerIP = e.integer(l, "max-requests-per-ip")
	cfg.MaxAgentConns = e.integer(l, "max-agent-conns")
	cfg.MaxAgentConnsPerIP = e.integer(l, "max-agent-conns-per-ip")
	cfg.WriteTimeout = e.dur(l, "write-timeout")
	cfg.ReadTimeout = e.dur(l, "read-timeout")
	cfg.MaxResponseHead = int64(e.integer(l, "max-response-head"))
	cfg.MaxRequestBody = int64(e.integer(l, "max-request-body"))
	cfg.VerifyWebhookMaxBody = int64(e.integer(l, "verify-webhook-max-body"))
	providers, err := oauthProviders(l.file, l.wholeStrings("oauth-provider"))
	e.set(err)
	cfg.OAuthProviders = providers
	cfg.OAuthSessionDuration = e.dur(l, "oauth-session-duration")
	cfg.OAuthIdleTimeout = e.dur(l, "oauth-idle-timeout")
	cfg.ReadHeaderTimeout = e.dur(l, "read-header-timeout")
	cfg.IdleTimeout = e.dur(l, "idle-timeout")
	ports, err := mux.ParsePorts(l.strings("tcp-ports")...)
	if err != nil {
		e.set(fmt.Errorf("tcp-ports: %w", err))
	}
	cfg.TCPPorts = ports
	cfg.TCPPortReserve = e.dur(l, "tcp-port-reserve")
	cfg.TCPIdleTimeout = e.dur(l, "tcp-idle-timeout")
	cfg.ReservedNames = l.strings("reserved-names")
	if cfg.ReservedNames == nil {
		cfg.ReservedNames = []string{}
	}
	cfg.DrainTimeout = e.dur(l, "drain-timeout")
	cfg.HeartbeatTimeout = e.dur(l, "heartbeat-timeout")
	cfg.TunnelTimeout = e.dur(l, "tunnel-timeout")
	cfg.HelloTimeout = e.dur(l, "hello-timeout")
	cfg.ShutdownGrace = e.dur(l, "shutdown-grace")
	if e.err != nil {
		return cfg, lg, e.err
	}
	if cfg.TLS.Mode != "" && !slices.Contains(certs.Modes, cfg.TLS.Mode) {
		return cfg, lg, fmt.Errorf("tls-mode %q: want one of %s", cfg.TLS.Mode, strings.Join(certs.Modes, ", "))
	}
	if cfg.HeartbeatTimeout == 0 {
		return cfg, lg, fmt.Errorf("heartbeat-timeout 0: must be positive")
	}
	return cfg, lg, cfg.Validate()
}
