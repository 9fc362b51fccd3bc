package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The agent serves the edge's streams with net/http end to end: an
// http.Server reads each stream's request (the yamux session is its
// listener, each stream one connection carrying one exchange),
// httputil.ReverseProxy relays it, and an http.Transport keeps the
// connections to the local service alive between exchanges. So the framing
// the agent accepts from a local service and the framing it writes to the
// edge are net/http's, the same code the edge reads them with; a pooled
// local connection is reused only when net/http finds it clean (a
// connection that receives bytes nobody asked for is closed); and the
// local service's timeout runs from the end of the request body, as
// http.Transport's ResponseHeaderTimeout does.

// streamIdle bounds how long a stream whose exchange is over may stay open:
// the edge closes each stream once it has read the response.
const streamIdle = 10 * time.Second

// exchange is one request relayed by the agent, for its log line and the
// inspector.
type exchange struct {
	start  time.Time
	status atomic.Int64 // the final status sent to the edge; 0: none yet
	code   atomic.Value // string: the agent's own error code, when it answered itself
	n1xx   atomic.Int32 // informational responses passed on
	cut    bool         // the response was broken off
	cap    *capture     // what the inspector keeps; nil without one
}

type exchangeKey struct{}

func exchangeOf(ctx context.Context) *exchange {
	x, _ := ctx.Value(exchangeKey{}).(*exchange)
	return x
}

func (x *exchange) errCode() string {
	s, _ := x.code.Load().(string)
	return s
}

// newStreamServer returns the server of one session's streams. Each stream
// holds up the session's drain (held) from its accept until its exchange
// is over, or its connection is upgraded.
func (a *Agent) newStreamServer(held *mux.Tracker) *http.Server {
	return &http.Server{
		Handler:                      http.HandlerFunc(a.serveExchange),
		ReadHeaderTimeout:            a.cfg.DialTimeout,
		IdleTimeout:                  streamIdle,
		MaxHeaderBytes:               mux.MaxRequestHead,
		DisableGeneralOptionsHandler: true, // OPTIONS * is the local service's to answer
		ErrorLog:                     slog.NewLogLogger(a.log.Handler(), slog.LevelDebug),
		ConnState: func(c net.Conn, st http.ConnState) {
			if sc, ok := c.(*streamConn); ok {
				sc.state(st)
			}
		},
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, streamKey{}, c)
		},
	}
}

type streamKey struct{}

// serveStreams serves the streams ln accepts until it fails; held counts
// those that hold up a drain. Every stream's goroutines are counted in the
// agent's WaitGroup until they end.
func (a *Agent) serveStreams(ln net.Listener, held *mux.Tracker) {
	srv := a.newStreamServer(held)
	srv.Serve(&streamListener{Listener: ln, a: a, held: held})
	srv.Close()
}

// streamListener counts each accepted stream in the agent's WaitGroup and
// the drain's tracker. Closing it leaves the session to its owner.
type streamListener struct {
	net.Listener
	a    *Agent
	held *mux.Tracker
}

func (l *streamListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.a.wg.Add(1) // while serveStreams holds one: never from zero
	l.held.Add()
	return &streamConn{Conn: c, a: l.a, held: l.held, holding: true}, nil
}

func (l *streamListener) Close() error { return nil }

// streamConn is one stream as the server sees it.
type streamConn struct {
	net.Conn
	a       *Agent
	held    *mux.Tracker
	written atomic.Int64 // bytes written to the edge

	mu      sync.Mutex
	holding bool // counted in held
	ended   bool // its WaitGroup count is given back
}

func (c *streamConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.written.Add(int64(n))
	return n, err
}

// state follows the server's view of the stream: an exchange running holds
// up the drain; one over, an upgraded connection or a closed stream does
// not. A closed or hijacked stream's goroutine is done with it.
func (c *streamConn) state(st http.ConnState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	hold := st == http.StateNew || st == http.StateActive
	switch {
	case hold && !c.holding && !c.ended:
		c.held.Add()
	case !hold && c.holding:
		c.held.Done()
	}
	c.holding = hold && !c.ended
	if (st == http.StateClosed || st == http.StateHijacked) && !c.ended {
		c.ended = true
		c.a.wg.Done()
	}
}

// serveExchange relays one request: basic auth first, then the reverse
// proxy. Its goroutine is counted in the agent's WaitGroup, so that an
// upgraded connection still copying keeps Run from returning.
func (a *Agent) serveExchange(w http.ResponseWriter, r *http.Request) {
	a.wg.Add(1) // while the stream's count is held: never from zero
	defer a.wg.Done()
	x := &exchange{start: time.Now()}
	a.stats.opened(x.start)
	if a.inspect != nil {
		x.cap = &capture{}
	}
	r = r.WithContext(context.WithValue(r.Context(), exchangeKey{}, x))
	sc, _ := r.Context().Value(streamKey{}).(*streamConn)
	var sent int64
	if sc != nil {
		sent = sc.written.Load()
	}
	defer func() {
		if p := recover(); p != nil {
			// The proxy broke the response off (the local service cut it
			// short). If none of it had left, the edge answers for it.
			if p == http.ErrAbortHandler && (sc == nil || sc.written.Load() == sent) {
				x.status.Store(http.StatusBadGateway)
				x.code.Store(mux.CodeBadResponse)
			}
			x.cut = true
			a.ended(x, r)
			panic(p)
		}
		a.ended(x, r)
	}()
	// The local service may answer while the request body still streams
	// (an early 413, a duplex stream): the server must not close the
	// body once the response has started.
	http.NewResponseController(w).EnableFullDuplex()
	rw := &exchangeWriter{ResponseWriter: w, x: x}
	if a.auth != nil && !a.auth.allows(r) {
		a.answer(rw, r, mux.CodeBasicAuthRequired)
		return
	}
	a.proxy.ServeHTTP(rw, r)
}

// ended counts, logs and keeps the exchange once it is over.
func (a *Agent) ended(x *exchange, r *http.Request) {
	a.stats.closed(Request{Start: x.start, Method: r.Method, Path: r.URL.RequestURI(),
		Status: int(x.status.Load()), Code: x.errCode(), Duration: time.Since(x.start)})
	if a.cfg.LogRequests {
		a.logRequest(x, r)
	}
	if a.inspect != nil {
		a.inspect.record(x, r)
	}
}

// answer ends an exchange with the agent's own response for code.
func (a *Agent) answer(w http.ResponseWriter, r *http.Request, code string) {
	if x := exchangeOf(r.Context()); x != nil {
		x.code.Store(code)
	}
	mux.WriteVisitorErrorFor(w, r, code, visitorHost(r))
}

// visitorHost is the host a visitor asked for, for error messages: the
// X-Forwarded-Host the edge set, else the Host (which --host-header has not
// touched yet: it applies to the request to the local service).
func visitorHost(r *http.Request) string {
	if h := r.Header.Get("X-Forwarded-Host"); h != "" {
		return h
	}
	return r.Host
}

// exchangeWriter records the final status the exchange sent back.
type exchangeWriter struct {
	http.ResponseWriter
	x *exchange
}

func (w *exchangeWriter) WriteHeader(code int) {
	if code >= 200 || code == http.StatusSwitchingProtocols {
		w.x.status.CompareAndSwap(0, int64(code))
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *exchangeWriter) Write(p []byte) (int, error) {
	w.x.status.CompareAndSwap(0, http.StatusOK)
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the server's writer (Flush,
// Hijack for upgrades).
func (w *exchangeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// newProxy returns the reverse proxy to the local service.
func (a *Agent) newProxy() *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite:        a.rewrite,
		ModifyResponse: a.modifyResponse,
		Transport:      upstreamTransport{a},
		BufferPool:     mux.BufferPool{},
		ErrorHandler:   a.proxyError,
		ErrorLog:       slog.NewLogLogger(a.log.Handler(), slog.LevelDebug),
	}
}

// forwardedFields are the edge's X-Forwarded-* fields: the reverse proxy
// drops them from the outgoing request, and the agent passes on the
// edge's, which are the truth about the visitor.
var forwardedFields = []string{"X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"}

// rewrite addresses the request to the local service, with the Host
// --host-header asks for and the edge's X-Forwarded-* fields.
func (a *Agent) rewrite(pr *httputil.ProxyRequest) {
	pr.Out.URL.Scheme = a.local.Scheme
	pr.Out.URL.Host = a.local.Host
	pr.Out.Host = pr.In.Host
	if a.hostHeader != "" {
		pr.Out.Host = a.hostHeader
	}
	for _, k := range forwardedFields {
		if v := pr.In.Header[k]; len(v) > 0 {
			pr.Out.Header[k] = v
		}
	}
	mux.PassTrailers(pr.Out, pr.In)
	a.headers.request(pr.Out.Header)
	if pr.Out.Body != nil && pr.Out.Body != http.NoBody {
		// The transport sends a request again on a new connection when
		// nothing of it was written (a pooled connection found closed, or
		// poisoned: watchedConn), if it can have the body again; unread,
		// the body is the same.
		pr.Out.GetBody = func() (io.ReadCloser, error) { return nil, errBodyGone }
	}
	if x := exchangeOf(pr.In.Context()); x != nil {
		// Count what the local service sends before its final response;
		// the proxy passes each on to the edge.
		pr.Out = pr.Out.WithContext(httptrace.WithClientTrace(pr.Out.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(int, textproto.MIMEHeader) error {
				if x.n1xx.Add(1) >= mux.Max1xx {
					return errTooMany1xx
				}
				return nil
			},
		}))
	}
}

var errTooMany1xx = errors.New("agent: too many informational responses from the local service")

// errBodyGone: a request whose body was partly sent cannot be sent again.
var errBodyGone = errors.New("agent: the request body was partly sent; it cannot be sent again")

// errBadStatus: the local service's status line names no HTTP status.
var errBadStatus = errors.New("agent: the local service's status code is not one of HTTP's")

// modifyResponse refuses a status net/http reads (any three digits) but no
// response can carry on, and applies the response header rules.
func (a *Agent) modifyResponse(resp *http.Response) error {
	if resp.StatusCode < 100 || resp.StatusCode > 599 {
		return fmt.Errorf("%w: %d", errBadStatus, resp.StatusCode)
	}
	a.headers.response(resp.Header)
	return nil
}

// proxyError answers a request the local service did not: with the code
// that says why, and a warning (rate-limited) with the likely fix.
func (a *Agent) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		// The edge gave the exchange up (the visitor left, a timeout):
		// nobody reads this answer.
		w.WriteHeader(http.StatusBadGateway)
		return
	}
	code := upstreamCode(err)
	a.localFailed(code, err)
	a.answer(w, r, code)
}

// upstreamCode maps a failed request to the local service to a visitor
// error code: no connection, no response in time, or a response net/http
// could not read (malformed, or a head over the limit).
func upstreamCode(err error) string {
	var ne net.Error
	switch {
	case isConnectError(err):
		return mux.CodeUpstreamUnreachable
	case errors.As(err, &ne) && ne.Timeout():
		return mux.CodeUpstreamTimeout
	case closedByPeer(err):
		return mux.CodeUpstreamUnreachable
	}
	return mux.CodeBadResponse
}

// isConnectError reports an error of making the connection: the dial, or
// an https:// local service's TLS handshake.
func isConnectError(err error) bool {
	var op *net.OpError
	var cert *tls.CertificateVerificationError
	var rec tls.RecordHeaderError
	var alert tls.AlertError
	return errors.As(err, &op) && op.Op == "dial" || errors.As(err, &cert) ||
		errors.As(err, &rec) || errors.As(err, &alert)
}

func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// upstreamTransport sends the proxy's requests to the local service through
// the agent's current transport, recording them for the inspector.
type upstreamTransport struct{ a *Agent }

func (t upstreamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	x := exchangeOf(req.Context())
	if x != nil && x.cap != nil {
		x.cap.request(req)
	}
	resp, err := t.roundTrip(req)
	for try := 0; try < 3 && errors.Is(err, errStrayBytes) && (req.Body == nil || req.Body == http.NoBody); try++ {
		// Again, on another connection: the one that answered is gone.
		resp, err = t.roundTrip(req)
	}
	if err == nil && x != nil && x.cap != nil {
		x.cap.response(resp)
	}
	return resp, err
}

// roundTrip sends req once, refusing a response that was there before the
// request: bytes another exchange's response left behind (cleanCheck).
func (t upstreamTransport) roundTrip(req *http.Request) (*http.Response, error) {
	if t.a.cfg.UpstreamProtocol == ProtocolHTTP2 {
		// Every HTTP/2 stream is its own: no bytes can be left behind.
		return t.a.transport().RoundTrip(req)
	}
	checked, tainted := cleanCheck(req)
	resp, err := t.a.transport().RoundTrip(checked)
	if err == nil && tainted() {
		resp.Body.Close()
		return nil, errStrayBytes
	}
	return resp, err
}

// transport is the current transport to the local service.
func (a *Agent) transport() *http.Transport { return a.upstream.Load() }

// useResponseHeadLimit holds local services to limit, the edge's bound on a
// response head (mux.MaxResponseHead at most): the agent never passes on
// what the edge would refuse. A new limit takes a new transport; the old
// one's idle connections are closed.
func (a *Agent) useResponseHeadLimit(limit int64) {
	if limit <= 0 || limit > mux.MaxResponseHead {
		limit = mux.MaxResponseHead
	}
	a.upstreamMu.Lock()
	defer a.upstreamMu.Unlock()
	if old := a.upstream.Load(); old != nil && old.MaxResponseHeaderBytes == limit {
		return
	}
	old := a.upstream.Swap(a.newTransport(limit))
	if old != nil {
		old.CloseIdleConnections()
	}
}

// newTransport returns the transport to the local service: plain TCP for
// http://, TLS (HTTP/1.1) for https://, the local certificate verified
// against the system's roots, the roots of --upstream-ca-file once Run has
// read it (loadUpstreamCA), or not at all with --upstream-insecure.
func (a *Agent) newTransport(maxHead int64) *http.Transport {
	dialer := &net.Dialer{Timeout: a.cfg.UpstreamDialTimeout, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		DialContext:            a.dialWatched(dialer),
		TLSClientConfig:        a.upstreamTLS,
		TLSHandshakeTimeout:    a.cfg.UpstreamDialTimeout,
		MaxIdleConns:           maxIdleLocal,
		MaxIdleConnsPerHost:    maxIdleLocal,
		IdleConnTimeout:        90 * time.Second,
		ResponseHeaderTimeout:  a.cfg.UpstreamTimeout,
		MaxResponseHeaderBytes: maxHead,
		DisableCompression:     true, // the visitor's Accept-Encoding goes as it came
	}
	tr.Protocols = new(http.Protocols)
	if a.cfg.UpstreamProtocol == ProtocolHTTP2 {
		// HTTP/2 only: prior knowledge without TLS (h2c), ALPN with it.
		tr.Protocols.SetUnencryptedHTTP2(a.local.Scheme == "http")
		tr.Protocols.SetHTTP2(a.local.Scheme == "https")
		return tr
	}
	tr.Protocols.SetHTTP1(true)
	return tr
}

// maxIdleLocal bounds the idle keep-alive connections to the local service.
const maxIdleLocal = 256

// logRequest logs the exchange x: method, path, status, the agent's own
// code when it answered, and the duration.
func (a *Agent) logRequest(x *exchange, r *http.Request) {
	status := x.status.Load()
	args := []any{"method", r.Method, "path", r.URL.RequestURI(), "status", status}
	switch code := x.errCode(); {
	case code != "":
		args = append(args, "code", code)
	case x.cut:
		args = append(args, "note", "the local service's response was cut short; the visitor got it broken off")
	case status == 0:
		args = append(args, "note", "the exchange ended before a response (the visitor left, or the tunnel broke)")
	}
	a.log.Info("request", append(args, "duration", time.Since(x.start).Round(10*time.Microsecond))...)
}
