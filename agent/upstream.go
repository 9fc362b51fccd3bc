package agent

import (
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// newUpstream builds the proxy from the edge's streams to the local service.
// Connections to the local service are kept alive and pooled: a request
// costs a new stream, never a new local TCP connection.
func (a *Agent) newUpstream() (idleCloser, http.Handler) {
	t := a.newTransport()
	local := a.local
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(local)
			// The edge set X-Forwarded-* from what it saw; keep them.
			// Rewrite has removed them from Out, so copy them back.
			for _, h := range []string{"X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"} {
				if v, ok := pr.In.Header[h]; ok {
					pr.Out.Header[h] = v
				}
			}
			// Pass the visitor's Host through, as ngrok does.
			pr.Out.Host = pr.In.Host
		},
		Transport:    t,
		BufferPool:   mux.BufferPool{},
		ErrorHandler: a.upstreamError,
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Bodies stream both ways at once, as they do at the edge.
		http.NewResponseController(w).EnableFullDuplex()
		rp.ServeHTTP(w, r)
	})
	return t, h
}

type idleCloser interface {
	http.RoundTripper
	CloseIdleConnections()
}

// newTransport returns the transport to the local service: localTransport
// for plain HTTP, http.Transport for HTTPS.
func (a *Agent) newTransport() idleCloser {
	dialer := net.Dialer{Timeout: a.cfg.UpstreamDialTimeout, KeepAlive: 30 * time.Second}
	if a.local.Scheme == "http" {
		return &localTransport{
			addr:          hostPort(a.local),
			dialer:        dialer,
			headerTimeout: a.cfg.UpstreamTimeout,
			maxIdle:       256,
			idleTimeout:   90 * time.Second,
			probeIdle:     defaultProbeIdle,
		}
	}
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           dialer.DialContext,
		ResponseHeaderTimeout: a.cfg.UpstreamTimeout,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
		// Default 4 KiB buffers: every pooled connection keeps two, and
		// body copies larger than a buffer bypass it anyway.
	}
}

// hostPort is u's HOST:PORT, with the scheme's port if u names none.
func hostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	if u.Scheme == "https" {
		return net.JoinHostPort(u.Hostname(), "443")
	}
	return net.JoinHostPort(u.Hostname(), "80")
}

// upstreamError maps a failed exchange with the local service to the
// visitor error codes.
func (a *Agent) upstreamError(w http.ResponseWriter, r *http.Request, err error) {
	var ne net.Error
	var op *net.OpError
	code := mux.CodeUpstreamUnreachable
	switch {
	case r.Context().Err() != nil:
		w.WriteHeader(http.StatusBadGateway)
		return
	case errors.As(err, &op) && op.Op == "dial":
		code = mux.CodeUpstreamUnreachable
	case errors.As(err, &ne) && ne.Timeout():
		code = mux.CodeUpstreamTimeout
	}
	a.log.Debug("local service request failed", "code", code, "local", a.local.String(), "err", err)
	mux.WriteVisitorError(w, code, r.Host)
}

// newServer answers the edge's streams: one HTTP/1.1 exchange each.
func (a *Agent) newServer(c *conn) *http.Server {
	return &http.Server{
		Handler:           a.handler,
		ConnState:         c.connState,
		ReadHeaderTimeout: a.cfg.DialTimeout,
		ErrorLog:          slog.NewLogLogger(a.log.Handler(), slog.LevelDebug),
	}
}
