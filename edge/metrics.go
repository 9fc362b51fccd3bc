package edge

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// metrics is the edge's Prometheus instrumentation, on a registry of its
// own (no global state, so several edges can live in one process). Counters
// are incremented where things happen; what is current (sessions, tunnels,
// streams, certificate expiry) is measured from the edge at scrape time.
// No metric is labelled by hostname: that set is unbounded.
type metrics struct {
	reg         *prometheus.Registry
	requests    *prometheus.CounterVec   // class, error_code
	duration    *prometheus.HistogramVec // class
	bytesIn     prometheus.Counter
	bytesOut    prometheus.Counter
	binds       *prometheus.CounterVec // result
	evictions   prometheus.Counter
	sessionEnds *prometheus.CounterVec // cause
	limits      *prometheus.CounterVec // limit
	acceptErrs  *prometheus.CounterVec // listener
	tcpConns    *prometheus.CounterVec // result
	webhooks    *prometheus.CounterVec // provider
	oauth       *prometheus.CounterVec // provider, result
	pools       *prometheus.CounterVec // result
	tcpBytes    *prometheus.CounterVec // direction

	// classes caches, by status/100, the children a request ends in, so
	// the common request costs no label hashing: see observe.
	classes [10]classChildren
}

// classChildren are one status class's series, each made on first use (a
// series never seen is not exposed).
type classChildren struct {
	durationOnce, answeredOnce sync.Once
	duration                   prometheus.Observer
	answered                   prometheus.Counter // error_code="": the local service answered
}

// Session end causes, the values of ngstone_session_ends_total{cause}.
const (
	endShutdown         = "shutdown"          // the edge shut down
	endEvicted          = "evicted"           // taken over, drained, closed
	endHeartbeatTimeout = "heartbeat_timeout" // no heartbeat within the freshness window
	endClosed           = "closed"            // the agent or the network closed it
)

// Bind results besides the bind error codes: ngstone_binds_total{result}.
const (
	bindOK       = "ok"
	bindTakeover = "takeover"
)

// Limits, the values of ngstone_limits_total{limit}.
const (
	limitVisitorConns    = "visitor_conns"    // MaxConns, MaxConnsPerIP
	limitVisitorRequests = "visitor_requests" // MaxRequestsPerIP
	limitSessionStreams  = "session_streams"  // MaxStreamsPerSession
	limitResponseHead    = "response_head"    // MaxResponseHead
	limitWriteTimeout    = "write_timeout"    // WriteTimeout
	limitReadTimeout     = "read_timeout"     // ReadTimeout
	limitAgentConns      = "agent_conns"      // MaxAgentConns, MaxAgentConnsPerIP
	limitAuthBan         = "auth_ban"         // AuthFailureLimit
	limitIPDenied        = "ip_denied"        // a binding's --allow-cidr, --deny-cidr
	limitSignIns         = "sign_ins"         // usedNonces
)

// Results of ngstone_pool_routes_total{result}.
const (
	poolRouted  = "routed"
	poolRetried = "retried"
	poolNone    = "none"
)

func (m *metrics) pooled(result string) { m.pools.WithLabelValues(result).Inc() }

// limited counts a bound that was hit.
func (m *metrics) limited(limit string) { m.limits.WithLabelValues(limit).Inc() }

// acceptFailed counts an accept error on a listener.
func (m *metrics) acceptFailed(listener string) { m.acceptErrs.WithLabelValues(listener).Inc() }

// maxCertLabels bounds the per-certificate expiry series; past it (autocert,
// on-demand) only the earliest expiry and the count are exposed.
const maxCertLabels = 8

func newMetrics(e *Edge) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ngstone_visitor_requests_total",
			Help: "Visitor requests answered, by status class and Ngstone-Error code (empty when the local service answered).",
		}, []string{"class", "error_code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ngstone_visitor_request_duration_seconds",
			Help:    "Time from a visitor request's arrival to the end of its response, by status class.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"class"}),
		bytesIn: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ngstone_visitor_received_bytes_total",
			Help: "Request body bytes (and upgraded-connection bytes) received from visitors.",
		}),
		bytesOut: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ngstone_visitor_sent_bytes_total",
			Help: "Response body bytes (and upgraded-connection bytes) sent to visitors.",
		}),
		binds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ngstone_binds_total",
			Help: "Bind attempts by result: ok, takeover, or the bind error code (subdomain_taken, invalid_name, reserved_name, unauthorized, ...).",
		}, []string{"result"}),
		evictions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ngstone_evictions_total",
			Help: "Sessions fenced off a hostname because another session took it over.",
		}),
		sessionEnds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ngstone_session_ends_total",
			Help: "Agent sessions ended, by cause: closed, evicted, heartbeat_timeout, shutdown.",
		}, []string{"cause"}),
	}
	m.limits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_limits_total",
		Help: "Bounds hit, by limit: visitor_conns, visitor_requests, session_streams, response_head, write_timeout, read_timeout, agent_conns, auth_ban, ip_denied, sign_ins.",
	}, []string{"limit"})
	m.acceptErrs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_accept_errors_total",
		Help: "Accept errors on a listener (retried with backoff), by listener: visitor, control.",
	}, []string{"listener"})
	m.tcpConns = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_tcp_connections_total",
		Help: "Visitor connections to TCP tunnels, by result: relayed, no_tunnel, offline, ip_denied, limited, unreachable (the agent could not reach its local service), failed.",
	}, []string{"result"})
	m.tcpBytes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_tcp_bytes_total",
		Help: "Bytes relayed by TCP tunnels, by direction: in (from visitors), out (to visitors).",
	}, []string{"direction"})
	m.webhooks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_webhook_unverified_total",
		Help: "Requests refused (403 webhook_unverified) because their signature did not verify, by the tunnel's --verify-webhook provider.",
	}, []string{"provider"})
	m.oauth = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_oauth_total",
		Help: "Sign-ins at the edge, by the tunnel's --oauth provider and result: signed_in, denied (403 oauth_denied), required (401 oauth_required), failed (oauth_failed).",
	}, []string{"provider", "result"})
	m.pools = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ngstone_pool_routes_total",
		Help: "Requests and connections to pooled names, by result: routed (to a member), retried (a request without a body sent to another member after its first could not reach its local service), none (no member could take it: 503 tunnel_offline).",
	}, []string{"result"})
	m.reg.MustRegister(m.requests, m.duration, m.bytesIn, m.bytesOut, m.binds, m.evictions, m.sessionEnds, m.limits, m.acceptErrs, m.tcpConns, m.tcpBytes, m.webhooks, m.oauth, m.pools)
	m.reg.MustRegister(
		gaugeFunc("ngstone_sessions_active", "Agent sessions open now (hello done).", func() float64 { return float64(e.stateNow().sessions) }),
		gaugeFunc("ngstone_tunnels_active", "Hostnames bound to a session of this edge now.", func() float64 { return float64(e.stateNow().tunnels) }),
		gaugeFunc("ngstone_streams_active", "Visitor requests in flight on agent streams now.", func() float64 { return float64(e.stateNow().streams) }),
		gaugeFunc("ngstone_pool_members_down", "Pool members of this edge whose agent reports its local service down now.", func() float64 { return float64(e.stateNow().down) }),
		gaugeFunc("ngstone_streams_open", "Streams open to agents now, carrying an exchange or idle between two.", func() float64 { return float64(e.stateNow().open) }),
		newCertCollector(e.certs, e.cfg.TLS),
		buildInfo(e.cfg.Version, e.cfg.Commit),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	if c := e.cluster; c != nil {
		m.reg.MustRegister(
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "ngstone_cluster_forwarded_total",
				Help: "Visitor requests forwarded to the edge holding their agent (retries included).",
			}, func() float64 { return float64(c.forwarded.Load()) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "ngstone_cluster_stale_routes_total",
				Help: "Forwarded requests the owner refused as a stale route (421), sent again after reading the registry.",
			}, func() float64 { return float64(c.retried.Load()) }),
			gaugeFunc("ngstone_cluster_lease_ok", "1 while this edge holds its cluster lease and accepts agents, else 0.", func() float64 {
				if c.store.Ready() {
					return 1
				}
				return 0
			}),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "ngstone_cluster_lease_lost_total",
				Help: "Times this edge lost its cluster lease (and closed its agents' sessions).",
			}, func() float64 { return float64(c.leaseLost.Load()) }),
			gaugeFunc("ngstone_cluster_route_cache_age_seconds", "Time since etcd last confirmed this edge's route cache current; past --cluster-route-staleness every route is read from etcd.", func() float64 {
				return c.store.RouteStats().Age.Seconds()
			}),
		)
		m.reg.MustRegister(routeCounters(c.store)...)
	}
	for _, r := range []string{bindOK, bindTakeover, mux.CodeSubdomainTaken, mux.CodeInvalidName, mux.CodeReservedName, mux.CodeUnauthorized} {
		m.binds.WithLabelValues(r) // present at zero, so rate() works from the start
	}
	for _, c := range []string{endClosed, endEvicted, endHeartbeatTimeout, endShutdown} {
		m.sessionEnds.WithLabelValues(c)
	}
	if len(e.cfg.TCPPorts) > 0 {
		for _, r := range []string{tcpRelayed, tcpNoTunnel, tcpOffline, tcpIPDenied, tcpLimited, tcpUnreachable, tcpFailed} {
			m.tcpConns.WithLabelValues(r)
		}
	}
	return m
}

// routeCounters are ngstone_cluster_routes_total{source}: visitor routes
// answered from the fresh route cache, read from etcd, and refused (503
// tunnel_offline) because etcd did not answer in time or too many reads
// were in flight.
func routeCounters(store ClusterStore) []prometheus.Collector {
	sources := map[string]func(registry.RouteStats) uint64{
		"cache":  func(r registry.RouteStats) uint64 { return r.Cached },
		"etcd":   func(r registry.RouteStats) uint64 { return r.Reread },
		"failed": func(r registry.RouteStats) uint64 { return r.Failed },
		"busy":   func(r registry.RouteStats) uint64 { return r.Busy },
	}
	var out []prometheus.Collector
	for source, count := range sources {
		out = append(out, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "ngstone_cluster_routes_total",
			Help:        "Visitor routes by where they came from: the route cache while etcd confirmed it fresh (cache), etcd (etcd), or none because etcd did not answer in time (failed) or too many hostnames were being read (busy).",
			ConstLabels: prometheus.Labels{"source": source},
		}, func() float64 { return float64(count(store.RouteStats())) }))
	}
	return out
}

func gaugeFunc(name, help string, f func() float64) prometheus.GaugeFunc {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f)
}

func buildInfo(version, commit string) prometheus.Gauge {
	if version == "" {
		version = "dev"
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "ngstone_build_info",
		Help:        "Always 1; the labels say which build runs.",
		ConstLabels: prometheus.Labels{"version": version, "commit": commit, "goversion": runtime.Version()},
	})
	g.Set(1)
	return g
}

// handler serves the registry in the Prometheus text format.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// bindReply counts a bind refusal by its code and returns reply unchanged;
// granted binds are counted by bound, which knows the outcome.
func (m *metrics) bindReply(reply mux.Message) mux.Message {
	if be, ok := reply.(*mux.BindError); ok {
		m.bindResult(be.Code)
	}
	return reply
}

// bound counts a granted bind: a takeover when it replaced another holder.
func (m *metrics) bound(o registry.Outcome) {
	if o == registry.SameInstance || o == registry.DeadHolder {
		m.bindResult(bindTakeover)
		return
	}
	m.bindResult(bindOK)
}

func (m *metrics) bindResult(result string) { m.binds.WithLabelValues(result).Inc() }

func (m *metrics) evicted() { m.evictions.Inc() }

func (m *metrics) sessionEnd(cause string) { m.sessionEnds.WithLabelValues(cause).Inc() }

// endCause says, from the edge's state, why session s is ending.
func (e *Edge) endCause(s *session) string {
	s.mu.Lock()
	draining := s.draining
	s.mu.Unlock()
	switch {
	case e.isClosing():
		return endShutdown
	case draining:
		return endEvicted
	case time.Since(time.Unix(0, s.lastBeat.Load())) > e.cfg.HeartbeatTimeout:
		return endHeartbeatTimeout
	}
	return endClosed
}

// edgeState is what the edge holds at one moment.
type edgeState struct{ sessions, tunnels, streams, open, down int }

func (e *Edge) stateNow() edgeState {
	e.mu.Lock()
	sessions := e.sessionListLocked()
	e.mu.Unlock()
	st := edgeState{sessions: len(sessions)}
	for _, s := range sessions {
		s.mu.Lock()
		st.tunnels += len(s.bindings)
		for _, m := range s.members {
			if m.down != "" {
				st.down++
			}
		}
		s.mu.Unlock()
		st.streams += s.streams.Count()
		st.open += s.ys.NumStreams() - 1 // not the control stream
	}
	return st
}

// certCollector exposes certificate expiry read from the certs.Manager at
// scrape time.
type certCollector struct {
	certs    *certs.Manager
	perName  bool
	expiry   *prometheus.Desc
	earliest *prometheus.Desc
	count    *prometheus.Desc
	attempts *prometheus.Desc
	failures *prometheus.Desc
	refused  *prometheus.Desc
	next     *prometheus.Desc
}

func newCertCollector(m *certs.Manager, cfg certs.Config) *certCollector {
	return &certCollector{
		certs: m,
		// Autocert and on-demand issue one certificate per hostname.
		perName: cfg.Mode != certs.ModeAutocert && !cfg.OnDemand,
		expiry: prometheus.NewDesc("ngstone_certificate_expiry_timestamp_seconds",
			"Expiry (NotAfter, unix seconds) of each certificate served, by its first name (domain or wildcard).", []string{"name"}, nil),
		earliest: prometheus.NewDesc("ngstone_certificate_earliest_expiry_timestamp_seconds",
			"Expiry (NotAfter, unix seconds) of the certificate served that expires first.", nil, nil),
		count: prometheus.NewDesc("ngstone_certificates", "Certificates served.", nil, nil),
		attempts: prometheus.NewDesc("ngstone_certificate_attempts_total",
			"Attempts to obtain or renew a certificate from the ACME CA, by kind (obtain, renew).", []string{"kind"}, nil),
		failures: prometheus.NewDesc("ngstone_certificate_failures_total",
			"Failed attempts to obtain or renew a certificate, by kind and reason (dns_unreachable, dns_auth, dns_update, dns_propagation, acme_unreachable, rate_limited, validation, acme_error, other).", []string{"kind", "reason"}, nil),
		refused: prometheus.NewDesc("ngstone_tls_handshakes_refused_total",
			"TLS handshakes refused for want of a certificate, by reason (no_certificate, backoff, host_not_allowed, rate_limited, error).", []string{"reason"}, nil),
		next: prometheus.NewDesc("ngstone_certificate_next_attempt_timestamp_seconds",
			"When the next attempt for a certificate whose last attempt failed is due (unix seconds); absent while none is failing.", nil, nil),
	}
}

func (c *certCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.expiry
	ch <- c.earliest
	ch <- c.count
	ch <- c.attempts
	ch <- c.failures
	ch <- c.refused
	ch <- c.next
}

// collectStats exposes the certs.Manager's counters; kinds and reasons are
// fixed sets, so the series are bounded.
func (c *certCollector) collectStats(ch chan<- prometheus.Metric) {
	st := c.certs.Stats()
	for _, n := range st.Attempts {
		ch <- prometheus.MustNewConstMetric(c.attempts, prometheus.CounterValue, float64(n.N), n.Kind)
	}
	for _, n := range st.Failures {
		ch <- prometheus.MustNewConstMetric(c.failures, prometheus.CounterValue, float64(n.N), n.Kind, n.Reason)
	}
	for _, n := range st.Refused {
		ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(n.N), n.Reason)
	}
	if !st.NextAttempt.IsZero() {
		ch <- prometheus.MustNewConstMetric(c.next, prometheus.GaugeValue, float64(st.NextAttempt.UnixMilli())/1e3)
	}
}

func (c *certCollector) Collect(ch chan<- prometheus.Metric) {
	c.collectStats(ch)
	na := c.certs.NotAfter()
	ch <- prometheus.MustNewConstMetric(c.count, prometheus.GaugeValue, float64(len(na)))
	var first time.Time
	for name, t := range na {
		if first.IsZero() || t.Before(first) {
			first = t
		}
		if c.perName && len(na) <= maxCertLabels {
			ch <- prometheus.MustNewConstMetric(c.expiry, prometheus.GaugeValue, float64(t.Unix()), name)
		}
	}
	if !first.IsZero() {
		ch <- prometheus.MustNewConstMetric(c.earliest, prometheus.GaugeValue, float64(first.Unix()))
	}
}

// visitorCodes are the Ngstone-Error values counted by name; anything else
// a local service might send in that header counts as "other".
var visitorCodes = map[string]bool{
	mux.CodeTunnelNotFound: true, mux.CodeTunnelOffline: true, mux.CodeUpstreamUnreachable: true,
	mux.CodeUpstreamTimeout: true, mux.CodeTunnelInterrupted: true, mux.CodeTunnelTimeout: true,
	mux.CodeBadHost: true, mux.CodeMisdirected: true, mux.CodeHeadersTooLarge: true,
	mux.CodeBodyTooLarge: true, mux.CodeTooManyRequests: true, mux.CodeBadResponse: true,
	mux.CodeBadRequest: true, mux.CodeMethodNotAllowed: true, mux.CodeVisitorLimit: true,
	mux.CodeBasicAuthRequired: true, mux.CodeIPDenied: true,
}

// instrument counts visitor requests, their duration and their bytes.
func (m *metrics) instrument(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		if r.Body != nil && r.Body != http.NoBody {
			r = r.WithContext(r.Context()) // the server's own keeps its *body (closedRequestBodyEarly)
			r.Body = &countingBody{ReadCloser: r.Body, n: m.bytesIn}
		}
		cw := &countingWriter{ResponseWriter: w, m: m}
		next.ServeHTTP(cw, r)
		status := int(cw.status.Load())
		if status == 0 {
			status = http.StatusOK // the handler wrote nothing
		}
		code, _ := cw.code.Load().(string)
		m.observe(status, code, time.Since(start))
	})
}

// observe counts a request that ended with status and error code.
func (m *metrics) observe(status int, code string, d time.Duration) {
	n := status / 100
	if n < 1 || n >= len(m.classes) {
		return // WriteHeader allows only 100 to 999
	}
	c := &m.classes[n]
	class := func() string { return strconv.Itoa(n) + "xx" }
	if code == "" {
		c.answeredOnce.Do(func() { c.answered = m.requests.WithLabelValues(class(), "") })
		c.answered.Inc()
	} else {
		m.requests.WithLabelValues(class(), code).Inc()
	}
	c.durationOnce.Do(func() { c.duration = m.duration.WithLabelValues(class()) })
	c.duration.Observe(d.Seconds())
}

type countingBody struct {
	io.ReadCloser
	n prometheus.Counter
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(float64(n))
	return n, err
}

// countingWriter records the status and error code and counts body bytes.
// It implements Flush and Hijack itself and unwraps for the rest, so
// http.ResponseController (which the reverse proxy uses for streaming and
// upgrades) reaches the real connection.
type countingWriter struct {
	http.ResponseWriter
	m      *metrics
	status atomic.Int32
	code   atomic.Value // string
}

func (w *countingWriter) WriteHeader(status int) {
	if status >= 200 || status == http.StatusSwitchingProtocols {
		if w.status.CompareAndSwap(0, int32(status)) {
			if code := errorCode(w.Header().Get(mux.ErrorHeader)); code != "" {
				w.code.Store(code) // none stored is no code: no allocation for a response of the agent's
			}
		}
	}
	w.ResponseWriter.WriteHeader(status)
}

func errorCode(h string) string {
	if h == "" || visitorCodes[h] {
		return h
	}
	return "other"
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.status.CompareAndSwap(0, http.StatusOK)
	n, err := w.ResponseWriter.Write(p)
	w.m.bytesOut.Add(float64(n))
	return n, err
}

func (w *countingWriter) Flush() {
	http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *countingWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c, brw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err != nil {
		return nil, nil, err
	}
	w.status.CompareAndSwap(0, http.StatusSwitchingProtocols)
	return &countingConn{Conn: c, m: w.m}, brw, nil
}

func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// countingConn counts the bytes of an upgraded (hijacked) connection.
type countingConn struct {
	net.Conn
	m *metrics
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.m.bytesIn.Add(float64(n))
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.m.bytesOut.Add(float64(n))
	return n, err
}
