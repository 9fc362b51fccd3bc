package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/ngstone/ngstone/mux"
)

// A TCP tunnel's visitor connection reaches the agent as one exchange: its
// request body is what the visitor sends, and the response body, chunked
// and flushed at each write, what the local service sends. The end of the
// request body is the visitor's half-close, passed on to the local
// service; the local service's close (or half-close) ends the response,
// and with it the exchange. The edge closes the stream after it. The
// inspector lists the connection from its start, its bytes counted as
// they cross (connMeter), none of them kept.

// relayTCP relays one visitor connection of t's to its local service.
func (a *Agent) relayTCP(w http.ResponseWriter, r *http.Request, t *tunnel) {
	start := time.Now()
	a.stats.opened(start)
	req := Request{Start: start, Method: "TCP", Path: r.Header.Get("X-Forwarded-For"), Tunnel: a.shownName(t)}
	m := &connMeter{}
	if a.inspect != nil {
		a.inspect.addConn(t, r, start, m)
	}
	defer func() {
		req.Duration = time.Since(start)
		a.stats.closed(req)
		m.close(req.Duration)
	}()
	rc := http.NewResponseController(w)
	rc.EnableFullDuplex()
	d := net.Dialer{Timeout: t.cfg.UpstreamDialTimeout}
	c, err := d.DialContext(r.Context(), "tcp", t.local.Host)
	if err != nil {
		req.Status, req.Code = http.StatusBadGateway, mux.CodeUpstreamUnreachable
		m.ended(endLocalUnreachable)
		t.localFailed(mux.CodeUpstreamUnreachable, err, false)
		mux.WriteVisitorErrorFor(w, r, mux.CodeUpstreamUnreachable, t.local.Host)
		return
	}
	local := &stallConn{Conn: c, timeout: t.cfg.UpstreamTimeout, m: m}
	defer local.Close()
	// The stream's end (the edge gave up on the visitor, the session
	// ended) ends the connection to the local service, which may be
	// silent.
	defer context.AfterFunc(r.Context(), func() {
		m.ended(endVisitorClosed)
		local.Close()
	})()
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
		m.ended(endVisitorClosed)
		return
	}
	up := make(chan struct{})
	go func() {
		defer close(up)
		if _, err := io.Copy(local, visitorReader{r.Body, m}); err != nil {
			local.Close() // the visitor or the edge went away: so does the local side
			return
		}
		closeWrite(c)
	}()
	_, err = io.Copy(flushWriter{w, rc, m}, local)
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
// the connection. A slow reader is not cut, only a stalled one. The first
// read or write that fails is the local side's end, for m.
type stallConn struct {
	net.Conn
	timeout time.Duration
	m       *connMeter
}

func (c *stallConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.m.ended(endLocalClosed)
	}
	return n, err
}

func (c *stallConn) Write(p []byte) (int, error) {
	c.Conn.SetWriteDeadline(time.Now().Add(c.timeout))
	n, err := c.Conn.Write(p)
	if err != nil {
		c.m.ended(endLocalClosed)
	}
	return n, err
}

// visitorReader counts what the visitor sends; its end (a half-close, or
// the visitor gone) is the visitor's side's.
type visitorReader struct {
	r io.Reader
	m *connMeter
}

func (v visitorReader) Read(p []byte) (int, error) {
	n, err := v.r.Read(p)
	v.m.in.Add(int64(n))
	if err != nil {
		v.m.ended(endVisitorClosed)
	}
	return n, err
}

// flushWriter sends each write to the edge at once, and counts it; a
// failed one is the visitor's side's end.
type flushWriter struct {
	w  io.Writer
	rc *http.ResponseController
	m  *connMeter
}

func (f flushWriter) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	if err == nil {
		err = f.rc.Flush()
	}
	f.m.out.Add(int64(n))
	if err != nil {
		f.m.ended(endVisitorClosed)
	}
	return n, err
}

// How a relayed connection ended (Conn.End): the side that ended first.
const (
	endVisitorClosed    = "visitor_closed"    // the visitor closed or half-closed, or went away
	endLocalClosed      = "local_closed"      // the local service closed, reset or stalled
	endLocalUnreachable = "local_unreachable" // the agent could not connect to the local service
)

// connMeter counts a relayed connection's bytes as they cross, and says
// how it ended, for the inspector to read at any time.
type connMeter struct {
	in, out atomic.Int64 // bytes from and to the visitor
	info    Conn         // what is known at the start; set before it is listed

	mu     sync.Mutex
	end    string
	closed bool
	took   time.Duration // once closed
}

// ended records how the connection ends, unless a side ended before.
func (m *connMeter) ended(how string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.end == "" {
		m.end = how
	}
}

func (m *connMeter) close(took time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed, m.took = true, took
}

// conn is the connection as it stands, and how long it has lasted since
// start.
func (m *connMeter) conn(start time.Time) (Conn, time.Duration) {
	c := m.info
	m.mu.Lock()
	closed, took := m.closed, m.took
	c.End = m.end
	m.mu.Unlock()
	// Once closed, the counts read after it are the last.
	c.BytesIn, c.BytesOut = m.in.Load(), m.out.Load()
	if !closed {
		c.Open, c.End = true, ""
		took = time.Since(start)
	}
	return c, took
}
