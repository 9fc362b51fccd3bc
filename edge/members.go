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
// not in tried, with the fewest exchanges in flight, ties at random. ok is
// false when the pool has no such member; why then says why.
func (e *Edge) pick(b registry.Binding, tried []uint64) (registry.Binding, string, bool) {
	if !b.Pool {
		return b, "", true
	}
	now := time.Now()
	var best *session
	var chosen registry.Binding
	least, ties := 0, 0
	anyDown, anyTried := false, false
	for _, m := range b.Members {
		s := e.session(m.SessionID)
		if s == nil || !e.local(m) || !s.live(now) {
			continue
		}
		if slices.Contains(tried, m.SessionID) {
			anyTried = true
			continue
		}
		s.mu.Lock()
		down := s.members[b.Hostname] != nil && s.members[b.Hostname].down != ""
		usable := !down && !s.draining && s.bindings[b.Hostname] == m.Generation
		s.mu.Unlock()
		anyDown = anyDown || down
		if !usable {
			continue
		}
		n := s.streams.Count()
		switch {
		case best == nil || n < least:
			best, chosen, least, ties = s, m, n, 1
		case n == least:
			// Reservoir sampling: each of the tied members with equal odds.
			ties++
			if rand.N(ties) == 0 {
				best, chosen = s, m
			}
		}
	}
	if best == nil {
		e.metrics.pooled(poolNone)
		switch {
		case anyTried:
			return registry.Binding{}, whyAllRetried, false
		case anyDown:
			return registry.Binding{}, whyAllDown, false
		}
		return registry.Binding{}, whyNoMember, false
	}
	best.mu.Lock()
	best.member(b.Hostname).picked++
	best.mu.Unlock()
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
	_, held := s.bindings[m.Hostname]
	changed := held && st != nil && st.down != why
	if changed {
		st.down = why
	}
	s.mu.Unlock()
	if changed {
		s.log.Info("pool member health", "hostname", m.Hostname, "down", m.Down, "reason", why)
	}
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
// not reach its local service, or its session took no new stream), to
// another member: only a request without a body, of which nothing reached
// a local service.
func (t *routeTransport) retryPooled(req *http.Request, rt route, resp *http.Response, err error) (*http.Response, error) {
	tried := []uint64{rt.s.id}
	for {
		failed := errors.Is(err, errNoRoute) ||
			err == nil && resp.StatusCode == http.StatusBadGateway && resp.Header.Get(mux.ErrorHeader) == mux.CodeUpstreamUnreachable &&
				resp.Header.Get(mux.UnsentHeader) != ""
		if !failed || req.Body != nil && req.Body != http.NoBody || req.Context().Err() != nil {
			return resp, err
		}
		b, ok, lerr := t.e.lookup(req.Context(), rt.hostname)
		if lerr != nil || !ok || !b.Pool {
			return resp, err
		}
		m, _, ok := t.e.pick(b, tried)
		s := t.e.session(m.SessionID)
		if !ok || s == nil || !s.accessOf(rt.hostname).same(rt.s.accessOf(rt.hostname)) {
			// Another member's visitor rules were not the ones checked.
			return resp, err
		}
		if resp != nil {
			resp.Body.Close()
		}
		t.e.metrics.pooled(poolRetried)
		tried = append(tried, m.SessionID)
		rt = route{s: s, hostname: rt.hostname, generation: m.Generation, relay: rt.relay, pool: true}
		resp, err = t.local.RoundTrip(req.WithContext(context.WithValue(req.Context(), routeKey{}, rt)))
	}
}

// accessOf is who may visit hostname through s; nil: anyone.
func (s *session) accessOf(hostname string) *visitorAccess {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.access[hostname]
}
