package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// exchange is one request relayed by the agent, for its log line and the
// inspector, and the checks of its request to the local service.
type exchange struct {
	start  time.Time
	status atomic.Int64 // the final status sent to the edge; 0: none yet
	code   atomic.Value // string: the agent's own error code, when it answered itself
	n1xx   atomic.Int32 // informational responses passed on
	cut    bool         // the response was broken off
	grpc   string       // the grpc-status in the head sent back through exchangeWriter (the agent's own answers)
	cap    *capture     // what the inspector keeps; nil without one
	t      *tunnel      // the tunnel it came for; nil: none of the agent's
	check  cleanCheck   // of the connection to the local service (HTTP/1.1)
	trace  httptrace.ClientTrace
	body   *mux.CountedBody // the request's body, as the proxy reads it; nil: none
}

// withExchange returns ctx with x and the trace of x's request to the local
// service: it counts what the local service sends before its final
// response (the proxy passes each on to the edge), and over HTTP/1.1 makes
// the clean checks (cleanCheck).
func (a *Agent) withExchange(ctx context.Context, x *exchange) context.Context {
	x.trace.Got1xxResponse = x.got1xx
	x.trace.GotConn, x.trace.GotFirstResponseByte = x.gotConn, x.gotFirstByte
	return httptrace.WithClientTrace(context.WithValue(ctx, exchangeKey{}, x), &x.trace)
}

// http1 reports whether x's tunnel speaks HTTP/1.1 to its local service,
// where the clean checks apply: every HTTP/2 stream is its own, and no
// bytes can be left behind. The hooks run after serveExchange routed x.
func (x *exchange) http1() bool {
	return x.t != nil && x.t.cfg.UpstreamProtocol != ProtocolHTTP2
}

func (x *exchange) gotConn(info httptrace.GotConnInfo) {
	if x.http1() {
		x.check.gotConn(info)
	}
}

func (x *exchange) gotFirstByte() {
	if x.http1() {
		x.check.gotFirstByte()
	}
}

func (x *exchange) got1xx(code int, h textproto.MIMEHeader) error {
	if x.n1xx.Add(1) > mux.Max1xx {
		return errTooMany1xx
	}
	return nil // the reverse proxy passes it on
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

// serveExchange relays one request: basic auth first, then the reverse
// proxy. Its goroutine is counted in the agent's WaitGroup, so that an
// upgraded connection still copying keeps Run from returning.
func (a *Agent) serveExchange(w http.ResponseWriter, r *http.Request) {
	a.wg.Add(1) // while the stream's count is held: never from zero
	defer a.wg.Done()
	t := a.route(r.Host)
	if t != nil && t.cfg.relaysBytes() {
		a.relayTCP(w, r, t)
		return
	}
	body := r.Body
	sc := r.Context().Value(streamKey{}).(*streamConn)
	x := &exchange{}
	r = r.WithContext(a.withExchange(r.Context(), x))
	if body != http.NoBody {
		x.body = &mux.CountedBody{ReadCloser: body, Size: r.ContentLength}
		r.Body = x.body
	}
	a.begin(x, r, t)
	sent := sc.written.Load()
	defer func() {
		if p := recover(); p != nil {
			// The proxy broke the response off (the local service cut it
			// short). If none of it had left, the edge answers for it.
			if p == http.ErrAbortHandler && sc.written.Load() == sent {
				x.status.Store(http.StatusBadGateway)
				x.code.Store(mux.CodeBadResponse)
			}
			x.cut = true
			a.ended(x, r)
			panic(p)
		}
		a.ended(x, r)
		endBody(w, body, x)
	}()
	// The local service may answer while the request body still streams
	// (an early 413, a duplex stream): the server must not close the
	// body once the response has started.
	http.NewResponseController(w).EnableFullDuplex()
	rw := &exchangeWriter{ResponseWriter: w, x: x}
	switch {
	case t == nil:
		// A hostname this agent does not serve (any more): the edge
		// routes a stream only for a name the session holds.
		a.answer(rw, r, mux.CodeTunnelNotFound)
	case t.auth != nil && !t.auth.allows(r):
		a.answer(rw, r, mux.CodeBasicAuthRequired)
	default:
		t.proxy.ServeHTTP(rw, r)
	}
}

// endBody ends a request body the handler left unread, once its response
// is sent: what is left of it is read (up to net/http's bound) here, where
// the server with full duplex on would read it after the handler, then
// start reading the stream for the body's end while it waits for the next
// request, and panic (golang/go#68560). The response goes first: the edge
// may send the rest of the body only once its visitor has the answer. A
// body read to its end needs nothing, and its response is not flushed:
// one left whole in the buffer gets its Content-Length (a gRPC
// Trailers-Only answer must end with its head).
func endBody(w http.ResponseWriter, body io.ReadCloser, x *exchange) {
	if x.body == nil || x.body.EOF() || x.status.Load() == 0 {
		return
	}
	if err := http.NewResponseController(w).Flush(); err == nil {
		body.Close()
	}
}

// begin counts the exchange x of r, for tunnel t, as open.
func (a *Agent) begin(x *exchange, r *http.Request, t *tunnel) {
	x.start, x.t = time.Now(), t
	a.stats.opened(x.start)
	if a.inspect != nil {
		x.cap = &capture{}
	}
}

// ended counts, logs and keeps the exchange once it is over.
func (a *Agent) ended(x *exchange, r *http.Request) {
	path := r.URL.RequestURI() // once for all three
	req := Request{Start: x.start, Method: r.Method, Path: path,
		Status: int(x.status.Load()), Code: x.errCode(), Duration: time.Since(x.start)}
	req.Tunnel = a.shownName(x.t)
	a.stats.closed(req)
	if a.cfg.LogRequests {
		a.logRequest(x, r, path)
	}
	if a.inspect != nil {
		a.inspect.record(x, r, path)
	}
}

// shownName is t's name where requests are shown with their tunnel's: in
// an agent of several.
func (a *Agent) shownName(t *tunnel) string {
	if t == nil || len(a.tunnels) < 2 {
		return ""
	}
	return t.name
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

// exchangeWriter records the final status the exchange sent back, and its
// grpc-status. A final response without a Content-Type goes on without
// one (mux.KeepUntyped): the session's server would guess one from its
// body.
type exchangeWriter struct {
	http.ResponseWriter
	x *exchange
}

func (w *exchangeWriter) WriteHeader(code int) {
	if (code >= 200 || code == http.StatusSwitchingProtocols) && w.x.status.CompareAndSwap(0, int64(code)) {
		// What a gRPC client reads of an answer of the agent's own
		// (Trailers-Only): nothing of it goes to the local service, so
		// the inspector finds it nowhere else.
		w.x.grpc = w.Header().Get("Grpc-Status")
	}
	if code >= 200 {
		mux.KeepUntyped(w.Header())
		mux.CloseIfUnread(w.Header(), w.x.body) // the stream ends with it (endBody)
	}
	if code < 200 && code != http.StatusSwitchingProtocols && w.x.n1xx.Load() >= mux.Max1xx {
		// The reverse proxy passes an informational response on before
		// the exchange's hook counts it (got1xx), which then ends the
		// exchange: the one over the limit is not passed on.
		return
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

// newProxy returns the reverse proxy to the tunnel's local service.
func (t *tunnel) newProxy() *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite:        t.rewrite,
		ModifyResponse: t.modifyResponse,
		Transport:      upstreamTransport{t},
		BufferPool:     mux.BufferPool{},
		ErrorHandler:   t.proxyError,
		ErrorLog:       slog.NewLogLogger(t.log.Handler(), slog.LevelDebug),
	}
}

// rewrite addresses the request to the local service, with the Host
// --host-header asks for and the edge's X-Forwarded-* fields.
func (t *tunnel) rewrite(pr *httputil.ProxyRequest) {
	pr.Out.URL.Scheme = t.local.Scheme
	pr.Out.URL.Host = t.local.Host
	pr.Out.Host = pr.In.Host
	if t.hostHeader != "" {
		pr.Out.Host = t.hostHeader
	}
	for _, k := range mux.XForwarded {
		if v := pr.In.Header[k]; len(v) > 0 {
			pr.Out.Header[k] = v
		}
	}
	mux.PassTrailers(pr.Out, pr.In)
	t.headers.request(pr.Out)
	if pr.Out.Body != nil && pr.Out.Body != http.NoBody {
		// The transport sends a request again on a new connection when
		// nothing of it was written (a pooled connection found closed, or
		// poisoned: watchedConn), if it can have the body again; unread,
		// the body is the same.
		pr.Out.GetBody = func() (io.ReadCloser, error) { return nil, errBodyGone }
	}
}

var errTooMany1xx = errors.New("agent: too many informational responses from the local service")

// errBodyGone: a request whose body was partly sent cannot be sent again.
var errBodyGone = errors.New("agent: the request body was partly sent; it cannot be sent again")

// errBadStatus: the local service's status line names no HTTP status.
var errBadStatus = errors.New("agent: the local service's status code is not one of HTTP's")

// modifyResponse refuses a status net/http reads (any three digits) but no
// response can carry on, and applies the response header rules.
func (t *tunnel) modifyResponse(resp *http.Response) error {
	if resp.StatusCode < 100 || resp.StatusCode > 599 {
		return fmt.Errorf("%w: %d", errBadStatus, resp.StatusCode)
	}
	t.headers.response(resp)
	declareEmpty(resp)
	return nil
}

// declareEmpty gives a response known to be empty (an HTTP/2 local
// service's that ended with its head, gRPC's Trailers-Only answers among
// them) its Content-Length of 0, which HTTP/2 leaves implicit: flushed without one, it would go to
// the edge chunked, and on to an HTTP/2 visitor as a head and a separate
// end, which a gRPC client refuses as a stream that ended without its
// status.
func declareEmpty(resp *http.Response) {
	switch {
	case resp.ContentLength != 0, resp.Request.Method == http.MethodHead,
		resp.StatusCode < 200, resp.StatusCode == http.StatusNoContent, resp.StatusCode == http.StatusNotModified:
		return
	}
	if _, ok := resp.Header["Content-Length"]; !ok {
		resp.Header["Content-Length"] = []string{"0"}
	}
}

// proxyError answers a request the local service did not: with the code
// that says why, and a warning (rate-limited) with the likely fix.
func (t *tunnel) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		// The edge gave the exchange up (the visitor left, a timeout):
		// nobody reads this answer.
		w.WriteHeader(http.StatusBadGateway)
		return
	}
	t.answerFailed(w, r, exchangeOf(r.Context()), err)
}

// answerFailed answers r, the request of x that the local service did not
// answer (err), on either path.
func (t *tunnel) answerFailed(w http.ResponseWriter, r *http.Request, x *exchange, err error) {
	code := upstreamCode(err)
	http2 := x != nil && x.check.spokeHTTP2()
	if http2 {
		// The local service answered in HTTP/2, whatever ended the
		// request after it (a write to the connection it closed, or
		// reset): not a service that is unreachable.
		code = mux.CodeBadResponse
	}
	if code == mux.CodeBadResponse && x != nil && mux.IsGRPC(r) && deadlinePassed(r.Header, x.start) {
		// The local server ended the call at the deadline its client
		// set (grpc-go resets the stream as it fires): the answer is
		// the client's own, not a failure of the tunnel's. A local
		// server that could not be reached, or did not answer in the
		// agent's own time, keeps its code and warning.
		h := w.Header()
		h.Set("Content-Type", "application/grpc")
		h.Set("Grpc-Status", "4") // DEADLINE_EXCEEDED
		h.Set("Grpc-Message", "deadline exceeded")
		w.WriteHeader(http.StatusOK)
		return
	}
	t.localFailed(code, err, http2)
	if x != nil {
		x.code.Store(code)
	}
	if t.cfg.Pool && code == mux.CodeUpstreamUnreachable && isConnectError(err) {
		w.Header().Set(mux.UnsentHeader, "1") // the edge may try another member
	}
	mux.WriteVisitorErrorFor(w, r, code, visitorHost(r))
}

// deadlinePassed reports whether the call's grpc-timeout, counted from
// start (before the local server could start its own), is over: 1 to 8
// digits and a unit of H, M, S, m, u or n.
func deadlinePassed(h http.Header, start time.Time) bool {
	v := h.Get("Grpc-Timeout")
	if len(v) < 2 || len(v) > 9 {
		return false
	}
	unit, ok := grpcTimeoutUnits[v[len(v)-1]]
	n, err := strconv.ParseUint(v[:len(v)-1], 10, 64)
	if !ok || err != nil || n > uint64(math.MaxInt64/unit) {
		return false // 99999999H is longer than a Duration holds
	}
	return time.Since(start) >= time.Duration(n)*unit
}

var grpcTimeoutUnits = map[byte]time.Duration{'H': time.Hour, 'M': time.Minute, 'S': time.Second,
	'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond}

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
// the tunnel's current transport, recording them for the inspector.
type upstreamTransport struct{ t *tunnel }

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
	if err == nil && x != nil && resp.StatusCode == http.StatusSwitchingProtocols {
		if rwc, ok := resp.Body.(io.ReadWriteCloser); ok {
			resp.Body = &upgradedBody{ReadWriteCloser: rwc, x: x}
		}
	}
	return resp, err
}

// upgradedBody is a 101 response's body, the connection to the local
// service, left writable as the reverse proxy needs it. Its first read
// comes once the 101 went to the edge, which is when the exchange's status
// is set; what crosses it is counted for the inspector, not kept.
type upgradedBody struct {
	io.ReadWriteCloser
	x    *exchange
	once sync.Once
}

func (u *upgradedBody) Read(p []byte) (int, error) {
	u.once.Do(func() { u.x.status.CompareAndSwap(0, http.StatusSwitchingProtocols) })
	n, err := u.ReadWriteCloser.Read(p)
	if u.x.cap != nil {
		u.x.cap.resp.upgraded.Add(int64(n))
	}
	return n, err
}

// Write counts p before it writes it: the local service may answer, and
// the exchange end, before a count after the write would be made.
func (u *upgradedBody) Write(p []byte) (int, error) {
	if u.x.cap != nil {
		u.x.cap.req.upgraded.Add(int64(len(p)))
	}
	n, err := u.ReadWriteCloser.Write(p)
	if u.x.cap != nil && n < len(p) {
		u.x.cap.req.upgraded.Add(int64(n - len(p)))
	}
	return n, err
}

// roundTrip sends req once, refusing a response that was there before the
// request: bytes another exchange's response left behind (cleanCheck, in
// the trace of req's exchange).
func (t upstreamTransport) roundTrip(req *http.Request) (*http.Response, error) {
	x := exchangeOf(req.Context())
	if x == nil || !x.http1() {
		return t.t.transport().RoundTrip(req)
	}
	x.check.reset()
	resp, err := t.t.transport().RoundTrip(req)
	if err == nil && x.check.refused() {
		resp.Body.Close()
		return nil, errStrayBytes
	}
	return resp, err
}

// transport is the current transport to the local service.
func (t *tunnel) transport() *http.Transport { return t.upstream.Load() }

// useResponseHeadLimit holds local services to limit, the edge's bound on a
// response head (mux.MaxResponseHead at most): the agent never passes on
// what the edge would refuse.
func (a *Agent) useResponseHeadLimit(limit int64) {
	for _, t := range a.tunnels {
		t.useResponseHeadLimit(limit)
	}
}

// useResponseHeadLimit gives the tunnel a transport for limit, if its own
// has another; the old one's idle connections are closed.
func (t *tunnel) useResponseHeadLimit(limit int64) {
	if limit <= 0 || limit > mux.MaxResponseHead {
		limit = mux.MaxResponseHead
	}
	t.upstreamMu.Lock()
	defer t.upstreamMu.Unlock()
	if old := t.upstream.Load(); old != nil && old.MaxResponseHeaderBytes == limit {
		return
	}
	old := t.upstream.Swap(t.newTransport(limit))
	if old != nil {
		old.CloseIdleConnections()
	}
}

// newTransport returns the transport to the local service: plain TCP for
// http://, TLS (HTTP/1.1) for https://, the local certificate verified
// against the system's roots, the roots of --upstream-ca-file once Run has
// read it (loadUpstreamCA), or not at all with --upstream-insecure.
func (t *tunnel) newTransport(maxHead int64) *http.Transport {
	dialer := &net.Dialer{Timeout: t.cfg.UpstreamDialTimeout, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		DialContext:            t.dialWatched(dialer),
		TLSClientConfig:        t.upstreamTLS,
		TLSHandshakeTimeout:    t.cfg.UpstreamDialTimeout,
		MaxIdleConns:           maxIdleLocal,
		MaxIdleConnsPerHost:    maxIdleLocal,
		IdleConnTimeout:        90 * time.Second,
		ResponseHeaderTimeout:  t.cfg.UpstreamTimeout,
		MaxResponseHeaderBytes: maxHead,
		DisableCompression:     true, // the visitor's Accept-Encoding goes as it came
	}
	tr.Protocols = new(http.Protocols)
	if t.cfg.UpstreamProtocol == ProtocolHTTP2 {
		// HTTP/2 only: prior knowledge without TLS (h2c), ALPN with it.
		tr.Protocols.SetUnencryptedHTTP2(t.local.Scheme == "http")
		tr.Protocols.SetHTTP2(t.local.Scheme == "https")
		return tr
	}
	tr.Protocols.SetHTTP1(true)
	return tr
}

// maxIdleLocal bounds the idle keep-alive connections to the local service.
const maxIdleLocal = 256

// logRequest logs the exchange x: method, path, status, the agent's own
// code when it answered, and the duration.
func (a *Agent) logRequest(x *exchange, r *http.Request, path string) {
	status := x.status.Load()
	args := []any{"method", r.Method, "path", path, "status", status}
	if x.t != nil && len(a.tunnels) > 1 {
		args = append(args, "tunnel", x.t.name)
	}
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
