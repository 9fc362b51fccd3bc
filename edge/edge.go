// Package edge is ngstone's public server.
//
// It accepts agents on a TLS control listener (one yamux session each),
// binds their hostnames (and TCP ports) through a registry.Store, and
// routes each visitor request by its Host to a stream of the owning
// session's pool, which carries HTTP/1.1 exchanges one after another. A
// TCP tunnel's connection, or a TLS one passed through by SNI, is one
// such exchange whose bodies are its two directions (tcp.go).
//
// Invariant: the edge never decides ownership itself. It asks the registry,
// routes only to the session holding a hostname's current generation, and
// on a takeover fences the old session for that hostname at once (it gets
// no new requests), lets its accepted requests finish within DrainTimeout,
// then closes it if it holds nothing else.
package edge

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// Edge is one edge server. New builds it without I/O; Start binds and serves.
type Edge struct {
	cfg   Config
	log   *slog.Logger
	store registry.Store
	// persist is the store when it outlives the process (RegistryFile);
	// restoredFloor is the highest session id of the process before.
	persist       *registry.Bolt
	restoredFloor uint64
	certs         *certs.Manager
	proxy         http.Handler
	metrics       *metrics
	// cluster is nil on an edge that runs alone.
	cluster      *cluster
	clusterProxy http.Handler
	// policies are the accepted tokens: --token ones unrestricted, then
	// the --tokens-file entries. Empty means an open edge.
	policies []*TokenPolicy
	auth     *authLimiter
	oauth    *oauth // nil: no sign-in providers

	nextSession atomic.Uint64

	mu       sync.Mutex
	sessions map[uint64]*session
	offline  []offlineBinding
	unclosed []uint64 // cluster sessions whose close failed, to retry
	closing  bool

	listeners map[string]net.Listener
	tcpLns    map[int]net.Listener // the TCP tunnels' ports
	servers   []*http.Server       // admin and cluster
	visitors  []*visitorServer     // http and https
	slots     visitorSlots
	ctrlLn    net.Listener
	wg        sync.WaitGroup
	stop      context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
}

// New checks cfg and returns an edge that has not started.
func New(cfg Config, log *slog.Logger) (*Edge, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &Edge{
		cfg:       cfg,
		log:       log,
		sessions:  make(map[uint64]*session),
		listeners: make(map[string]net.Listener),
		tcpLns:    make(map[int]net.Listener),
		done:      make(chan struct{}),
		auth:      newAuthLimiter(cfg.AuthFailureLimit, cfg.AuthFailureWindow),
	}
	for _, t := range cfg.Tokens {
		e.policies = append(e.policies, &TokenPolicy{Token: t})
	}
	for i := range cfg.TokenPolicies {
		e.policies = append(e.policies, &cfg.TokenPolicies[i])
	}
	e.store = cfg.Store
	if e.store == nil {
		e.store = registry.NewMemory(e.holderLive)
	}
	if cfg.Cluster != nil {
		c, err := newCluster(cfg.Cluster, cfg.TunnelTimeout)
		if err != nil {
			return nil, err
		}
		e.cluster, e.store = c, c.store
		e.clusterProxy = e.newProxy(true)
	}
	m, err := certs.New(cfg.TLS, log, e.certPolicy)
	if err != nil {
		return nil, err
	}
	e.certs = m
	if e.oauth, err = newOAuth(cfg); err != nil {
		return nil, err
	}
	e.proxy = e.newProxy(false)
	e.metrics = newMetrics(e)
	return e, nil
}

// Start binds every listener, starts certificates and serves until Close
// or Shutdown. After an error it has released whatever it had bound.
func (e *Edge) Start(ctx context.Context) (err error) {
	ctx, e.stop = context.WithCancel(context.WithoutCancel(ctx))
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if e.cfg.RegistryFile != "" && e.cluster == nil {
		if err := e.openRegistry(); err != nil {
			return err
		}
	}
	if err := e.listen(); err != nil {
		return err
	}
	// The ACME modes answer challenges on these listeners, and do not
	// wait for a CA: a missing certificate shows in /healthz and refused
	// handshakes, never in a failed start.
	e.certs.UseListeners(e.Addr("http"), e.Addr("https"))
	if err := e.certs.Start(ctx); err != nil {
		return err
	}
	if e.cluster != nil {
		if err := e.startCluster(ctx); err != nil {
			return err
		}
	}
	e.serve(ctx)
	e.log.Info("edge started", "domain", e.cfg.Domain, e.addrAttr())
	return nil
}

func (e *Edge) listen() error {
	addrs := map[string]string{
		"http": e.cfg.HTTPAddr, "https": e.cfg.HTTPSAddr,
		"control": e.cfg.ControlAddr, "admin": e.cfg.AdminAddr,
	}
	if e.cluster != nil {
		addrs["cluster"] = e.cfg.Cluster.Addr
	}
	for name, addr := range addrs {
		if addr == "" {
			continue
		}
		listen := net.Listen
		if name == "http" || name == "https" {
			listen = listenVisitors
		}
		ln, err := listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("%s-addr %s: %w", name, addr, err)
		}
		e.listeners[name] = ln
	}
	return e.listenTCP()
}

func (e *Edge) serve(ctx context.Context) {
	if ln := e.listeners["http"]; ln != nil {
		q := &drainingListener{Listener: ln}
		e.serveVisitors(ctx, q, e.limitVisitors(q), e.certs.HTTPHandler(e.metrics.instrument(e.visitorHandler())), nil)
	}
	if ln := e.listeners["https"]; ln != nil {
		// Batched: a visitor's upload is read up to 256 KiB a syscall, and
		// the records of one response write leave in one (visitorWriter).
		q := &drainingListener{Listener: ln}
		e.serveVisitors(ctx, q, mux.BatchedListener(e.limitVisitors(q)), withTLSState(e.metrics.instrument(e.visitorHandler())), e.passthroughTLS(e.certs.TLSConfig()))
	}
	if ln := e.listeners["admin"]; ln != nil {
		e.serveHTTP(ln, e.adminHandler(), nil)
	}
	if ln := e.listeners["cluster"]; ln != nil {
		e.serveHTTP(ln, e.clusterHandler(), e.cluster.serverTLS)
	}
	tc := e.certs.TLSConfig()
	tc.NextProtos = []string{mux.ALPN}
	e.ctrlLn = tls.NewListener(mux.BatchedListener(e.limitAgents(e.listeners["control"])), tc)
	e.serveTCP(ctx)
	e.wg.Add(2)
	go e.acceptAgents(ctx)
	go e.reap(ctx)
}

// limitVisitors bounds concurrent visitor connections (MaxConns,
// MaxConnsPerIP), by the visitor's address: behind a load balancer that
// speaks PROXY protocol (ProxyProtocol), the one its header gives.
func (e *Edge) limitVisitors(ln net.Listener) net.Listener {
	if e.cfg.ProxyProtocol {
		ln = &proxyproto.Listener{Listener: ln, ConnPolicy: e.proxyPolicy, ReadHeaderTimeout: e.cfg.ReadHeaderTimeout}
	}
	return newLimitListener(ln, e.cfg.MaxConns, e.cfg.MaxConnsPerIP, e.cfg.ProxyProtocol, func(addr string) {
		e.metrics.limited(limitVisitorConns)
		e.log.Debug("visitor connection refused: connection limit", "remote", addr)
	})
}

// proxyPolicy is PROXY protocol's rule: a trusted source (ProxyProtocolFrom)
// must send the header, whose address is the visitor's; any other may not
// send one (a connection that does is refused), and is the visitor itself.
func (e *Edge) proxyPolicy(o proxyproto.ConnPolicyOptions) (proxyproto.Policy, error) {
	if ta, ok := o.Upstream.(*net.TCPAddr); ok {
		if ip, ok := netip.AddrFromSlice(ta.IP); ok {
			for _, p := range e.cfg.ProxyProtocolFrom {
				if p.Contains(ip.Unmap()) {
					return proxyproto.REQUIRE, nil
				}
			}
		}
	}
	return proxyproto.REJECT, nil
}

// limitAgents bounds concurrent control connections, before any TLS work
// (MaxAgentConns, MaxAgentConnsPerIP).
func (e *Edge) limitAgents(ln net.Listener) net.Listener {
	return newLimitListener(ln, e.cfg.MaxAgentConns, e.cfg.MaxAgentConnsPerIP, false, func(addr string) {
		e.metrics.limited(limitAgentConns)
		e.log.Debug("agent connection refused: connection limit", "remote", addr)
	})
}

// serveVisitors serves a visitor listener ln (q is its socket, for the
// drain): over TLS when tc is set.
func (e *Edge) serveVisitors(ctx context.Context, q *drainingListener, ln net.Listener, h http.Handler, tc *tls.Config) {
	v := e.newVisitorServer(ln, h, tc)
	v.ctx = ctx
	v.queue = q
	e.visitors = append(e.visitors, v)
	v.start()
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		if err := v.serve(); err != nil && !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			e.log.Error("listener stopped", "addr", ln.Addr().String(), "err", err)
		}
	}()
}

// withTLSState gives requests read by the HTTP/1.1 server from a
// connection the edge shook hands with the TLS state net/http would have
// set itself.
func withTLSState(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil {
			if c, ok := r.Context().Value(connKey{}).(*tls.Conn); ok {
				st := c.ConnectionState()
				r.TLS = &st
			}
		}
		h.ServeHTTP(w, r)
	})
}

func (e *Edge) serveHTTP(ln net.Listener, h http.Handler, tc *tls.Config) {
	srv := &http.Server{
		Handler:           h,
		TLSConfig:         tc,
		ReadHeaderTimeout: e.cfg.ReadHeaderTimeout,
		IdleTimeout:       e.cfg.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          e.certs.ErrorLog(),
	}
	e.servers = append(e.servers, srv)
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		var err error
		if tc != nil {
			err = srv.ServeTLS(ln, "", "")
		} else {
			err = srv.Serve(ln)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			e.log.Error("listener stopped", "addr", ln.Addr().String(), "err", err)
		}
	}()
}

// Addr returns the bound address of a listener: "http", "https",
// "control", "admin" or "cluster"; nil if it is not listening.
func (e *Edge) Addr(name string) net.Addr {
	if ln := e.listeners[name]; ln != nil {
		return ln.Addr()
	}
	return nil
}

// addrAttr is the listeners' addresses as one structured attribute:
// addrs.http=... in text logs, an object in JSON, never Go's map syntax.
func (e *Edge) addrAttr() slog.Attr {
	names := make([]string, 0, len(e.listeners))
	for n := range e.listeners {
		names = append(names, n)
	}
	slices.Sort(names)
	attrs := make([]any, 0, len(names))
	for _, n := range names {
		attrs = append(attrs, slog.String(n, e.listeners[n].Addr().String()))
	}
	return slog.Group("addrs", attrs...)
}

// Domain returns the edge's domain.
func (e *Edge) Domain() string { return e.cfg.Domain }

// Store returns the registry the edge binds through.
func (e *Edge) Store() registry.Store { return e.store }

// URLs returns the public URLs of hostname bound for proto (a binding's
// Proto), HTTPS first; of a TCP port's key, its tcp:// address; of a
// TLS passthrough's name, its tls:// one.
func (e *Edge) URLs(hostname, proto string) []string {
	if p, ok := mux.ParseTCPKey(hostname); ok {
		return []string{"tcp://" + net.JoinHostPort(e.cfg.Domain, strconv.Itoa(p))}
	}
	listeners := []struct{ name, scheme, port string }{{"https", "https", "443"}, {"http", "http", "80"}}
	if proto == mux.ProtoTLS {
		listeners = []struct{ name, scheme, port string }{{"https", "tls", "443"}}
	}
	var out []string
	for _, s := range listeners {
		ln := e.listeners[s.name]
		if ln == nil {
			continue
		}
		u := s.scheme + "://" + hostname
		if _, port, _ := net.SplitHostPort(ln.Addr().String()); port != s.port {
			u += ":" + port
		}
		out = append(out, u)
	}
	return out
}

// Run starts the edge and serves until ctx ends, then shuts down gracefully.
func (e *Edge) Run(ctx context.Context) error {
	if err := e.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.ShutdownGrace)
	defer cancel()
	return e.Shutdown(sctx)
}

// Shutdown stops the edge in the order that loses no accepted request: no
// new agents or binds; sessions whose agent is already silent closed at
// once (their requests get tunnel_offline now rather than hold the rest
// up); no new visitor connections, while every request already read is
// routed and answered with the agents still connected; only then are the
// agents told to go away (they reconnect, with takeover). ctx bounds the
// whole; then Close.
func (e *Edge) Shutdown(ctx context.Context) error {
	e.mu.Lock()
	e.closing = true
	sessions := e.sessionListLocked()
	e.mu.Unlock()
	if e.ctrlLn != nil {
		e.ctrlLn.Close()
	}
	for _, ln := range e.tcpLns {
		ln.Close()
	}
	now := time.Now()
	for _, s := range sessions {
		if s.helloDone() && !s.live(now) {
			s.close()
		}
	}
	var wg sync.WaitGroup
	for _, srv := range e.servers {
		wg.Add(1)
		go func() { defer wg.Done(); srv.Shutdown(ctx) }()
	}
	for _, v := range e.visitors {
		wg.Add(1)
		go func() { defer wg.Done(); v.shutdown(ctx) }()
	}
	wg.Wait()
	e.recordHeard()
	for _, s := range sessions {
		s.send(&mux.GoAway{Reason: "edge shutting down"})
	}
	for _, s := range sessions {
		s.streams.Wait(ctx, s.closed)
	}
	return e.Close()
}

// Close stops everything at once and waits for every goroutine the edge
// started. It is idempotent.
func (e *Edge) Close() error {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.closing = true
		sessions := e.sessionListLocked()
		e.mu.Unlock()
		if e.stop != nil {
			e.stop()
		}
		if e.ctrlLn != nil {
			e.ctrlLn.Close()
		}
		// Servers first: a listener closed under a running server would
		// make it report an accept error instead of ErrServerClosed.
		for _, srv := range e.servers {
			srv.Close()
		}
		for _, v := range e.visitors {
			v.close()
		}
		for _, ln := range e.listeners {
			ln.Close()
		}
		for _, ln := range e.tcpLns {
			ln.Close()
		}
		for _, s := range sessions {
			s.close()
		}
		e.oauth.close()
		e.wg.Wait()
		if e.persist != nil {
			// The bindings outlive the process: after a restart, their
			// agents take them back (and others wait out the window).
			e.persist.Close()
		} else {
			// A shared store outlives this edge: leave it nothing of ours.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			e.releaseOffline(ctx, time.Time{})
			cancel()
		}
		if e.cluster != nil {
			e.cluster.forward.CloseIdleConnections()
			e.cluster.store.Close()
		}
		e.certs.Close()
		close(e.done)
	})
	return nil
}

func (e *Edge) sessionListLocked() []*session {
	out := make([]*session, 0, len(e.sessions))
	for _, s := range e.sessions {
		out = append(out, s)
	}
	return out
}

func (e *Edge) session(id uint64) *session {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.sessions[id]
}

// holderLive is the registry's liveness question, computed now: the holder's
// session exists, is open, and heartbeated within the freshness window.
func (e *Edge) holderLive(b registry.Binding) bool {
	if s := e.session(b.SessionID); s != nil {
		return s.live(time.Now())
	}
	return e.restored(b) && time.Since(b.LastHeard) <= e.restoredWindow()
}

// certPolicy allows on-demand certificates only for the domain and hostnames
// bound at the moment of the handshake.
func (e *Edge) certPolicy(ctx context.Context, host string) error {
	host, err := NormalizeHost(host)
	if err != nil {
		return err
	}
	if host == e.cfg.Domain || e.oauth != nil && host == oauthHost+"."+e.cfg.Domain {
		return nil
	}
	b, ok, err := e.store.Get(ctx, host)
	switch {
	case err != nil || !ok:
		return fmt.Errorf("no tunnel is bound to %s", host)
	case b.Proto == mux.ProtoTLS:
		return fmt.Errorf("%s is passed through to its agent, which has its own certificate", host)
	}
	return nil
}

// reap closes sessions whose heartbeat is older than the freshness window,
// which releases their bindings.
func (e *Edge) reap(ctx context.Context) {
	defer e.wg.Done()
	t := time.NewTicker(max(e.cfg.HeartbeatTimeout/4, time.Millisecond))
	defer t.Stop()
	var lastHeard time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			e.mu.Lock()
			sessions := e.sessionListLocked()
			e.mu.Unlock()
			for _, s := range sessions {
				if s.helloDone() && !s.live(now) {
					s.log.Info("session stale: no heartbeat within the freshness window", "heartbeat_timeout", e.cfg.HeartbeatTimeout)
					s.close()
				}
			}
			e.releaseOffline(ctx, now)
			if now.Sub(lastHeard) >= e.heardEvery() {
				e.recordHeard()
				lastHeard = now
			}
			e.retryUnclosed()
			e.auth.sweep(now)
		}
	}
}

// ReloadCertificates re-reads certificate files (tls-mode files); the CLI
// calls it on SIGHUP. Errors are logged and the old certificate kept.
func (e *Edge) ReloadCertificates() {
	if err := e.certs.Reload(); err != nil {
		e.log.Error("certificate reload failed; keeping the old certificate", "err", err)
	}
}

// CAFile returns the path of the self-signed CA's certificate.
func (e *Edge) CAFile() string {
	return filepath.Join(e.cfg.TLS.DataDir, certs.CAFile)
}

// Sessions returns how many agent sessions the edge holds now.
func (e *Edge) Sessions() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.sessions)
}
