package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/ngstone/ngstone/mux"
)

// A TCP tunnel's visitor connection reaches the agent as one exchange: its
// request body is what the visitor sends, and the response body, chunked
// and flushed at each write, what the local service sends. The end of the
// request body is the visitor's half-close, passed on to the local
// service; the local service's close (or half-close) ends the response,
// and with it the exchange. The edge closes the stream after it.

// relayTCP relays one visitor connection of t's to its local service.
func (a *Agent) relayTCP(w http.ResponseWriter, r *http.Request, t *tunnel) {
	start := time.Now()
	a.stats.opened(start)
	req := Request{Start: start, Method: "TCP", Path: r.Header.Get("X-Forwarded-For"), Tunnel: a.shownName(t)}
	defer func() {
		req.Duration = time.Since(start)
		a.stats.closed(req)
	}()
	rc := http.NewResponseController(w)
	rc.EnableFullDuplex()
	d := net.Dialer{Timeout: t.cfg.UpstreamDialTimeout}
	c, err := d.DialContext(r.Context(), "tcp", t.local.Host)
	if err != nil {
		req.Status, req.Code = http.StatusBadGateway, mux.CodeUpstreamUnreachable
		t.localFailed(mux.CodeUpstreamUnreachable, err, false)
		mux.WriteVisitorErrorFor(w, r, mux.CodeUpstreamUnreachable, t.local.Host)
		return
	}
	local := &stallConn{Conn: c, timeout: t.cfg.UpstreamTimeout}
	defer local.Close()
	// The stream's end (the edge gave up on the visitor, the session
	// ended) ends the connection to the local service, which may be
	// silent.
	defer context.AfterFunc(r.Context(), func() { local.Close() })()
	if t.cfg.ProxyProtocol {
		if _, err := proxyHeader(r).WriteTo(local); err != nil {
			req.Status, req.Code = http.StatusBadGateway, mux.CodeUpstreamUnreachable
			mux.WriteVisitorErrorFor(w, r, mux.CodeUpstreamUnreachable, t.local.Host)
			return
		}
	}
	req.Status = http.StatusOK
	w.WriteHeader(http.StatusOK)
	if rc.Flush() != nil {
		return
	}
	up := make(chan struct{})
	go func() {
		defer close(up)
		if _, err := io.Copy(local, r.Body); err != nil {
			local.Close() // the visitor or the edge went away: so does the local side
			return
		}
		closeWrite(c)
	}()
	_, err = io.Copy(flushWriter{w, rc}, local)
	// The local service is done (or failed): the exchange ends now, and
	// what the visitor may still send has nowhere to go.
	select {
	case <-up:
	default:
		endUpload(rc, local, up)
	}
	if a.cfg.LogRequests {
		t.log.Info("tcp connection", "from", req.Path, "duration", time.Since(start).Round(time.Millisecond), slog.Any("err", ignoreEOF(err)))
	}
}

// endUpload cuts the upload of a visitor whose local service closed while
// it still sends: the exchange is over (the edge asked for the stream to
// close after it).
func endUpload(rc *http.ResponseController, local net.Conn, up <-chan struct{}) {
	rc.SetReadDeadline(time.Now())
	local.Close()
	<-up
}

// proxyHeader is the PROXY protocol v2 header of r's visitor: its address
// and the edge's it connected to, as the edge gives them; LOCAL (no
// addresses) when the edge gave none it could read.
func proxyHeader(r *http.Request) *proxyproto.Header {
	src, err1 := netip.ParseAddrPort(r.Header.Get(mux.HeaderTCPSource))
	dst, err2 := netip.ParseAddrPort(r.Header.Get(mux.HeaderTCPDestination))
	if err1 != nil || err2 != nil {
		return &proxyproto.Header{Version: 2, Command: proxyproto.LOCAL}
	}
	return proxyproto.HeaderProxyFromAddrs(2, net.TCPAddrFromAddrPort(src), net.TCPAddrFromAddrPort(dst))
}

func ignoreEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// closeWrite half-closes c, or closes it when it cannot.
func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
		return
	}
	c.Close()
}

// stallConn gives each write to the local service its timeout afresh: a
// local service that takes none of the visitor's bytes for that long ends
// the connection. A slow reader is not cut, only a stalled one.
type stallConn struct {
	net.Conn
	timeout time.Duration
}

func (c *stallConn) Write(p []byte) (int, error) {
	c.Conn.SetWriteDeadline(time.Now().Add(c.timeout))
	return c.Conn.Write(p)
}

// flushWriter sends each write to the edge at once.
type flushWriter struct {
	w  io.Writer
	rc *http.ResponseController
}

func (f flushWriter) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	if err == nil {
		err = f.rc.Flush()
	}
	return n, err
}
