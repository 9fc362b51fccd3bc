package agent

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/ngstone/ngstone/mux"
)

// tunnel is one of the agent's public names and the local service behind
// it. All of an agent's tunnels share its session and its instance; each
// name is bound, taken back and released on its own, and one refused or
// evicted leaves the others serving.
type tunnel struct {
	a    *Agent
	cfg  Tunnel
	name string // cfg.Name, or commandLine
	log  *slog.Logger

	local *url.URL
	// upstreamTLS is the TLS configuration of an https:// local service.
	upstreamTLS *tls.Config
	// upstream is the transport to the local service; upstreamMu orders
	// its replacements (useResponseHeadLimit).
	upstream   atomic.Pointer[http.Transport]
	upstreamMu sync.Mutex
	proxy      *httputil.ReverseProxy
	auth       *basicAuth   // nil: visitors need no credentials
	headers    *headerRules // nil: none
	hostHeader string       // the Host the local service gets; "": the visitor's
	failures   localFailures
	strays     localFailures
	health     poolHealth // a pool member's local service

	// Under the agent's mu.
	ask     string       // the subdomain to ask for; set by the first bind when random
	askPort int          // a TCP tunnel's port to ask for; set by its first bind
	st      TunnelStatus // what the status shows of it
}

// commandLine is the name of the tunnel given on the command line, as
// ngrok's local API calls it.
const commandLine = "command_line"

// newTunnel sets up cfg's tunnel for a; no I/O.
func newTunnel(a *Agent, cfg Tunnel) (*tunnel, error) {
	local, err := ParseLocal(cfg.Local)
	if err != nil {
		return nil, err
	}
	// An edge that matches a prefix in IPv4-mapped form as written lets
	// every visitor past it: send the IPv4 prefix it means.
	cfg.AllowCIDR, cfg.DenyCIDR = edgePrefixes(cfg.AllowCIDR), edgePrefixes(cfg.DenyCIDR)
	t := &tunnel{a: a, cfg: cfg, name: cfg.Name, local: local, ask: cfg.Subdomain, askPort: cfg.RemotePort}
	if t.name == "" {
		t.name = commandLine
	}
	t.log = a.log
	if cfg.Name != "" {
		t.log = a.log.With("tunnel", cfg.Name)
	}
	if local.Scheme == "https" {
		t.upstreamTLS = &tls.Config{ServerName: local.Hostname(), InsecureSkipVerify: cfg.UpstreamInsecure}
	}
	t.proxy = t.newProxy()
	t.auth = newBasicAuth(cfg.BasicAuth)
	t.headers, _ = parseHeaderRules(cfg) // checked by Validate
	t.hostHeader = hostHeader(cfg.HostHeader, local)
	t.st = TunnelStatus{Name: t.name, Local: local.String(), VerifyWebhook: cfg.VerifyWebhook, OAuth: cfg.OAuth, Pool: cfg.Pool, State: TunnelConnecting}
	if cfg.relaysBytes() {
		t.st.Local = local.Host
	}
	return t, nil
}

// edgePrefixes is prefixes, which Validate checked, as the edge matches
// them (mux.ParsePrefix).
func edgePrefixes(prefixes []string) []string {
	var out []string
	for _, s := range prefixes {
		p, _ := mux.ParsePrefix(s)
		out = append(out, p.String())
	}
	return out
}

// wrap names the tunnel in err, when the agent has several.
func (t *tunnel) wrap(err error) error {
	if err == nil || len(t.a.tunnels) < 2 {
		return err
	}
	return fmt.Errorf("tunnel %q: %w", t.name, err)
}

// final reports whether the tunnel's name is gone for good: refused by the
// edge, or taken over by another agent.
func (t *tunnel) final() bool {
	return t.st.State == TunnelRefused || t.st.State == TunnelEvicted
}

// publicURL is t's first public URL; empty while it holds no name.
func (t *tunnel) publicURL() string {
	t.a.mu.Lock()
	defer t.a.mu.Unlock()
	return t.st.URL
}

// tunnelNamed returns the tunnel of that name; with one tunnel, it (the
// captures of an agent of one tunnel all came for it).
func (a *Agent) tunnelNamed(name string) *tunnel {
	if len(a.tunnels) == 1 {
		return a.tunnels[0]
	}
	for _, t := range a.tunnels {
		if t.name == name {
			return t
		}
	}
	return nil
}

// route returns the tunnel a request for host came for: the one bound to
// that hostname, or the agent's only tunnel; nil when none is.
func (a *Agent) route(host string) *tunnel {
	if len(a.tunnels) == 1 {
		return a.tunnels[0]
	}
	host = strings.ToLower(host)
	if _, tcp := mux.ParseTCPKey(host); !tcp {
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		host = strings.TrimSuffix(host, ".")
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.hosts[host]
}
