package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/agent"
)

// Agent loads `ngstone http` (and `ngstone tcp`) settings.
type Agent struct {
	l     *loader
	proto string // the command line's tunnel's
}

// httpOnly are the agent's flags that only an HTTP tunnel has.
var httpOnly = []string{"subdomain", "hostname", "request-header-add", "request-header-remove",
	"response-header-add", "response-header-remove", "upstream-ca-file", "upstream-insecure",
	"upstream-protocol", "host-header", "basic-auth", "verify-webhook", "verify-webhook-secret-file", "verify-webhook-header",
	"oauth", "oauth-allow-email", "oauth-allow-domain", "oauth-allow-claim", "oauth-allow-preflight", "pool-health-path"}

// NewTCPAgent registers the flags of `ngstone tcp` on fs: the agent's,
// those only HTTP has hidden (a TCP tunnel refuses them).
func NewTCPAgent(fs *pflag.FlagSet) *Agent {
	a := NewAgent(fs)
	a.proto = agent.ProtoTCP
	for _, f := range httpOnly {
		fs.MarkHidden(f)
	}
	fs.MarkHidden("log-requests")
	fs.Lookup("remote-port").Hidden = false
	fs.Lookup("proxy-protocol").Hidden = false
	return a
}

// NewTLSAgent registers the flags of `ngstone tls` on fs: the agent's,
// those only HTTP has hidden but the name's (a TLS tunnel refuses them).
func NewTLSAgent(fs *pflag.FlagSet) *Agent {
	a := NewAgent(fs)
	a.proto = agent.ProtoTLS
	for _, f := range httpOnly {
		if f != "subdomain" && f != "hostname" {
			fs.MarkHidden(f)
		}
	}
	fs.MarkHidden("log-requests")
	fs.Lookup("proxy-protocol").Hidden = false
	return a
}

// NewAgent registers the agent's flags on fs.
func NewAgent(fs *pflag.FlagSet) *Agent {
	d := agent.DefaultConfig()
	fs.String("edge", "", "edge control address HOST:PORT (default: start an embedded edge for *.localhost)")
	fs.Int("remote-port", 0, "public TCP port to bind (default: the port the edge keeps for this token and local address, else a free one)")
	fs.MarkHidden("remote-port") // ngstone tcp's
	fs.Bool("proxy-protocol", false, "send the local service a PROXY protocol v2 header with the visitor's address before its bytes")
	fs.MarkHidden("proxy-protocol") // ngstone tcp's and tls's
	fs.String("subdomain", "", "subdomain to bind (default: a random name chosen by the edge)")
	fs.String("hostname", "", "a hostname of your own to bind instead (app.example.org, a CNAME to the edge), if the token allows it")
	fs.StringArray("allow-cidr", nil, "visitor prefix the edge lets reach the tunnel (repeatable, e.g. 192.0.2.0/24; default: everyone)")
	fs.StringArray("deny-cidr", nil, "visitor prefix the edge keeps out (repeatable; 403 ip_denied)")
	fs.String("verify-webhook", "", "have the edge check each request's signature before it crosses: github, stripe, slack, or hmac (403 webhook_unverified)")
	fs.String("verify-webhook-secret-file", "", "file holding the secret the webhook's sender signs with (for --verify-webhook)")
	fs.String("verify-webhook-header", "", "for --verify-webhook hmac: the field that carries the body's HMAC-SHA256, hex or base64")
	fs.String("oauth", "", "have the edge let in only visitors signed in with this provider, one its operator offers (e.g. google, github)")
	fs.StringArray("oauth-allow-email", nil, "with --oauth: an address that may visit (repeatable; with no allow list, anyone signed in may)")
	fs.StringArray("oauth-allow-domain", nil, "with --oauth: a domain whose addresses may visit, e.g. example.com (repeatable)")
	fs.StringArray("oauth-allow-claim", nil, "with --oauth and an OIDC provider: a claim that lets its holders in, NAME=VALUE, e.g. groups=dev (repeatable)")
	fs.Bool("oauth-allow-preflight", false, "with --oauth: let CORS preflights (OPTIONS with Origin) through without a sign-in")
	fs.Bool("pool", false, "share the name (or --remote-port) with the other agents of this token that pass --pool: the edge spreads visitors over them")
	fs.String("pool-health-path", "", "with --pool: a path of the local service to check; an answer other than 2xx takes this agent out of the pool (default: check that it accepts connections)")
	fs.Duration("pool-health-interval", agent.DefaultTunnel().PoolHealthInterval, "with --pool: how often to check the local service")
	fs.StringArray("request-header-add", nil, "header field added to requests to the local service, \"Name: value\" (repeatable)")
	fs.StringArray("request-header-remove", nil, "header field removed from requests to the local service (repeatable)")
	fs.StringArray("response-header-add", nil, "header field added to the local service's responses, \"Name: value\" (repeatable)")
	fs.StringArray("response-header-remove", nil, "header field removed from the local service's responses (repeatable)")
	fs.String("authtoken", "", "token presented to the edge")
	fs.String("ca-file", "", "PEM file of the CA to trust for the edge (the edge's DATA_DIR/ca.pem in self-signed mode)")
	fs.String("server-name", "", "name the edge's certificate must match, when --edge is an address (default: the host of --edge)")
	fs.Bool("insecure", false, "do not verify the edge's certificate")
	fs.Duration("upstream-timeout", d.UpstreamTimeout, "how long the local service may take to send response headers, or to take any of a request body (504 upstream_timeout)")
	fs.String("upstream-ca-file", "", "PEM file of the CA to trust for an https:// local service's certificate (default: the system's roots)")
	fs.Bool("upstream-insecure", false, "do not verify an https:// local service's certificate (a development server's self-signed one)")
	fs.String("upstream-protocol", agent.ProtocolHTTP1, "what to speak to the local service: http1, or http2 (h2c to http://, h2 to https://; for gRPC servers)")
	fs.Duration("heartbeat-interval", d.HeartbeatInterval, "how often to heartbeat the edge")
	fs.Duration("heartbeat-timeout", d.HeartbeatTimeout, "reconnect when the edge has not answered heartbeats for this long")
	fs.Duration("dial-timeout", d.DialTimeout, "bound on one connect to the edge (its staggered attempts: dial, TLS handshake, hello and binds)")
	fs.Duration("drain-timeout", d.DrainTimeout, "how long requests in flight may finish on a closing session")
	fs.Bool("inspect", true, "serve the inspector (a web page of the last requests, their bodies, replay) and the local API (/api/tunnels) on --inspect-addr")
	fs.String("inspect-addr", d.InspectAddr, "loopback HOST:PORT of the inspector and the local API; the default moves to the next free port up to 4049 when taken")
	fs.Bool("console", true, "on a terminal, show the live status screen on stdout (false: log lines, as when stdout is not a terminal)")
	fs.Duration("console-refresh", time.Second, "how often the console redraws what changes by itself (countdowns, rates)")
	fs.MarkHidden("console-refresh")
	fs.Duration("backoff-base", d.BackoffBase, "shortest wait between reconnect attempts (decorrelated jitter from there)")
	fs.Duration("backoff-cap", d.BackoffCap, "longest wait between reconnect attempts")
	fs.String("host-header", "", "Host the local service gets: rewrite (its own HOST:PORT, for dev servers that check Host) or a HOST (default: the visitor's)")
	fs.StringArray("basic-auth", nil, "USER:PASSWORD a visitor must give (HTTP basic authentication; repeatable; passwords of 8 characters or more)")
	fs.Bool("log-requests", false, "log a line per request: method, path, status, duration (true by default when stderr is a terminal)")
	l := newLoader(fs)
	l.defaultFile, _ = DefaultFile()
	l.sections = []string{"tunnels"}
	return &Agent{l: l}
}

// DefaultFile is the agent's settings file when --config names none:
// ngstone/ngstone.yml in the user config directory ($XDG_CONFIG_HOME or
// ~/.config on Linux), which `ngstone config` writes.
func DefaultFile() (string, error) {
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", fmt.Errorf("no user config directory (%w): give --config", err)
	}
	return filepath.Join(dir, "ngstone", "ngstone.yml"), nil
}

// Console is how `ngstone http` shows its state on a terminal.
type Console struct {
	// Enabled: a live screen when stdout is a terminal.
	Enabled bool
	// Refresh is how often the screen redraws by itself.
	Refresh time.Duration
}

// Console returns the console settings, after Load.
func (c *Agent) Console() (Console, error) {
	var e errs
	cs := Console{Enabled: e.boolean(c.l, "console"), Refresh: e.dur(c.l, "console-refresh")}
	if e.err == nil && cs.Refresh < 10*time.Millisecond {
		e.set(fmt.Errorf("console-refresh %s: at least 10ms", cs.Refresh))
	}
	return cs, e.err
}

// Load reads flags, environment and file into an agent.Config of one
// tunnel. local is the positional PORT | HOST:PORT | URL (the local
// address is always an argument; a file's tunnels: are for `ngstone
// start`).
func (c *Agent) Load(local string) (agent.Config, Log, error) {
	cfg, lg, err := c.load()
	if err != nil {
		return cfg, lg, err
	}
	cfg.Local = local
	if c.proto != "" {
		cfg.Proto = c.proto
	}
	return cfg, lg, check(cfg)
}

// load reads the agent's settings, its one tunnel's from the top level.
func (c *Agent) load() (agent.Config, Log, error) {
	l := c.l
	if err := l.bind(); err != nil {
		return agent.Config{}, Log{}, err
	}
	lg, err := l.log()
	if err != nil {
		return agent.Config{}, lg, err
	}
	var e errs
	cfg := agent.DefaultConfig()
	e.set(readTunnel(l, &cfg.Tunnel, func(string) bool { return true }))
	cfg.Edge = l.string("edge")
	token, err := l.secret("authtoken")
	e.set(err)
	cfg.Token = token
	cfg.CAFile = l.string("ca-file")
	cfg.ServerName = l.string("server-name")
	cfg.Insecure = e.boolean(l, "insecure")
	cfg.HeartbeatInterval = e.dur(l, "heartbeat-interval")
	cfg.HeartbeatTimeout = e.dur(l, "heartbeat-timeout")
	cfg.DialTimeout = e.dur(l, "dial-timeout")
	cfg.DrainTimeout = e.dur(l, "drain-timeout")
	cfg.LogRequests = e.boolean(l, "log-requests")
	// Only the default address moves on to the next ports when taken.
	if cfg.InspectAddr = l.string("inspect-addr"); cfg.InspectAddr != agent.DefaultInspectAddr {
		cfg.InspectPorts = 0
	}
	if !e.boolean(l, "inspect") {
		cfg.InspectAddr, cfg.InspectPorts = "", 0
	}
	cfg.BackoffBase = e.dur(l, "backoff-base")
	cfg.BackoffCap = e.dur(l, "backoff-cap")
	if e.err != nil {
		return cfg, lg, e.err
	}
	for key, d := range map[string]int64{"heartbeat-interval": int64(cfg.HeartbeatInterval), "heartbeat-timeout": int64(cfg.HeartbeatTimeout), "dial-timeout": int64(cfg.DialTimeout), "backoff-base": int64(cfg.BackoffBase), "backoff-cap": int64(cfg.BackoffCap)} {
		if d == 0 {
			return cfg, lg, fmt.Errorf("%s 0: must be positive", key)
		}
	}
	if cfg.BackoffCap < cfg.BackoffBase {
		return cfg, lg, fmt.Errorf("backoff-cap %s: must be at least backoff-base %s", cfg.BackoffCap, cfg.BackoffBase)
	}
	return cfg, lg, nil
}

// check validates cfg; without an edge (the embedded one fills it in) the
// rest is checked now.
func check(cfg agent.Config) error {
	if cfg.Edge == "" {
		cfg.Edge = "localhost:1"
	}
	return cfg.Validate()
}

// tunnelKeys are the settings that are each tunnel's own: a flag for the
// command line's tunnel, a key of each entry of the file's tunnels:.
var tunnelKeys = []string{
	"subdomain", "hostname", "remote-port", "allow-cidr", "deny-cidr",
	"verify-webhook", "verify-webhook-secret-file", "verify-webhook-header",
	"oauth", "oauth-allow-email", "oauth-allow-domain", "oauth-allow-claim", "oauth-allow-preflight",
	"request-header-add", "request-header-remove", "response-header-add", "response-header-remove",
	"upstream-timeout", "upstream-ca-file", "upstream-insecure", "upstream-protocol",
	"basic-auth", "host-header", "proxy-protocol", "pool", "pool-health-path", "pool-health-interval",
}

// readTunnel reads into t the tunnel settings l has (has says which).
func readTunnel(l *loader, t *agent.Tunnel, has func(key string) bool) error {
	var e errs
	for _, key := range tunnelKeys {
		if !has(key) {
			continue
		}
		switch key {
		case "subdomain":
			t.Subdomain = l.string(key)
		case "hostname":
			t.Hostname = l.string(key)
		case "remote-port":
			t.RemotePort = e.integer(l, key)
		case "allow-cidr":
			t.AllowCIDR = l.strings(key)
		case "deny-cidr":
			t.DenyCIDR = l.strings(key)
		case "verify-webhook":
			t.VerifyWebhook = l.string(key)
		case "verify-webhook-secret-file":
			if p := l.string(key); p != "" {
				b, err := os.ReadFile(p)
				if err != nil {
					e.set(fmt.Errorf("%s: %w", key, err))
					continue
				}
				t.VerifyWebhookSecret = strings.TrimSpace(string(b))
			}
		case "verify-webhook-header":
			t.VerifyWebhookHeader = l.string(key)
		case "oauth":
			t.OAuth = l.string(key)
		case "oauth-allow-email":
			t.OAuthAllowEmail = l.strings(key)
		case "oauth-allow-domain":
			t.OAuthAllowDomain = l.strings(key)
		case "oauth-allow-claim":
			t.OAuthAllowClaim = l.strings(key)
		case "oauth-allow-preflight":
			t.OAuthAllowPreflight = e.boolean(l, key)
		case "request-header-add":
			t.RequestHeaderAdd = l.wholeStrings(key)
		case "request-header-remove":
			t.RequestHeaderRemove = l.wholeStrings(key)
		case "response-header-add":
			t.ResponseHeaderAdd = l.wholeStrings(key)
		case "response-header-remove":
			t.ResponseHeaderRemove = l.wholeStrings(key)
		case "upstream-timeout":
			t.UpstreamTimeout = e.dur(l, key)
			if e.err == nil && t.UpstreamTimeout == 0 {
				e.set(fmt.Errorf("%s 0: must be positive", key))
			}
		case "upstream-ca-file":
			t.UpstreamCAFile = l.string(key)
		case "upstream-insecure":
			t.UpstreamInsecure = e.boolean(l, key)
		case "upstream-protocol":
			t.UpstreamProtocol = l.string(key)
		case "basic-auth":
			t.BasicAuth = l.wholeStrings(key)
		case "host-header":
			t.HostHeader = l.string(key)
		case "proxy-protocol":
			t.ProxyProtocol = e.boolean(l, key)
		case "pool":
			t.Pool = e.boolean(l, key)
		case "pool-health-path":
			t.PoolHealthPath = l.string(key)
		case "pool-health-interval":
			t.PoolHealthInterval = e.dur(l, key)
			if e.err == nil && t.PoolHealthInterval < 10*time.Millisecond {
				e.set(fmt.Errorf("%s %s: at least 10ms", key, t.PoolHealthInterval))
			}
		}
	}
	return e.err
}
