package mux

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Hello is the agent's first frame on the control stream.
type Hello struct {
	Version int `json:"version"`
	// InstanceID is the agent's instance secret: 32 lower-case hex
	// characters (ValidInstanceID), fixed for the agent process. It
	// authorizes taking a name back at once, so the edge keeps and shows
	// only its InstanceDigest.
	InstanceID string `json:"instance_id"`
	Token      string `json:"token,omitempty"`
	Agent      string `json:"agent,omitempty"` // software version, informational
}

// InstanceDigest is what the edge, the registry and every display show of
// an instance id, which is a secret: 32 hex characters of a SHA-256 of it.
// Rule 1 compares digests, which is comparing the secrets; nothing that
// shows a digest gives away the id it came from.
func InstanceDigest(id string) string {
	sum := sha256.Sum256([]byte("ngstone instance v1\x00" + id))
	return hex.EncodeToString(sum[:16])
}

// ValidInstanceID reports whether id is an instance id as a hello carries
// it: 32 lower-case hex characters (16 random bytes).
func ValidInstanceID(id string) bool {
	if len(id) != 32 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// HelloOK accepts a hello and names the edge-assigned session.
type HelloOK struct {
	SessionID uint64 `json:"session_id"`
	// HeartbeatTimeout is the edge's freshness window in milliseconds, so an
	// agent can warn when its own interval is too long for it.
	HeartbeatTimeoutMS int64 `json:"heartbeat_timeout_ms,omitempty"`
	// MaxResponseHead is the edge's bound on a response head from the
	// agent, in bytes; zero means MaxResponseHead. The agent holds local
	// services to it.
	MaxResponseHead int64 `json:"max_response_head,omitempty"`
	// Features lists what the edge does beyond protocol version 1's first
	// release (FeatureHostname, FeatureVisitorCIDR):
	// an agent that asks for one the edge does not list must not go on as
	// if it were done.
	Features []string `json:"features,omitempty"`
}

// Features an edge lists in hello_ok.
const (
	// FeatureHostname: bind takes a Hostname of the agent's own.
	FeatureHostname = "hostname"
	// FeatureVisitorCIDR: bind takes AllowCIDR and DenyCIDR, and the
	// edge refuses other visitors (403 ip_denied).
	FeatureVisitorCIDR = "visitor-cidr"
	// FeatureTCP: bind takes Proto "tcp" and a Port, and the edge relays
	// TCP connections of a public port.
	FeatureTCP = "tcp"
	// FeatureTLS: bind takes Proto "tls" with a Subdomain or Hostname, and
	// the edge passes TLS connections for that name (by SNI) through.
	FeatureTLS = "tls"
	// FeatureWebhook: bind takes Webhook, and the edge refuses requests
	// whose signature it does not verify (403 webhook_unverified).
	FeatureWebhook = "verify-webhook"
	// FeatureOAuth: bind takes OAuth, and the edge lets in only visitors
	// signed in with the named provider and on the allow lists.
	FeatureOAuth = "oauth"
	// FeaturePool: bind takes Pool, and the agent's Health messages take
	// its member out of the pool's routing and back.
	FeaturePool = "pool"
	// "spare-stream" was listed by edges that took a stream the agent
	// opened in advance for large uploads; the streams of exchanges now
	// stay open, and an agent opens none.
)

// Bind asks for a hostname: a Subdomain of the edge's domain, or a whole
// Hostname of the agent's own (FeatureHostname), which the token must
// allow. Neither asks the edge for a random unused subdomain. Takeover is
// set on every bind after a reconnect. AllowCIDR and DenyCIDR (prefixes
// such as 192.0.2.0/24 or 2001:db8::/32) restrict the visitors the edge lets
// reach the tunnel (FeatureVisitorCIDR): an address in a DenyCIDR prefix,
// or outside every AllowCIDR prefix when there are any, gets 403 ip_denied.
//
// A bind with Proto "tcp" (FeatureTCP) asks for a public TCP port instead:
// Port, or with none the port the edge keeps for the token and Label (the
// tunnel's local address or name), else a free one. Its hostname is
// TCPKey(port), and each visitor connection reaches the agent as one
// exchange whose request body carries the visitor's bytes and whose
// response body the local service's (spec.md). A bind with Proto "tls"
// (FeatureTLS) asks for a Subdomain or Hostname whose TLS connections the
// edge passes through whole, each as a TCP tunnel's connection.
type Bind struct {
	Proto     string   `json:"proto,omitempty"`
	Port      int      `json:"port,omitempty"`
	Label     string   `json:"label,omitempty"`
	Subdomain string   `json:"subdomain,omitempty"`
	Hostname  string   `json:"hostname,omitempty"`
	Takeover  bool     `json:"takeover,omitempty"`
	AllowCIDR []string `json:"allow_cidr,omitempty"`
	DenyCIDR  []string `json:"deny_cidr,omitempty"`
	// Webhook has the edge verify each request's signature before it
	// crosses the tunnel (FeatureWebhook).
	Webhook *Webhook `json:"verify_webhook,omitempty"`
	// OAuth has the edge sign visitors in before a request crosses the
	// tunnel (FeatureOAuth).
	OAuth *OAuth `json:"oauth,omitempty"`
	// Pool shares the name with the other agents of the token that ask
	// for it with Pool (FeaturePool); it needs a name (no random one).
	Pool bool `json:"pool,omitempty"`
}

// OAuth is who may visit a tunnel: visitors signed in with Provider, one
// the edge's operator configured, whose email is in AllowEmails, or whose
// domain is in AllowDomains, or who has a claim of AllowClaims
// ("groups=dev"); with no list at all, anyone signed in. AllowPreflight
// lets CORS preflights (OPTIONS with Origin) through unsigned.
type OAuth struct {
	Provider       string   `json:"provider"`
	AllowEmails    []string `json:"allow_emails,omitempty"`
	AllowDomains   []string `json:"allow_domains,omitempty"`
	AllowClaims    []string `json:"allow_claims,omitempty"`
	AllowPreflight bool     `json:"allow_preflight,omitempty"`
}

// MaxOAuthRules bounds the entries of an OAuth's allow lists together.
const MaxOAuthRules = 1024

// Validate reports the first field of o that an edge refuses, in the
// agent's flags' words. Whether the edge offers Provider only it knows.
func (o *OAuth) Validate() error {
	if !ValidProviderName(o.Provider) {
		return fmt.Errorf("oauth %q: a provider's name is 1 to 63 of a-z 0-9 - _", o.Provider)
	}
	if len(o.AllowEmails)+len(o.AllowDomains)+len(o.AllowClaims) > MaxOAuthRules {
		return fmt.Errorf("oauth-allow-*: at most %d entries together", MaxOAuthRules)
	}
	for _, e := range o.AllowEmails {
		if local, domain, ok := strings.Cut(e, "@"); !ok || local == "" || domain == "" || strings.ContainsAny(e, " \t\r\n") {
			return fmt.Errorf("oauth-allow-email %q: want an address, name@domain", e)
		}
	}
	for _, d := range o.AllowDomains {
		if d == "" || strings.ContainsAny(d, "@ \t\r\n") {
			return fmt.Errorf("oauth-allow-domain %q: want a domain, e.g. example.com", d)
		}
	}
	for _, c := range o.AllowClaims {
		if k, v, ok := strings.Cut(c, "="); !ok || k == "" || v == "" {
			return fmt.Errorf("oauth-allow-claim %q: want NAME=VALUE, e.g. groups=dev", c)
		}
	}
	return nil
}

// ValidProviderName reports whether s is a sign-in provider's name as an
// operator configures it: 1 to 63 of a-z 0-9 - _.
func ValidProviderName(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// Webhook is how a tunnel's requests are signed: Provider "github",
// "stripe", "slack", or "hmac" (a hex or base64 HMAC-SHA256 of the body
// in the field Header), with Secret, the key the sender signs with.
type Webhook struct {
	Provider string `json:"provider"`
	Secret   string `json:"secret"`
	Header   string `json:"header,omitempty"`
}

// Webhook providers (Webhook.Provider).
var WebhookProviders = []string{"github", "stripe", "slack", "hmac"}

// MaxWebhookSecret bounds Webhook.Secret, in bytes.
const MaxWebhookSecret = 4 << 10

// Validate reports the first field of w that an edge refuses, in the
// agent's flags' words: the agent checks before it binds, the edge again.
func (w *Webhook) Validate() error {
	switch {
	case !slices.Contains(WebhookProviders, w.Provider):
		return fmt.Errorf("verify-webhook %q: want one of %s", w.Provider, strings.Join(WebhookProviders, ", "))
	case w.Secret == "" || len(w.Secret) > MaxWebhookSecret:
		return fmt.Errorf("verify-webhook-secret-file: the secret the sender signs with must have 1 to %d bytes", MaxWebhookSecret)
	case w.Provider == "hmac" && !httpguts.ValidHeaderFieldName(w.Header):
		return fmt.Errorf("verify-webhook-header %q: --verify-webhook hmac needs the name of the field that carries the signature", w.Header)
	case w.Provider != "hmac" && w.Header != "":
		return fmt.Errorf("verify-webhook-header: only for --verify-webhook hmac; %s's field is fixed", w.Provider)
	}
	return nil
}

// BindOK grants a binding.
type BindOK struct {
	Hostname   string `json:"hostname"`
	URL        string `json:"url"`
	Generation uint64 `json:"generation"`
	// URLs lists every public URL of the binding (https first), when the
	// edge serves more than one scheme.
	URLs []string `json:"urls,omitempty"`
}

// BindError refuses a bind. It is final: the agent must not retry.
type BindError struct {
	Subdomain string `json:"subdomain,omitempty"`
	Hostname  string `json:"hostname,omitempty"`
	Code      string `json:"code"`
	Message   string `json:"message"`
	// By is the agent that holds the name, with subdomain_taken; nil
	// otherwise, or from an edge that does not say.
	By *Holder `json:"by,omitempty"`
}

// Heartbeat is sent by the agent every heartbeat interval.
type Heartbeat struct {
	Seq uint64 `json:"seq"`
}

// HeartbeatAck answers a heartbeat with the same sequence number.
type HeartbeatAck struct {
	Seq uint64 `json:"seq"`
}

// Evicted tells a session it no longer owns Hostname.
type Evicted struct {
	Hostname string `json:"hostname"`
	Reason   string `json:"reason"`
	// By is the agent that took Hostname; nil when the edge does not know
	// (nobody holds it now) or does not say (an older edge).
	By *Holder `json:"by,omitempty"`
}

// Holder is what the edge tells an agent of the agent that holds a name
// it lost or asked for: an agent that presented the same token (of the
// same account) by its InstanceDigest and, when the token is one (not an
// edge open to all) and it is connected to the same edge, its address as
// the edge saw it; an agent of another token only as that, never by
// anything of its own.
type Holder struct {
	Instance string `json:"instance,omitempty"`
	Addr     string `json:"addr,omitempty"`
	// OtherToken: the holder presented another token; nothing else of it
	// is told.
	OtherToken bool `json:"other_token,omitempty"`
	// Pool: the name is held by a pool of agents (--pool).
	Pool bool `json:"pool,omitempty"`
}

// String names the holder for a person: "instance DIGEST from ADDR", "an
// agent with another token", or "" when the edge said nothing of it.
func (h Holder) String() string {
	switch {
	case h.Pool && h.OtherToken:
		return "a pool of agents with another token"
	case h.Pool:
		return "a pool of agents (--pool)"
	case h.OtherToken:
		return "an agent with another token"
	case h.Instance != "" && h.Addr != "":
		return "instance " + h.Instance + " from " + h.Addr
	case h.Instance != "":
		return "instance " + h.Instance
	}
	return ""
}

// A Bind's Proto: "" is HTTP.
const (
	// ProtoTCP: a public TCP port.
	ProtoTCP = "tcp"
	// ProtoTLS: TLS connections for a name passed through by SNI, their
	// bytes relayed as a TCP tunnel's.
	ProtoTLS = "tls"
)

// Refused tells the agent of a request the edge answered itself for one
// of its tunnels, which never crossed (a webhook whose signature did not
// verify), so that the agent's inspector shows it and why. The edge sends
// a few a second at most, and only to an agent whose bind asked for a
// check that refuses.
type Refused struct {
	Hostname string `json:"hostname"`
	Method   string `json:"method"`
	Path     string `json:"path"`
	Code     string `json:"code"`
	Reason   string `json:"reason"`
}

// Health tells the edge that the local service of one of the agent's pool
// members is failing (Down, with the agent's Reason) or answering again:
// a member down takes no new request while another can.
type Health struct {
	Hostname string `json:"hostname"`
	Down     bool   `json:"down,omitempty"`
	Reason   string `json:"reason,omitempty"`
}

// Unbind releases a hostname gracefully.
type Unbind struct {
	Hostname string `json:"hostname"`
}

// Unbound confirms an unbind.
type Unbound struct {
	Hostname string `json:"hostname"`
}

// GoAway announces that the edge is shutting down; the agent reconnects.
type GoAway struct {
	Reason string `json:"reason,omitempty"`
}

// Error is a fatal session-level refusal (for example an unauthorized hello).
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// RetryAfterMS, when set, is how long the agent must wait before it
	// connects again (an address refused for too many failed hellos).
	RetryAfterMS int64 `json:"retry_after_ms,omitempty"`
}

func (*Hello) MessageType() Type        { return TypeHello }
func (*HelloOK) MessageType() Type      { return TypeHelloOK }
func (*Bind) MessageType() Type         { return TypeBind }
func (*BindOK) MessageType() Type       { return TypeBindOK }
func (*BindError) MessageType() Type    { return TypeBindError }
func (*Heartbeat) MessageType() Type    { return TypeHeartbeat }
func (*HeartbeatAck) MessageType() Type { return TypeHeartbeatAck }
func (*Evicted) MessageType() Type      { return TypeEvicted }
func (*Unbind) MessageType() Type       { return TypeUnbind }
func (*Unbound) MessageType() Type      { return TypeUnbound }
func (*GoAway) MessageType() Type       { return TypeGoAway }
func (*Error) MessageType() Type        { return TypeError }
func (*Refused) MessageType() Type      { return TypeRefused }
func (*Health) MessageType() Type       { return TypeHealth }
