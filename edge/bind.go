package edge

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// randomNameTries bounds the search for an unused random name.
const randomNameTries = 16

// bind answers one bind request of session s.
func (e *Edge) bind(ctx context.Context, s *session, m *mux.Bind) mux.Message {
	access, err := parseAccess(m.AllowCIDR, m.DenyCIDR, m.Webhook)
	if err != nil {
		return &mux.BindError{Subdomain: m.Subdomain, Hostname: m.Hostname, Code: mux.CodeBadRequest, Message: err.Error()}
	}
	if m.OAuth != nil {
		rule, err := e.oauth.rule(m.OAuth)
		switch {
		case err != nil:
		case m.Proto != "":
			err = fmt.Errorf("oauth is HTTP's: a %s tunnel relays bytes as they are", m.Proto)
		case e.cfg.HTTPSAddr == "":
			// The session cookie is Secure: over plain HTTP a visitor
			// could never keep one.
			err = errors.New("oauth: this edge serves no HTTPS (--https-addr), which a sign-in needs")
		}
		if err != nil {
			return &mux.BindError{Subdomain: m.Subdomain, Hostname: m.Hostname, Code: mux.CodeBadRequest, Message: err.Error()}
		}
		if access == nil {
			access = &visitorAccess{}
		}
		access.oauth = rule
	}
	if m.Pool {
		var why string
		switch {
		case m.Proto == mux.ProtoTCP && m.Port == 0:
			why = "a pool shares one port: pass --remote-port"
		case m.Proto != mux.ProtoTCP && m.Subdomain == "" && m.Hostname == "":
			why = "a pool shares one name: pass --subdomain or --hostname"
		}
		if why != "" {
			return &mux.BindError{Subdomain: m.Subdomain, Hostname: m.Hostname, Code: mux.CodeBadRequest, Message: why}
		}
	}
	var opts *registry.Claim // what the claim adds to a name's
	switch m.Proto {
	case "":
		opts = &registry.Claim{Pool: m.Pool}
	case mux.ProtoTCP:
		return e.bindTCP(ctx, s, m, access)
	case mux.ProtoTLS:
		opts = &registry.Claim{Proto: mux.ProtoTLS, Pool: m.Pool}
	default:
		return &mux.BindError{Code: mux.CodeBadRequest, Message: fmt.Sprintf("this edge does not serve %q tunnels: upgrade it", m.Proto)}
	}
	switch {
	case m.Hostname != "":
		return e.bindHostname(ctx, s, m, access, opts)
	case m.Subdomain == "":
		return e.bindRandom(ctx, s, access, opts)
	}
	if err := mux.ValidateSubdomain(m.Subdomain, e.cfg.ReservedNames); err != nil {
		code := mux.CodeInvalidName
		if errors.Is(err, mux.ErrReservedName) {
			code = mux.CodeReservedName
		}
		s.log.Info("bind refused", "subdomain", m.Subdomain, "code", code)
		return &mux.BindError{Subdomain: m.Subdomain, Code: code, Message: err.Error() + ": choose another --subdomain"}
	}
	if !s.policy.allows(m.Subdomain) {
		s.log.Info("bind refused", "subdomain", m.Subdomain, "code", mux.CodeUnauthorized)
		return &mux.BindError{Subdomain: m.Subdomain, Code: mux.CodeUnauthorized,
			Message: fmt.Sprintf("this token may not bind %q; it may bind %s", m.Subdomain, strings.Join(s.policy.Subdomains, ", "))}
	}
	return e.claim(ctx, s, m.Subdomain+"."+e.cfg.Domain, m.Takeover, false, access, opts)
}

// bindHostname answers a bind of a hostname of the agent's own.
func (e *Edge) bindHostname(ctx context.Context, s *session, m *mux.Bind, access *visitorAccess, opts *registry.Claim) mux.Message {
	host, err := NormalizeHost(m.Hostname)
	refuse := func(code, msg string) mux.Message {
		s.log.Info("bind refused", "hostname", m.Hostname, "code", code)
		return &mux.BindError{Hostname: m.Hostname, Code: code, Message: msg}
	}
	if err == nil {
		err = mux.ValidateHostname(host) // an IP address too: it ends in a number, or has no dot
	}
	switch {
	case errors.Is(err, mux.ErrInvalidHostname):
		return refuse(mux.CodeInvalidName, err.Error()+": check --hostname")
	case err != nil:
		return refuse(mux.CodeInvalidName, fmt.Sprintf("%q is not a hostname such as app.example.org: check --hostname", m.Hostname))
	case host == e.cfg.Domain || strings.HasSuffix(host, "."+e.cfg.Domain):
		return refuse(mux.CodeInvalidName, fmt.Sprintf("%s is under the edge's own domain: ask for it with --subdomain", host))
	case !s.policy.allowsHostname(host):
		msg := "this token may not bind hostnames of its own: the edge's --tokens-file lists those a token may (hostnames:)"
		if len(s.policy.Hostnames) > 0 {
			msg = fmt.Sprintf("this token may not bind %s; it may bind %s", host, strings.Join(s.policy.Hostnames, ", "))
		}
		return refuse(mux.CodeUnauthorized, msg)
	}
	return e.claim(ctx, s, host, m.Takeover, false, access, opts)
}

func (e *Edge) bindRandom(ctx context.Context, s *session, access *visitorAccess, opts *registry.Claim) mux.Message {
	if len(s.policy.Subdomains) > 0 {
		return &mux.BindError{Code: mux.CodeUnauthorized,
			Message: "this token may only bind " + strings.Join(s.policy.Subdomains, ", ") + ": pass --subdomain"}
	}
	for range randomNameTries {
		name := mux.RandomName(8)
		if mux.ValidateSubdomain(name, e.cfg.ReservedNames) != nil {
			continue
		}
		reply := e.claim(ctx, s, name+"."+e.cfg.Domain, false, true, access, opts)
		if be, ok := reply.(*mux.BindError); ok && be.Code == mux.CodeSubdomainTaken {
			continue
		}
		return reply
	}
	return &mux.BindError{Code: mux.CodeSubdomainTaken, Message: "the edge found no free random name; retry or pass --subdomain"}
}

// claim asks the registry for host and applies the outcome: record the
// binding (and who may visit it) on s, evict and fence the previous holder.
// opts, when set, carries what the claim adds to a name's: a TCP port's
// reservation, a TLS passthrough's proto.
func (e *Edge) claim(ctx context.Context, s *session, host string, takeover, exclusive bool, access *visitorAccess, opts *registry.Claim) mux.Message {
	name, own := strings.CutSuffix(host, "."+e.cfg.Domain)
	_, tcp := mux.ParseTCPKey(host)
	bindErr := func(code, msg string) *mux.BindError {
		switch {
		case tcp:
			return &mux.BindError{Code: code, Message: msg}
		case !own:
			return &mux.BindError{Hostname: host, Code: code, Message: msg}
		}
		return &mux.BindError{Subdomain: name, Code: code, Message: msg}
	}
	if e.isClosing() {
		return bindErr(mux.CodeShuttingDown, "the edge is shutting down; retry")
	}
	if max := s.policy.MaxBindings; max > 0 {
		n, err := e.tokenBindings(ctx, s, host)
		if err != nil {
			s.log.Error("bind failed: counting the token's tunnels", "hostname", host, "err", err)
			return bindErr(mux.CodeUnavailable, "the edge could not read the registry; retrying")
		}
		if n >= max {
			return bindErr(mux.CodeLimitExceeded, fmt.Sprintf("this token is limited to %d tunnels; stop one first", max))
		}
	}
	if !exclusive {
		e.reapStaleHolder(host)
	}
	c := registry.Claim{
		Hostname: host, InstanceID: s.instanceID, TokenID: s.tokenID,
		SessionID: s.id, Node: e.nodeName(), Exclusive: exclusive,
	}
	if opts != nil {
		c.Reserve, c.Label, c.Proto, c.Pool = opts.Reserve, opts.Label, opts.Proto, opts.Pool
	}
	res, err := e.store.Bind(ctx, c)
	if errors.Is(err, registry.ErrReserved) {
		s.log.Info("bind refused: port kept for another token", "hostname", host, "code", mux.CodeSubdomainTaken)
		refused := bindErr(mux.CodeSubdomainTaken, fmt.Sprintf("%s is kept for another token for %s after its last use (--tcp-port-reserve): choose another --remote-port", e.publicName(host), e.cfg.TCPPortReserve))
		refused.By = &mux.Holder{OtherToken: true}
		return refused
	}
	if errors.Is(err, registry.ErrTaken) {
		s.log.Info("bind refused", "hostname", host, "code", mux.CodeSubdomainTaken)
		choose := "choose another --subdomain"
		switch {
		case tcp:
			choose = "choose another --remote-port"
		case !own:
			choose = "choose another --hostname"
		}
		holder := e.holder(ctx, host)
		msg := fmt.Sprintf("%s is in use by another agent: %s, or stop the agent that holds it%s", e.publicName(host), choose, e.silentHolder(holder))
		switch {
		case errors.Is(err, registry.ErrPoolFull):
			msg = fmt.Sprintf("%s is served by a pool of %d agents, the most one pool takes: stop one of them, or %s", e.publicName(host), registry.MaxPoolMembers, choose)
		case errors.Is(err, registry.ErrPooled) && c.Pool:
			msg = fmt.Sprintf("%s is served by a pool this agent cannot join (of another token, or another protocol): %s", e.publicName(host), choose)
		case errors.Is(err, registry.ErrPooled):
			msg = fmt.Sprintf("%s is served by a pool of agents (--pool): pass --pool to join it with the same token, or %s", e.publicName(host), choose)
		case errors.Is(err, registry.ErrNotPooled):
			msg = fmt.Sprintf("%s is held by an agent that is not in a pool: %s, or restart that agent with --pool too%s", e.publicName(host), choose, e.silentHolder(holder))
		}
		refused := bindErr(mux.CodeSubdomainTaken, msg)
		refused.By = e.holderFor(holder, s.tokenID)
		return refused
	}
	if err != nil {
		s.log.Error("bind failed", "hostname", host, "err", err)
		return bindErr(mux.CodeUnavailable, "the edge could not record the binding; retrying")
	}
	b := res.Binding
	added := s.addBinding(host, b.Generation, access, c.Pool)
	if added && s.isClosed() {
		// The session ended while the registry granted the bind: its own
		// cleanup may have run already, so release here (compare-and-delete).
		e.store.Release(ctx, host, s.id, b.Generation)
		return bindErr(mux.CodeShuttingDown, "the session closed during the bind; retry")
	}
	if res.Previous != nil {
		for _, prev := range res.Previous.Owners() {
			if prev.SessionID != s.id || prev.Node != b.Node {
				e.evict(prev, &b)
			}
		}
	}
	e.metrics.bound(res.Outcome)
	// superseded: a later bind took the name over between the grant and
	// now; its eviction notice follows this reply (see session.bindMu).
	s.log.Info("bound", "hostname", host, "generation", b.Generation, "outcome", res.Outcome.String(),
		"takeover", takeover, "superseded", !added, "visitors", access.String(), "pool", c.Pool)
	urls := e.URLs(host, c.Proto)
	return &mux.BindOK{Hostname: host, URL: first(urls), Generation: b.Generation, URLs: urls}
}

// unbind releases hostname if s holds it; the edge stops routing at once.
func (e *Edge) unbind(ctx context.Context, s *session, hostname string) {
	gen, ok := s.snapshot()[hostname]
	if !ok {
		return
	}
	s.fence(hostname, gen)
	e.release(ctx, offlineBinding{host: hostname, session: s.id, gen: gen})
}

// publicName is host as a person knows it: a TCP port's key as its address.
func (e *Edge) publicName(host string) string {
	if p, ok := mux.ParseTCPKey(host); ok {
		return fmt.Sprintf("port %d", p)
	}
	return host
}

func (e *Edge) isClosing() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closing
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

// tokenBindings counts the hostnames bound with s's token but host: a bind
// of host either replaces its binding (a takeover, or a dead holder's name
// taken by a restarted agent) or is refused, so it never adds a tunnel
// there. It counts the registry's bindings: in a cluster, those of every
// edge, so a token's limit holds across the cluster.
func (e *Edge) tokenBindings(ctx context.Context, s *session, host string) (int, error) {
	bs, err := e.store.List(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, b := range bs {
		if b.TokenID == s.tokenID && b.Hostname != host {
			n++
		}
	}
	return n, nil
}

// silentHolder says, for a refused bind, how long the agent holding the
// name (b; nil: none known) has not been heard from and when the name frees itself if it stays
// silent, once it has been silent for a third of the heartbeat timeout.
// That agent is often the user's own, on a laptop whose network dropped
// and whose process they restarted. It returns "" for a holder heard from
// recently, or held by another edge of the cluster.
func (e *Edge) silentHolder(b *registry.Binding) string {
	if b == nil || b.Pool || !e.local(*b) {
		return ""
	}
	var silent, window, quiet time.Duration
	if s := e.session(b.SessionID); s != nil {
		silent, window = time.Since(time.Unix(0, s.lastBeat.Load())), e.cfg.HeartbeatTimeout
		quiet = window / 3 // a holder heard a moment ago is just busy
	} else if e.restored(*b) {
		// Held since before the edge restarted: its agent has not come
		// back yet.
		silent, window = time.Since(b.LastHeard), e.restoredWindow()
	} else {
		return ""
	}
	left := window - silent
	if silent < quiet || left <= 0 {
		return ""
	}
	return fmt.Sprintf("; it has not been heard from for %s, and the name frees itself in %s if it stays silent",
		silent.Truncate(unitOf(silent)), (left + unitOf(left) - 1).Truncate(unitOf(left)))
}

// holder is the binding that holds host, nil when there is none or the
// edge cannot tell.
func (e *Edge) holder(ctx context.Context, host string) *registry.Binding {
	b, ok, err := e.lookup(ctx, host)
	if err != nil || !ok {
		return nil
	}
	return &b
}

// unitOf is what a duration shown to a person is rounded to: a second, or
// 100 ms under ten seconds.
func unitOf(d time.Duration) time.Duration {
	if d < 10*time.Second {
		return 100 * time.Millisecond
	}
	return time.Second
}
