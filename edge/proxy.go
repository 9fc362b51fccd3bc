package edge

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httputil"
	"strings"
	"sync"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// route is what the visitor handler resolved for one request; the
// transport's dialer opens its stream on exactly this session.
type route struct {
	s          *session
	node       string // the owning edge, when s is nil (cluster mode)
	hostname   string
	generation uint64
}

type routeKey struct{}

// errNoRoute means the request's session could not take a new stream
// (fenced, closed or draining) before anything was sent.
var errNoRoute = errors.New("edge: session cannot take new streams")

// errTooManyStreams means the session is at MaxStreamsPerSession.
var errTooManyStreams = errors.New("edge: session at its concurrent request limit")

// visitorHandler routes visitor requests by Host.
func (e *Edge) visitorHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, err := NormalizeHost(r.Host)
		if err != nil {
			mux.WriteVisitorError(w, mux.CodeBadHost, r.Host)
			return
		}
		if _, ok := subdomainOf(host, e.cfg.Domain); !ok {
			mux.WriteVisitorError(w, mux.CodeTunnelNotFound, host)
			return
		}
		if r.TLS != nil && r.TLS.ServerName != "" && !strings.EqualFold(strings.TrimSuffix(r.TLS.ServerName, "."), host) {
			// A connection made for one tunnel must not carry requests
			// for another (HTTP/2 connection reuse, or a forged Host).
			mux.WriteVisitorError(w, mux.CodeMisdirected, host)
			return
		}
		if max := e.cfg.MaxRequestBody; max > 0 {
			if r.ContentLength > max {
				mux.WriteVisitorError(w, mux.CodeBodyTooLarge, host)
				return
			}
			r.Body = http.MaxBytesReader(w, r.Body, max)
		}
		b, ok, err := e.lookup(r.Context(), host)
		if err != nil {
			mux.WriteVisitorError(w, mux.CodeTunnelOffline, host)
			return
		}
		if !ok {
			mux.WriteVisitorError(w, mux.CodeTunnelNotFound, host)
			return
		}
		rt := route{node: b.Node, hostname: host, generation: b.Generation}
		if e.local(b) {
			rt.s = e.session(b.SessionID)
			if rt.s == nil || !rt.s.live(time.Now()) {
				mux.WriteVisitorError(w, mux.CodeTunnelOffline, host)
				return
			}
		}
		e.serveRoute(w, r, rt, false, e.proxy)
	})
}

// serveRoute sends r along rt: straight to the stream of a session of this
// edge, or through proxy (an upgrade, or a tunnel another edge holds).
// forwarded: r came from another edge, whose X-Forwarded-* it keeps.
func (e *Edge) serveRoute(w http.ResponseWriter, r *http.Request, rt route, forwarded bool, proxy http.Handler) {
	// Let bodies stream both ways at once, as the local service may
	// answer while the visitor is still uploading.
	http.NewResponseController(w).EnableFullDuplex()
	if rt.s != nil && !namedIn(r.Header["Connection"], "upgrade") {
		e.serveDirect(w, r, rt, forwarded)
		return
	}
	proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), routeKey{}, rt)))
}

// newProxy builds the reverse proxy for what the direct path (serveDirect)
// does not take: upgrades, and requests whose tunnel another edge holds.
func (e *Edge) newProxy() http.Handler {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetXForwarded()
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = "ngstone"
			pr.Out.Host = pr.In.Host
		},
		Transport:    &routeTransport{e: e, local: &streamTransport{e: e}},
		BufferPool:   mux.BufferPool{},
		ErrorHandler: e.proxyError,
	}
}

// dialStream opens a new yamux stream on the request's session.
func (e *Edge) dialStream(ctx context.Context, _, _ string) (net.Conn, error) {
	rt, ok := ctx.Value(routeKey{}).(route)
	if !ok {
		return nil, errNoRoute
	}
	return e.openStream(rt)
}

// proxyError maps a failed exchange of the reverse proxy to the visitor
// error codes.
func (e *Edge) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	rt, _ := r.Context().Value(routeKey{}).(route)
	e.visitorFailed(w, r, rt.hostname, err)
}

// visitorFailed answers a visitor whose exchange failed with the error code
// that says why.
func (e *Edge) visitorFailed(w http.ResponseWriter, r *http.Request, hostname string, err error) {
	var ne net.Error
	switch {
	case r.Context().Err() != nil:
		// The visitor left; nobody reads this answer.
		w.WriteHeader(http.StatusBadGateway)
		return
	case errors.Is(err, errNotBound):
		mux.WriteVisitorError(w, mux.CodeTunnelNotFound, hostname)
	case errors.Is(err, errNoRoute), errors.Is(err, errRegistry):
		mux.WriteVisitorError(w, mux.CodeTunnelOffline, hostname)
	case errors.Is(err, errTooManyStreams):
		mux.WriteVisitorError(w, mux.CodeTooManyRequests, hostname)
	case errors.As(err, new(*http.MaxBytesError)):
		mux.WriteVisitorError(w, mux.CodeBodyTooLarge, hostname)
	case errors.As(err, &ne) && ne.Timeout():
		mux.WriteVisitorError(w, mux.CodeTunnelTimeout, hostname)
	default:
		mux.WriteVisitorError(w, mux.CodeTunnelInterrupted, hostname)
	}
	e.log.Debug("visitor request failed", "hostname", hostname, "err", err)
}

// trackedConn reports its close to the session's in-flight tracker once.
type trackedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}
