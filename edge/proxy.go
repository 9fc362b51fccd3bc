package edge

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"slices"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/ngstone/ngstone/mux"
)

// Every visitor request takes one path through the edge: the visitor
// handler refuses what may not cross (checkVisitor), then
// httputil.ReverseProxy relays the request, rewritten by one rule
// (rewriteOutbound), to a new stream of the owning session, or to the edge
// that holds it; the owner of a forwarded request relays it the same way,
// keeping what the first edge vouched for. What crosses, in both
// directions, is what net/http's reverse proxy lets through.

// route is what the visitor handler resolved for one request; the
// transport's dialer opens its stream on exactly this session.
type route struct {
	s          *session
	node       string // the owning edge, when s is nil (cluster mode)
	hostname   string
	generation uint64
	// relay: a TCP or TLS passthrough connection, whose idle bound is
	// the first edge's (TCPIdleTimeout), not ReadTimeout.
	relay bool
	// forwarded: a request another edge of the cluster forwarded.
	forwarded bool
	// pool: s is a member of the name's pool, picked for this request.
	pool bool
}

type routeKey struct{}

// errNoRoute means the request's session could not take a new stream
// (fenced, closed or draining) before anything was sent.
var errNoRoute = errors.New("edge: session cannot take new streams")

// errIPDenied: the visitor's address is not one the tunnel lets in, found
// out after routing (a cluster's stale-route retry).
var errIPDenied = errors.New("edge: the tunnel does not let this visitor's address in")

// errTooManyStreams means the session is at MaxStreamsPerSession.
var errTooManyStreams = errors.New("edge: session at its concurrent request limit")

// visitorHandler routes visitor requests by Host.
func (e *Edge) visitorHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, code := e.checkVisitor(r)
		if code != "" {
			mux.WriteVisitorErrorFor(w, r, code, host)
			return
		}
		if e.oauth != nil && host == oauthHost+"."+e.cfg.Domain {
			e.oauthCallback(w, r)
			return
		}
		if max := e.cfg.MaxRequestBody; max > 0 {
			if r.ContentLength > max {
				mux.WriteVisitorErrorFor(w, r, mux.CodeBodyTooLarge, host)
				return
			}
			r.Body = http.MaxBytesReader(w, r.Body, max)
		}
		b, ok, err := e.lookup(r.Context(), host)
		if err != nil {
			mux.WriteVisitorError(w, mux.CodeTunnelOffline, host)
			return
		}
		if !ok || b.Proto == mux.ProtoTLS { // a passthrough's name has no HTTP
			mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelNotFound, host)
			return
		}
		pool := b.Pool
		var why string
		if b, why, ok = e.pick(b, nil); !ok {
			mux.WriteVisitorErrorWhy(w, r, mux.CodeTunnelOffline, host, why)
			return
		}
		rt := route{node: b.Node, hostname: host, generation: b.Generation, pool: pool}
		if e.local(b) {
			rt.s = e.session(b.SessionID)
			if rt.s == nil || !rt.s.live(time.Now()) {
				mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelOffline, host)
				return
			}
			if ip, ok := visitorIP(r, false); !ok || !rt.s.allows(host, ip) {
				e.metrics.limited(limitIPDenied)
				mux.WriteVisitorErrorFor(w, r, mux.CodeIPDenied, host)
				return
			}
		}
		release, ok := e.slots.acquire(host, limiterKey(r.RemoteAddr), e.cfg.MaxRequestsPerIP)
		if !ok {
			e.metrics.limited(limitVisitorRequests)
			mux.WriteVisitorErrorFor(w, r, mux.CodeVisitorLimit, host)
			return
		}
		defer release()
		e.serveRoute(w, r, rt, e.proxy)
	})
}

// checkVisitor applies the edge's rules for what a visitor may send, before
// anything is looked up: the Host must be a name under the domain (over
// HTTPS, the one the connection was made for), and the request an origin
// request of visible characters, its method a token. Whether a tunnel is
// bound to the host (a name under the domain, or a hostname of an agent's
// own) the registry says next. It returns the normalized host, and a visitor error code when
// the request is refused.
func (e *Edge) checkVisitor(r *http.Request) (string, string) {
	host, err := NormalizeHost(r.Host)
	switch {
	case err != nil:
		return r.Host, mux.CodeBadHost
	case r.Method == http.MethodConnect:
		// The tunnel serves origin requests; a CONNECT asks the edge to
		// be a forward proxy.
		return host, mux.CodeMethodNotAllowed
	case !visibleASCII(r.RequestURI):
		return host, mux.CodeBadRequest
	case !httpguts.ValidHeaderFieldName(r.Method):
		// A method that is not a token (RFC 9110, 9.1): net/http's
		// HTTP/2 server lets any :method through, and written on an
		// HTTP/1.1 request line one with a space reads as another
		// request line at the agent.
		return host, mux.CodeBadRequest
	case r.ProtoMajor == 2 && !allEqualFold(r.Header["Host"], r.Host):
		// An HTTP/2 host field naming another host than :authority
		// (RFC 9113, 8.3.1): net/http routes by :authority and never
		// writes the field on, but the request is malformed.
		return host, mux.CodeBadRequest
	}
	if r.TLS != nil && !strings.EqualFold(strings.TrimSuffix(r.TLS.ServerName, "."), host) {
		// A connection made for one tunnel (or for none: no SNI) must not
		// carry requests for another: HTTP/2 connection reuse, or a
		// forged Host.
		return host, mux.CodeMisdirected
	}
	return host, ""
}

// allEqualFold reports whether every value is s, in any case.
func allEqualFold(values []string, s string) bool {
	for _, v := range values {
		if !strings.EqualFold(v, s) {
			return false
		}
	}
	return true
}

// visibleASCII reports whether a request target holds only the characters
// RFC 9112 allows in one (an HTTP/2 :path is not checked for them).
func visibleASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return s != ""
}

// serveRoute sends r along rt through proxy: to a stream of a session of
// this edge, or to the edge that holds the tunnel.
func (e *Edge) serveRoute(w http.ResponseWriter, r *http.Request, rt route, proxy http.Handler) {
	// Let bodies stream both ways at once, as the local service may
	// answer while the visitor is still uploading.
	http.NewResponseController(w).EnableFullDuplex()
	vw, r, done := e.visitorTimeouts(w, r, !rt.relay)
	defer done()
	if rt.s != nil && !rt.relay {
		webhook, rule := rt.s.checks(rt.hostname)
		if rule != nil {
			if r = e.signedIn(vw, r, rt, rule); r == nil {
				vw.start() // a bodiless answer (HEAD's redirect): its status goes now
				return
			}
		}
		if webhook != nil && !e.verifyWebhook(vw, r, rt, webhook) {
			vw.start() // a bodiless refusal (gRPC's): its status goes now
			return
		}
	}
	defer func() {
		p := recover()
		switch {
		case p == nil:
			vw.start() // a response without a body: its status goes now
		case p == http.ErrAbortHandler && vw.unstarted():
			// The response broke off (the session died, the stream
			// ended) after its head crossed the tunnel but before any
			// of it reached the visitor, who can still be told why.
			e.visitorFailed(vw, r, rt.hostname, rt.brokenOff())
			vw.start()
		default:
			panic(p)
		}
	}()
	ctx := context.WithValue(r.Context(), routeKey{}, rt)
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{Got1xxResponse: vw.got1xx})
	proxy.ServeHTTP(vw, r.WithContext(ctx))
}

// errBrokenOff: a response broke off before any of it was passed on.
var errBrokenOff = errors.New("edge: the response broke off before its body")

// brokenOff says why a response broke off before its body: the session's
// end (or the owning edge's, for a forwarded request), or, the session
// alive, its agent ending the stream: a broken response, as a stream that
// ends before its head is (exchange.readError).
func (rt route) brokenOff() error {
	if s := rt.s; s != nil && !s.isClosed() && !s.ys.IsClosed() {
		return errors.Join(errBadResponse, errBrokenOff)
	}
	return errBrokenOff
}

// newProxy builds the reverse proxy every visitor request takes. forwarded:
// the owner's proxy for requests another edge forwarded, whose X-Forwarded-*
// it keeps (the first edge set them; the link is mutual TLS).
func (e *Edge) newProxy(forwarded bool) http.Handler {
	return &httputil.ReverseProxy{
		Rewrite:        func(pr *httputil.ProxyRequest) { rewriteOutbound(pr, forwarded) },
		ModifyResponse: func(resp *http.Response) error { return modifyResponse(resp, forwarded) },
		Transport:      &routeTransport{e: e, local: &streamTransport{e: e}},
		BufferPool:     mux.BufferPool{},
		ErrorHandler:   e.proxyError,
		ErrorLog:       slog.NewLogLogger(e.log.Handler(), slog.LevelDebug),
	}
}

// forwardedKept are the fields the first edge set, having removed any a
// visitor sent, that the owner passes on.
var forwardedKept = slices.Concat(mux.XForwarded, []string{mux.HeaderTCPSource, mux.HeaderTCPDestination})

// rewriteOutbound is the rule for what crosses the edge towards an agent,
// on every path. The reverse proxy has already dropped the hop-by-hop
// fields (RFC 9110, 7.6.1), those the Connection field names, and
// Forwarded and X-Forwarded-For, -Host and -Proto. The edge also drops any
// other field that claims where the request came from (mux.ForwardingField:
// X-Real-Ip, X-Forwarded-*, Ngstone-*, and their '_' spellings), sets
// X-Forwarded-For, -Host and -Proto from the connection it served (or, for
// a forwarded request, keeps those of the edge that did), keeps the
// visitor's Host (the request line's target for an absolute-form request,
// :authority over HTTP/2; a second Host field is never written), and passes
// on only declared trailers (mux.PassTrailers).
func rewriteOutbound(pr *httputil.ProxyRequest, forwarded bool) {
	out, in := pr.Out, pr.In
	for k := range out.Header {
		if mux.ForwardingField(k) {
			delete(out.Header, k)
		}
	}
	if forwarded {
		for _, k := range forwardedKept {
			if v := in.Header[k]; len(v) > 0 {
				out.Header[k] = v
			}
		}
	} else {
		pr.SetXForwarded()
	}
	// The edge's own server answers Expect: 100-continue when the body
	// is read; the field does not cross (nor does the cluster's own).
	out.Header.Del("Expect")
	if id, _ := in.Context().Value(identityKey{}).(*identity); id != nil {
		// Who signed in at the edge (the visitor's own were dropped).
		out.Header.Set(HeaderAuthSubject, id.Subject)
		if id.Email != "" {
			out.Header.Set(HeaderAuthEmail, id.Email)
		}
	}
	out.URL.Scheme, out.URL.Host = "http", "ngstone"
	out.Host = in.Host
	if rt, _ := in.Context().Value(routeKey{}).(route); rt.relay {
		out.Close = true // a stream carries one relayed connection (relayConn)
	}
	mux.PassTrailers(out, in)
}

// modifyResponse applies the rule for what crosses back to the visitor:
// the reverse proxy drops the hop-by-hop fields; the edge drops the
// cluster's own routing field (an agent's response must not pose as an
// owner's refusal) and trailers that may not be trailers. A pool's Unsent
// goes back to the edge that forwarded the request, which may pick another
// member, and no further. A response without a Content-Type is passed on
// without one (visitorWriter.start).
func modifyResponse(resp *http.Response, forwarded bool) error {
	resp.Header.Del(routeHeader)
	if !forwarded {
		resp.Header.Del(mux.UnsentHeader)
	}
	mux.FilterTrailers(resp)
	return nil
}

// proxyError maps a failed exchange of the reverse proxy to the visitor
// error codes.
func (e *Edge) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	rt, _ := r.Context().Value(routeKey{}).(route)
	e.visitorFailed(w, r, rt.hostname, err)
}

// visitorFailed answers a visitor whose exchange failed with the error code
// that says why. It is the one place errors meet codes.
func (e *Edge) visitorFailed(w http.ResponseWriter, r *http.Request, hostname string, err error) {
	var ne net.Error
	switch {
	case r.Context().Err() != nil:
		// The visitor left; nobody reads this answer.
		w.WriteHeader(http.StatusBadGateway)
		return
	case errors.Is(err, errNotBound):
		mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelNotFound, hostname)
	case errors.Is(err, errNoRoute), errors.Is(err, errRegistry):
		mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelOffline, hostname)
	case errors.Is(err, errIPDenied):
		mux.WriteVisitorErrorFor(w, r, mux.CodeIPDenied, hostname)
	case errors.Is(err, errTooManyStreams):
		e.metrics.limited(limitSessionStreams)
		mux.WriteVisitorErrorFor(w, r, mux.CodeTooManyRequests, hostname)
	case errors.As(err, new(*http.MaxBytesError)):
		mux.WriteVisitorErrorFor(w, r, mux.CodeBodyTooLarge, hostname)
	case errors.Is(err, errHeadTooLarge):
		e.metrics.limited(limitResponseHead)
		mux.WriteVisitorErrorFor(w, r, mux.CodeBadResponse, hostname)
	case errors.Is(err, errBadResponse):
		mux.WriteVisitorErrorFor(w, r, mux.CodeBadResponse, hostname)
	case errors.As(err, &ne) && ne.Timeout():
		mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelTimeout, hostname)
	case errors.Is(err, errVisitorRead):
		// The visitor's upload stalled or was malformed: what is left of
		// it on the connection is not a request.
		w.Header().Set("Connection", "close")
		mux.WriteVisitorErrorFor(w, r, mux.CodeBadRequest, hostname)
	default:
		mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelInterrupted, hostname)
	}
	e.log.Debug("visitor request failed", "hostname", hostname, "err", err)
}
