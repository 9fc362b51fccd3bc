package edge

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// memberState is a session's part in the pool of one hostname.
type memberState struct {
	down   string // why its agent says its local service fails; "": up
	picked uint64 // requests and connections routed to it
}

// Why a pool routes nowhere, for the visitor's 503 tunnel_offline.
const (
	whyNoMember   = "no agent of its pool is connected"
	whyAllDown    = "every agent of its pool reports its local service down"
	whyAllRetried = "every agent of its pool failed to reach its local service"
)

// pick chooses the owner of b that a new request or connection goes to:
// b itself, or of a pool the member that is live, up, not draining and
// not in tried (generations), with the fewest exchanges in flight, ties at
// random. A member on another edge of the cluster counts as up unless the
// registry says it is down (Binding.Down), and its exchanges in flight are
// those this edge has forwarded to it. ok is false when the pool has no
// such member; why then says why.
func (e *Edge) pick(b registry.Binding, tried []uint64) (registry.Binding, string, bool) {
	if !b.Pool {
		return b, "", true
	}
	now := time.Now()
	var best *session
	var chosen registry.Binding
	least, ties, found := 0, 0, false
	anyDown, anyTried := false, false
	for _, m := range b.Members {
		var s *session
		if e.local(m) {
			if s = e.session(m.SessionID); s == nil || !s.live(now) {
				continue
			}
		} else if _, ok := e.cluster.store.NodeAddr(m.Node); !ok {
			continue
		}
		if slices.Contains(tried, m.Generation) {
			anyTried = true
			continue
		}
		var n int
		if s != nil {
			s.mu.Lock()
			down := s.members[b.Hostname] != nil && s.members[b.Hostname].down != ""
			usable := !down && !s.draining && s.bindings[b.Hostname] == m.Generation
			s.mu.Unlock()
			anyDown = anyDown || down
			if !usable {
				continue
			}
			n = s.streams.Count()
		} else {
			if m.Down != "" {
				anyDown = true
				continue
			}
			n = e.cluster.flights(m.Generation)
		}
		switch {
		case !found || n < least:
			best, chosen, least, ties, found = s, m, n, 1, true
		case n == least:
			// Reservoir sampling: each of the tied members with equal odds.
			ties++
			if rand.N(ties) == 0 {
				best, chosen = s, m
			}
		}
	}
	if !found {
		e.metrics.pooled(poolNone)
		switch {
		case anyTried:
			return registry.Binding{}, whyAllRetried, false
		case anyDown:
			return registry.Binding{}, whyAllDown, false
		}
		return registry.Binding{}, whyNoMember, false
	}
	if best != nil {
		best.mu.Lock()
		best.member(b.Hostname).picked++
		best.mu.Unlock()
	}
	e.metrics.pooled(poolRouted)
	return chosen, "", true
}

// member returns s's state in hostname's pool; s.mu held.
func (s *session) member(hostname string) *memberState {
	m := s.members[hostname]
	if m == nil {
		if s.members == nil {
			s.members = map[string]*memberState{}
		}
		m = &memberState{}
		s.members[hostname] = m
	}
	return m
}

// health takes the agent's word on its local service behind hostname:
// down, its member takes no new request while another can. Only a pool
// member of s has a say; a change only is logged, its reason cut short.
func (s *session) health(m *mux.Health) {
	why := ""
	if m.Down {
		why = m.Reason
		if why == "" {
			why = "its local service fails"
		}
		why = truncate(why, 200)
	}
	s.mu.Lock()
	st := s.members[m.Hostname]
	gen, held := s.bindings[m.Hostname]
	changed := held && st != nil && st.down != why
	if changed {
		st.down = why
	}
	s.mu.Unlock()
	if changed {
		s.log.Info("pool member health", "hostname", m.Hostname, "down", m.Down, "reason", why)
		if s.e.cluster != nil {
			s.e.shareHealth(s, m.Hostname, gen, why)
		}
	}
}

// healthGap paces a member's health writes to the registry: an agent
// that flips its health writes at most one each.
const healthGap = 250 * time.Millisecond

// healthWait bounds one health write to the registry.
const healthWait = 5 * time.Second

type healthKey struct {
	host    string
	session uint64
}

// healthShare is a member's latest health, to be written.
type healthShare struct {
	gen  uint64
	down string
}

// shareHealth records the health of s's member of host in the registry,
// for the other edges of the cluster to route by: one writer per member,
// which writes the latest health, at most one each healthGap, again after
// a write that failed, and ends once the registry holds it (or the
// session is gone).
func (e *Edge) shareHealth(s *session, host string, gen uint64, down string) {
	c, k := e.cluster, healthKey{host, s.id}
	c.mu.Lock()
	h, busy := c.health[k]
	if !busy {
		h = &healthShare{}
		c.health[k] = h
	}
	h.gen, h.down = gen, down
	c.mu.Unlock()
	if busy {
		return
	}
	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		c.mu.Lock()
		delete(c.health, k)
		c.mu.Unlock()
		return
	}
	e.wg.Add(1)
	e.mu.Unlock()
	go func() {
		defer e.wg.Done()
		warned := false
		for {
			c.mu.Lock()
			gen, down := h.gen, h.down
			c.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), healthWait)
			err := c.store.SetDown(ctx, host, s.id, gen, down)
			cancel()
			if err != nil && !warned {
				warned = true
				s.log.Warn("pool member health not recorded in the cluster registry yet; other edges route by the last recorded until it is", "hostname", host, "err", err)
			}
			select {
			case <-s.closed:
			case <-time.After(healthGap):
			}
			c.mu.Lock()
			if s.isClosed() || err == nil && h.gen == gen && h.down == down {
				delete(c.health, k)
				c.mu.Unlock()
				return
			}
			c.mu.Unlock()
		}
	}()
}

// truncate cuts s to at most n bytes, never inside a character, and drops
// what is not UTF-8.
func truncate(s string, n int) string {
	if len(s) > n {
		for n > 0 && !utf8.RuneStart(s[n]) {
			n--
		}
		s = s[:n]
	}
	return strings.ToValidUTF8(s, "")
}

// retryPooled sends req, which failed on its pool member (the agent could
// not reach its local service, or the member took no new exchange), to
// another member: only a request without a body, of which nothing reached
// a local service. A member of this edge is tried only when the request
// passed its visitor rules (checked); one of another edge checks the
// request as any forwarded to it.
func (t *routeTransport) retryPooled(req *http.Request, rt route, resp *http.Response, err error) (*http.Response, error) {
	tried := []uint64{rt.generation}
	for {
		if !unsent(resp, err) || req.Body != nil && req.Body != http.NoBody || req.Context().Err() != nil {
			return resp, err
		}
		b, ok, lerr := t.e.lookup(req.Context(), rt.hostname)
		if lerr != nil || !ok || !b.Pool {
			return resp, err
		}
		m, _, ok := t.e.pick(b, tried)
		if !ok {
			return resp, err
		}
		next := route{node: m.Node, hostname: rt.hostname, generation: m.Generation, relay: rt.relay, pool: true}
		if rt.s != nil && !t.e.local(m) {
			if webhook, rule := rt.s.checks(rt.hostname); webhook != nil || rule != nil {
				// Checked here, the request lost what another edge would
				// check it by again (the sign-in's cookie, its body).
				return resp, err
			}
		}
		if t.e.local(m) {
			if next.s = t.e.session(m.SessionID); next.s == nil || !t.checked(req, rt, next.s) {
				return resp, err
			}
		}
		if resp != nil {
			resp.Body.Close()
		}
		t.e.metrics.pooled(poolRetried)
		tried = append(tried, m.Generation)
		rt = next
		if rt.s != nil {
			resp, err = t.local.RoundTrip(req.WithContext(context.WithValue(req.Context(), routeKey{}, rt)))
		} else {
			resp, err = t.forward(req, rt)
		}
	}
}

// checked reports whether req, sent first along rt, has passed the
// visitor rules of s, a member of this edge: those of rt's member when it
// was one of this edge too; else only the visitor's address (which this
// edge set), as a sign-in or a webhook's signature is not checked again
// here (forward does the same).
func (t *routeTransport) checked(req *http.Request, rt route, s *session) bool {
	if rt.s != nil {
		return s.accessOf(rt.hostname).same(rt.s.accessOf(rt.hostname))
	}
	if webhook, rule := s.checks(rt.hostname); webhook != nil || rule != nil {
		return false
	}
	ip, ok := visitorIP(req, true)
	return ok && s.allows(rt.hostname, ip)
}

// unsent reports an exchange that failed before anything of it reached a
// local service: no stream was taken, the member's edge took nothing, or
// the agent could not reach its local service (Unsent).
func unsent(resp *http.Response, err error) bool {
	if err != nil {
		return errors.Is(err, errNoRoute)
	}
	if resp.Header.Get(mux.UnsentHeader) == "" {
		return false
	}
	code := resp.Header.Get(mux.ErrorHeader)
	return resp.StatusCode == http.StatusBadGateway && code == mux.CodeUpstreamUnreachable ||
		resp.StatusCode == http.StatusServiceUnavailable && code == mux.CodeTunnelOffline
}

// accessOf is who may visit hostname through s; nil: anyone.
func (s *session) accessOf(hostname string) *visitorAccess {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.access[hostname]
}
