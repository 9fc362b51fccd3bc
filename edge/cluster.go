package edge

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// Cluster mode: several edges share one registry (registry.Etcd). A
// visitor request is routed by the registry's route cache only while etcd
// has confirmed that cache current within the staleness bound; past it,
// by the hostname read from etcd, or not at all (503 tunnel_offline): an
// edge never serves a session that may have lost its binding. A request
// for a hostname bound on another edge is forwarded to that edge, exactly
// one hop, with the generation the route gave. The owner serves it only if
// one of its sessions holds that generation; else it answers 421 with
// routeHeader "stale", and the first edge reads the registry again and
// retries once. The owner never forwards.

// Headers between edges. The owner removes them before the agent sees the
// request.
const (
	generationHeader  = "Ngstone-Generation"
	forwardedByHeader = "Ngstone-Forwarded-By"
	routeHeader       = "Ngstone-Route"
	clusterServerName = "ngstone-cluster"
)

// MinClusterKey is the shortest accepted cluster key.
const MinClusterKey = 32

// ClusterConfig joins the edge to a cluster.
type ClusterConfig struct {
	// Store is the shared registry. The edge starts it and closes it.
	Store ClusterStore
	// Addr is the listener other edges forward visitor requests to, over
	// mutual TLS. Required.
	Addr string
	// Advertise is the address other edges reach Addr at. Empty means
	// Addr's bound address, with the node name as host when Addr's host is
	// unspecified (":7443" is advertised as NODE:7443).
	Advertise string
	// Key is the secret every edge of the cluster shares: the internal
	// connections' certificates derive from it, so only its holders can
	// forward or be forwarded to. At least MinClusterKey characters.
	Key string `json:"-"`
}

// ClusterStore is a registry shared by several edges (registry.Etcd).
type ClusterStore interface {
	registry.Store
	Node() string
	Start(ctx context.Context, addr string, hooks registry.Hooks) error
	Close() error
	Ready() bool
	// Route is Lookup for routing: from the cache only while it is
	// confirmed fresh, else read from etcd; an error means do not route.
	Route(ctx context.Context, hostname string) (registry.Binding, bool, error)
	Lookup(hostname string) (registry.Binding, bool)
	RouteStats() registry.RouteStats
	NodeAddr(node string) (string, bool)
	OpenSession(ctx context.Context, sess registry.Session) error
	CloseSession(ctx context.Context, id uint64) error
	Sessions(ctx context.Context) ([]registry.Session, error)
	// SetDown records why this edge's pool member of hostname reports its
	// local service down ("" when up), for the other edges to route by.
	SetDown(ctx context.Context, hostname string, sessionID, generation uint64, down string) error
}

func (c *ClusterConfig) validate() error {
	switch {
	case c.Store == nil:
		return errors.New("cluster: no registry store")
	case c.Store.Node() == "":
		return errors.New("cluster: node-name is empty: give each edge a unique --node-name")
	case c.Addr == "":
		return errors.New("cluster-addr is empty: other edges forward visitor requests to it")
	case len(c.Key) < MinClusterKey:
		return fmt.Errorf("cluster-key must be at least %d characters, the same on every edge (e.g. the output of `openssl rand -hex 32`)", MinClusterKey)
	}
	return nil
}

// errNotBound means the registry holds no binding for the hostname.
var errNotBound = errors.New("edge: hostname not bound")

// errRegistry means the registry could not be read.
var errRegistry = errors.New("edge: registry unavailable")

// clusterTLS returns the server and client configurations of the internal
// connections. Every edge derives the same CA key from the cluster key
// (ed25519 from an HKDF seed) and signs its own short-lived leaf with it;
// both sides require a leaf of that CA.
func clusterTLS(key string) (server, client *tls.Config, err error) {
	seed, err := hkdf.Key(sha256.New, []byte(key), nil, "ngstone cluster CA v1", ed25519.SeedSize)
	if err != nil {
		return nil, nil, err
	}
	caKey := ed25519.NewKeyFromSeed(seed)
	epoch := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ngstone cluster CA"},
		NotBefore: epoch, NotAfter: epoch.AddDate(200, 0, 0),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster CA: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, nil, err
	}
	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	leafTmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: clusterServerName},
		DNSNames:  []string{clusterServerName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().AddDate(10, 0, 0),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, ca, leafKey.Public(), caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster certificate: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	leaf := tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: leafKey}
	server = &tls.Config{Certificates: []tls.Certificate{leaf}, ClientCAs: pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13, NextProtos: []string{"http/1.1"}}
	client = &tls.Config{Certificates: []tls.Certificate{leaf}, RootCAs: pool,
		ServerName: clusterServerName, MinVersion: tls.VersionTLS13, NextProtos: []string{"http/1.1"}}
	return server, client, nil
}

// cluster is the edge's side of cluster mode.
type cluster struct {
	store     ClusterStore
	node      string
	serverTLS *tls.Config
	forward   *http.Transport
	// forwarded and retried count requests sent to other edges, and those
	// sent again after a stale route; leaseLost the leases lost.
	forwarded, retried, leaseLost atomic.Int64

	mu sync.Mutex
	// inFlight counts the exchanges this edge has forwarded to each pool
	// member of another edge and not yet ended, by generation: what pick
	// weighs them by. Bounded by those in flight: a count of 0 is deleted.
	inFlight map[uint64]int
	// health holds, per local pool member, the health not yet recorded in
	// the registry (shareHealth); bounded by the members.
	health map[healthKey]*healthShare
}

func newCluster(cfg *ClusterConfig, tunnelTimeout time.Duration) (*cluster, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	server, client, err := clusterTLS(cfg.Key)
	if err != nil {
		return nil, err
	}
	return &cluster{
		store: cfg.Store, node: cfg.Store.Node(), serverTLS: server,
		inFlight: map[uint64]int{}, health: map[healthKey]*healthShare{},
		forward: &http.Transport{
			DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			TLSClientConfig:       client,
			TLSHandshakeTimeout:   5 * time.Second,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			ExpectContinueTimeout: 5 * time.Second,
			ResponseHeaderTimeout: tunnelTimeout + 5*time.Second,
			DisableCompression:    true,
		},
	}, nil
}

// startCluster starts the registry with the edge's hooks and its
// advertised cluster address.
func (e *Edge) startCluster(ctx context.Context) error {
	addr := e.cfg.Cluster.Advertise
	if addr == "" {
		host, port, _ := net.SplitHostPort(e.listeners["cluster"].Addr().String())
		if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
			host = e.cluster.node
		}
		addr = net.JoinHostPort(host, port)
	}
	return e.cluster.store.Start(ctx, addr, registry.Hooks{
		TakenOver: e.takenOver,
		Lost:      e.clusterLost,
		Regained:  func() { e.log.Info("cluster lease regained: accepting agents again") },
	})
}

// takenOver evicts a session of this edge whose binding prev the cluster
// moved on, naming the holder the route cache knows now (it has just
// applied the change; no I/O).
func (e *Edge) takenOver(prev registry.Binding) {
	var next *registry.Binding
	if b, ok := e.cluster.store.Lookup(prev.Hostname); ok {
		next = &b
	}
	e.evict(prev, next)
}

// clusterLost closes every session: without a lease this edge cannot vouch
// for them, and their agents reconnect, through the load balancer, to an
// edge that can.
func (e *Edge) clusterLost(err error) {
	e.cluster.leaseLost.Add(1)
	e.mu.Lock()
	sessions := e.sessionListLocked()
	e.mu.Unlock()
	e.log.Error("cluster lease lost: closing agent sessions", "sessions", len(sessions), "err", err)
	var wg sync.WaitGroup
	for _, s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.send(&mux.GoAway{Reason: "edge lost its cluster registry"})
			s.close()
		}()
	}
	wg.Wait()
}

// lookup finds hostname's binding to route by: in a cluster, from a route
// cache known to be fresh, else from etcd; alone, from the store. An error
// means the edge cannot vouch for any route now.
func (e *Edge) lookup(ctx context.Context, host string) (registry.Binding, bool, error) {
	if e.cluster != nil {
		return e.cluster.store.Route(ctx, host)
	}
	return e.store.Get(ctx, host)
}

// local reports whether b is held by a session of this edge.
func (e *Edge) local(b registry.Binding) bool {
	return e.cluster == nil || b.Node == e.cluster.node
}

// routeTransport sends a request to its route: a stream of a local session,
// or the owning edge.
type routeTransport struct {
	e     *Edge
	local http.RoundTripper
}

// RoundTrip sends req along its route. When the visitor's body breaks
// first (malformed, over the limit, stalled), the exchange is over, and
// that is the error, whatever the other side answered to the broken body.
func (t *routeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	rt, _ := req.Context().Value(routeKey{}).(route)
	var body *readErrBody
	if req.Body != nil && req.Body != http.NoBody {
		body = &readErrBody{ReadCloser: req.Body}
		req.Body = body
	}
	var resp *http.Response
	var err error
	if rt.s != nil {
		resp, err = t.local.RoundTrip(req)
	} else {
		resp, err = t.forward(req, rt)
	}
	if rt.pool {
		resp, err = t.retryPooled(req, rt, resp, err)
	}
	if body != nil && body.failed() != nil {
		if resp != nil {
			resp.Body.Close()
		}
		return nil, body.failed()
	}
	return resp, err
}

// forward sends req to the edge rt names and, if that edge no longer holds
// rt's generation, once more to wherever the registry now says.
func (t *routeTransport) forward(req *http.Request, rt route) (*http.Response, error) {
	c := t.e.cluster
	var body *unreadBody
	if req.Body != nil && req.Body != http.NoBody {
		// The server closes the visitor's body when the handler returns;
		// until then it must stay open for a second attempt.
		body = &unreadBody{r: req.Body}
	}
	resp, err := t.forwardOnce(req, rt, body)
	if err != nil || resp.StatusCode != http.StatusMisdirectedRequest || resp.Header.Get(routeHeader) != "stale" {
		return resp, err
	}
	if rt.pool {
		// The member left that edge: the pool's next pick (retryPooled).
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		resp.Body.Close()
		return nil, errNoRoute
	}
	if body != nil && body.read.Load() {
		// Some of the body left: it cannot be sent again.
		resp.Body.Close()
		return nil, errNoRoute
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
	resp.Body.Close()
	c.retried.Add(1)
	b, ok, err := t.e.store.Get(req.Context(), rt.hostname)
	switch {
	case err != nil:
		return nil, errors.Join(errRegistry, err)
	case !ok:
		return nil, errNotBound
	case b.Generation == rt.generation:
		// The owner refused the generation the registry still names: it
		// is going away. Never a second hop to it.
		return nil, errNoRoute
	case t.e.local(b):
		s := t.e.session(b.SessionID)
		if s == nil || !s.live(time.Now()) {
			return nil, errNoRoute
		}
		// The checks the owner makes of a forwarded request (clusterHandler)
		// are this edge's now: the visitor's address (X-Forwarded-For,
		// which this edge set), and a webhook's signature, whose body is
		// unread and cannot be checked here, or a sign-in, whose answer
		// cannot be given now: offline, as in a move.
		if ip, ok := visitorIP(req, true); !ok || !s.allows(rt.hostname, ip) {
			t.e.metrics.limited(limitIPDenied)
			return nil, errIPDenied
		}
		if webhook, rule := s.checks(rt.hostname); webhook != nil || rule != nil {
			return nil, errNoRoute
		}
		next := route{s: s, hostname: rt.hostname, generation: b.Generation, relay: rt.relay}
		return t.local.RoundTrip(withBody(req.WithContext(context.WithValue(req.Context(), routeKey{}, next)), body))
	}
	return t.forwardOnce(req, route{node: b.Node, hostname: rt.hostname, generation: b.Generation}, body)
}

func (t *routeTransport) forwardOnce(req *http.Request, rt route, body *unreadBody) (*http.Response, error) {
	c := t.e.cluster
	addr, ok := c.store.NodeAddr(rt.node)
	if !ok {
		return nil, errNoRoute
	}
	out := withBody(req.Clone(req.Context()), body)
	// The declared trailers' values arrive at the end of the body, in
	// req's map (mux.PassTrailers), not in the clone's copy of it.
	out.Trailer = req.Trailer
	out.URL.Scheme, out.URL.Host, out.RequestURI = "https", addr, ""
	out.Header.Set(generationHeader, strconv.FormatUint(rt.generation, 10))
	out.Header.Set(forwardedByHeader, c.node)
	if body != nil {
		// The owner may refuse the route before the body is sent, so the
		// body can still go to the right edge.
		out.Header.Set("Expect", "100-continue")
	}
	c.forwarded.Add(1)
	if rt.pool {
		c.flying(rt.generation, 1)
	}
	resp, err := c.forward.RoundTrip(out)
	if rt.pool {
		if err != nil {
			c.flying(rt.generation, -1)
		} else {
			l := &landing{ReadCloser: resp.Body, c: c, gen: rt.generation}
			resp.Body = l
			if rwc, ok := l.ReadCloser.(io.ReadWriteCloser); ok {
				// An upgraded connection: the reverse proxy copies both
				// ways, and needs the body writable.
				resp.Body = &upgradedLanding{l, rwc}
			}
		}
	}
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Op == "dial" {
		// The owner is gone (its bindings go with its lease): offline,
		// not a broken tunnel.
		return nil, errors.Join(errNoRoute, err)
	}
	return resp, err
}

// flying counts an exchange forwarded to the pool member at gen: n is 1
// when it starts, -1 when it ends.
func (c *cluster) flying(gen uint64, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inFlight[gen] += n; c.inFlight[gen] <= 0 {
		delete(c.inFlight, gen)
	}
}

// flights returns the exchanges in flight to the pool member at gen.
func (c *cluster) flights(gen uint64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.inFlight[gen]
}

// landing ends a forwarded pool exchange's count when its response's body
// is closed, once.
type landing struct {
	io.ReadCloser
	c    *cluster
	gen  uint64
	once sync.Once
}

func (l *landing) Close() error {
	l.once.Do(func() { l.c.flying(l.gen, -1) })
	return l.ReadCloser.Close()
}

// upgradedLanding is a landing after a 101: the connection, writable.
type upgradedLanding struct {
	*landing
	io.Writer
}

// withBody gives req the body wrapper, which the forwarding transport may
// close without closing the visitor's body.
func withBody(req *http.Request, body *unreadBody) *http.Request {
	if body != nil {
		req.Body = body
	}
	return req
}

// unreadBody records whether any byte was read, and ignores Close: the
// visitor's body is closed once, by the proxy.
type unreadBody struct {
	r    io.Reader
	read atomic.Bool
}

func (b *unreadBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if n > 0 {
		b.read.Store(true)
	}
	return n, err
}

func (b *unreadBody) Close() error { return nil }

// clusterHandler serves requests other edges forward: only to a local
// session that holds the generation they name.
func (e *Edge) clusterHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Host == clusterServerName {
			// Not a visitor's request (their Host is a tunnel's name,
			// checked by the first edge): another edge's admin API.
			if r.Method == http.MethodGet && r.URL.Path == sessionsPath {
				mux.WriteJSON(w, http.StatusOK, e.sessionStatuses(time.Now()))
			} else {
				http.NotFound(w, r)
			}
			return
		}
		host, err := NormalizeHost(r.Host)
		_, tcp := mux.ParseTCPKey(r.Host)
		if tcp {
			host, err = r.Host, nil
		}
		gen, gerr := strconv.ParseUint(r.Header.Get(generationHeader), 10, 64)
		if err != nil || gerr != nil {
			mux.WriteVisitorErrorFor(w, r, mux.CodeBadHost, r.Host)
			return
		}
		b, ok, err := e.cluster.store.Route(r.Context(), host)
		if err != nil {
			mux.WriteVisitorError(w, mux.CodeTunnelOffline, host)
			return
		}
		pool := ok && b.Pool
		if ok {
			// A pool's member was picked by the first edge.
			b, ok = b.Member(gen)
		}
		if !ok || b.Node != e.cluster.node {
			w.Header().Set(routeHeader, "stale")
			mux.WriteVisitorErrorFor(w, r, mux.CodeMisdirected, host)
			return
		}
		s := e.session(b.SessionID)
		if s == nil || !s.holds(host, gen) || !s.live(time.Now()) || pool && s.isDraining() {
			if pool {
				// Nothing was sent: the first edge may pick another member.
				w.Header().Set(mux.UnsentHeader, "1")
			}
			mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelOffline, host)
			return
		}
		if ip, ok := visitorIP(r, true); !ok || !s.allows(host, ip) {
			e.metrics.limited(limitIPDenied)
			mux.WriteVisitorErrorFor(w, r, mux.CodeIPDenied, host)
			return
		}
		if pool {
			s.mu.Lock()
			s.member(host).picked++ // counted by the member's own edge
			s.mu.Unlock()
		}
		r.Header.Del(generationHeader)
		r.Header.Del(forwardedByHeader)
		relay := tcp || b.Proto == mux.ProtoTLS
		if relay && r.Header.Get("Expect") == "100-continue" {
			// Routed: send for the visitor's bytes now. The server would
			// at the body's first read, which the agent's 200 can beat;
			// the first edge then never sends the body.
			w.WriteHeader(http.StatusContinue)
		}
		e.serveRoute(w, r, route{s: s, hostname: host, generation: gen, relay: relay, forwarded: true}, e.clusterProxy)
	})
}

// nodeName is this edge's name in the cluster; empty when alone.
func (e *Edge) nodeName() string {
	if e.cluster == nil {
		return ""
	}
	return e.cluster.node
}

// registryUnreachable refuses a hello the cluster registry could not
// vouch for; the agent retries, maybe on another edge.
var registryUnreachable = &mux.Error{Code: mux.CodeUnavailable, Message: "the edge cannot reach its cluster registry; retrying"}

// openClusterSession makes s live in the cluster registry, so other edges'
// binds see its holder live (rule 3). It refuses the hello when the
// registry cannot be reached: the agent retries, maybe on another edge.
func (e *Edge) openClusterSession(ctx context.Context, s *session) error {
	if e.cluster == nil {
		return nil
	}
	if err := e.cluster.store.OpenSession(ctx, registry.Session{ID: s.id, TokenID: s.tokenID, InstanceID: s.instanceID}); err != nil {
		s.send(registryUnreachable)
		return err
	}
	return nil
}

// clusterSessionLimit applies the token's session limit across the
// cluster, after s's own record is written: it counts the token's live
// sessions on every edge, but those of s's instance (which is about to
// take their bindings over). Two hellos racing on two edges may both be
// refused, never both let past the limit. A refused session's record is
// gone before the agent hears of it, so that its next hello (or another
// agent's) does not count it.
func (e *Edge) clusterSessionLimit(ctx context.Context, s *session) error {
	max := s.policy.MaxSessions
	if e.cluster == nil || max <= 0 {
		return nil
	}
	all, err := e.cluster.store.Sessions(ctx)
	if err != nil {
		e.closeClusterSession(s.id)
		s.send(registryUnreachable)
		return err
	}
	n := 0
	for _, o := range all {
		if o.TokenID == s.tokenID && o.InstanceID != s.instanceID {
			n++
		}
	}
	if n >= max {
		e.closeClusterSession(s.id)
		return e.refuseSessionLimit(s, max)
	}
	return nil
}

// closeClusterSession marks session id dead in the registry. A failure is
// retried by the reaper: until it succeeds, other instances are refused
// the session's names. Without a lease there is nothing to do: the key
// goes with the lease.
func (e *Edge) closeClusterSession(id uint64) {
	if e.cluster == nil || !e.cluster.store.Ready() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.cluster.store.CloseSession(ctx, id); err != nil {
		e.log.Warn("cluster: could not mark session closed; retrying", "session", id, "err", err)
		e.mu.Lock()
		e.unclosed = append(e.unclosed, id)
		e.mu.Unlock()
	}
}

// retryUnclosed retries the session closes that failed.
func (e *Edge) retryUnclosed() {
	e.mu.Lock()
	ids := e.unclosed
	e.unclosed = nil
	e.mu.Unlock()
	for _, id := range ids {
		e.closeClusterSession(id)
	}
}

// reapStaleHolder closes the local session holding host if its heartbeat
// is stale, before a bind asks the registry: the cluster registry sees a
// session dead only once its edge closes it, which the reaper would do
// only at its next tick. The in-memory store asks liveness at the bind.
func (e *Edge) reapStaleHolder(host string) {
	if e.cluster == nil {
		return
	}
	b, ok := e.cluster.store.Lookup(host)
	if !ok {
		return
	}
	for _, o := range b.Owners() {
		if !e.local(o) {
			continue
		}
		s := e.session(o.SessionID)
		if s == nil || !s.helloDone() || s.live(time.Now()) {
			continue
		}
		s.log.Info("session stale: no heartbeat within the freshness window", "heartbeat_timeout", e.cfg.HeartbeatTimeout)
		s.close()
		e.closeClusterSession(s.id)
	}
}
