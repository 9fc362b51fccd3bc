package edge

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The visitor listeners. The edge shakes hands over TLS itself, before
// http.Server sees a connection, so that every response it makes up
// carries Ngstone-Error, Go's own included: net/http answers a request it
// cannot read (400, 431, 501) by writing straight to the connection, where
// only a wrapper of the plaintext connection can add the field. The server
// gets an HTTP/1.1 connection in that wrapper, and an HTTP/2 one (chosen by
// ALPN) as the *tls.Conn it is, which it serves with its own HTTP/2.

// connKey is the context key of a visitor request's TLS connection.
type connKey struct{}

// acceptLoop accepts connections from ln and hands each to serve until ln
// is closed. Other accept errors (too many open files, a connection reset
// before accept) are retried with a backoff from 5 ms to 1 s, as net/http
// does, and counted; the first of a run is logged.
func acceptLoop(ln net.Listener, log *slog.Logger, failed func(), serve func(net.Conn)) {
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err == nil {
			delay = 0
			serve(c)
			continue
		}
		if errors.Is(err, net.ErrClosed) {
			return
		}
		failed()
		if delay == 0 {
			log.Warn("accept failed; retrying", "addr", ln.Addr().String(), "err", err)
			delay = 5 * time.Millisecond
		} else {
			delay = min(2*delay, time.Second)
		}
		time.Sleep(delay)
	}
}

// visitorServer is one visitor listener.
type visitorServer struct {
	e   *Edge
	ctx context.Context // the edge's run, which TLS passthroughs relay within
	srv *http.Server
	tls *tls.Config // nil: plain HTTP

	served chan struct{}     // plain HTTP: closed when Serve has returned
	ln     net.Listener      // the listener, limits and PROXY protocol included
	queue  *drainingListener // the socket's own, under ln; nil: none
	conns  chan net.Conn
	done   chan struct{}
	wg     sync.WaitGroup // the TLS accept loop and its handshakes
	once   sync.Once

	// HTTP/1.1 connections accepted whose first request is not read yet,
	// for the drain (waitFirstRequests); zero is signalled on idle.
	mu    sync.Mutex
	fresh map[net.Conn]struct{}
	idle  chan struct{} // closed when fresh empties during the drain; nil otherwise
}

func (e *Edge) newVisitorServer(ln net.Listener, h http.Handler, tc *tls.Config) *visitorServer {
	v := &visitorServer{e: e, tls: tc, ln: ln, done: make(chan struct{}), conns: make(chan net.Conn), served: make(chan struct{}), fresh: map[net.Conn]struct{}{}}
	v.srv = &http.Server{
		Handler:                      h,
		ReadHeaderTimeout:            e.cfg.ReadHeaderTimeout,
		IdleTimeout:                  e.cfg.IdleTimeout,
		MaxHeaderBytes:               maxVisitorHeader,
		DisableGeneralOptionsHandler: true,
		ErrorLog:                     e.certs.ErrorLog(),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if tc, ok := c.(*taggedConn); ok && tc.tls != nil {
				return context.WithValue(ctx, connKey{}, tc.tls)
			}
			return ctx
		},
		ConnState: v.connState,
		Protocols: new(http.Protocols),
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:          maxVisitorStreams,
			MaxReceiveBufferPerConnection: 1 << 20,
			MaxReceiveBufferPerStream:     256 << 10,
			SendPingTimeout:               e.cfg.IdleTimeout,
			PingTimeout:                   15 * time.Second,
			WriteByteTimeout:              e.cfg.WriteTimeout,
		},
	}
	v.srv.Protocols.SetHTTP1(true)
	v.srv.Protocols.SetHTTP2(tc != nil)
	return v
}

// Limits of the visitor listeners.
const (
	// maxVisitorHeader bounds a visitor's request head (431 past it).
	maxVisitorHeader = 64 << 10
	// maxVisitorStreams bounds the concurrent requests of one HTTP/2
	// connection.
	maxVisitorStreams = 100
)

// serve runs the listener until close, the TLS terminator started by
// start.
func (v *visitorServer) serve() error {
	if v.tls == nil {
		defer close(v.served)
		return v.srv.Serve(taggingListener{Listener: v.ln, m: v.e.metrics})
	}
	return v.srv.Serve(&chanListener{v: v})
}

// start starts the TLS terminator's accept loop, before serve's goroutine:
// counted in v.wg before close can wait for it.
func (v *visitorServer) start() {
	if v.tls == nil {
		return
	}
	v.wg.Add(1)
	go func() {
		defer v.wg.Done()
		acceptLoop(v.ln, v.e.log, func() { v.e.metrics.acceptFailed("visitor") }, func(c net.Conn) {
			v.wg.Add(1)
			go func() {
				defer v.wg.Done()
				v.handshake(c)
			}()
		})
	}()
}

// handshake runs a TLS handshake within ReadHeaderTimeout and hands the
// connection to the server: an HTTP/2 one as is, an HTTP/1.1 one in the
// wrapper that tags net/http's own error responses.
func (v *visitorServer) handshake(raw net.Conn) {
	mux.Peek(raw) // until the ClientHello's name says whether to pass it through
	c := tls.Server(raw, v.tls)
	raw.SetDeadline(time.Now().Add(v.e.cfg.ReadHeaderTimeout))
	err := c.HandshakeContext(context.Background())
	var pass passthrough
	if errors.As(err, &pass) {
		raw.SetDeadline(time.Time{})
		mux.EndPeek(raw, true)
		v.e.metrics.tcpConns.WithLabelValues(v.e.relayConn(v.ctx, raw, string(pass))).Inc()
		raw.Close()
		return
	}
	mux.EndPeek(raw, false)
	if err != nil {
		var re tls.RecordHeaderError
		if errors.As(err, &re) && re.Conn != nil && looksLikeHTTP(re.RecordHeader[:]) {
			// As net/http does: a plaintext request on the HTTPS port.
			re.Conn.Write(plainOnTLSResponse)
		}
		v.e.log.Debug("visitor TLS handshake failed", "remote", raw.RemoteAddr().String(), "err", err)
		raw.Close()
		return
	}
	raw.SetDeadline(time.Time{})
	var conn net.Conn = c
	if c.ConnectionState().NegotiatedProtocol != "h2" {
		conn = &taggedConn{Conn: c, tls: c, m: v.e.metrics}
	}
	tc, _ := conn.(*taggedConn)
	if tc != nil {
		v.fresh1(tc, true) // before the server has it: the drain waits for it
	}
	select {
	case v.conns <- conn:
	case <-v.done:
		if tc != nil {
			v.fresh1(tc, false)
		}
		c.Close()
	}
}

// shutdown stops accepting, lets requests in flight finish until ctx ends
// (HTTP/2 connections get GOAWAY), then closes what is left.
//
// net/http's Shutdown drops a request it reads once shutting down: it
// closes the connection without an answer. A visitor whose connection the
// edge had accepted just before the signal would get nothing, although the
// request reached it. So the drain goes in steps: no new connections; the
// TCP handshakes under way complete (HandshakeSettle) and the TLS ones
// finish, and reach the server; keep-alives off
// (each answer carries Connection: close); every HTTP/1.1 connection
// accepted gets its first request read and answered, or ends (a silent one
// by ReadHeaderTimeout); only then Shutdown.
func (v *visitorServer) shutdown(ctx context.Context) error {
	if v.queue != nil {
		if !v.queue.drain(ctx, v.e.cfg.HandshakeSettle) && filtersSockets {
			v.e.log.Warn("graceful stop: this listener cannot hold off new visitor handshakes (its socket refused a filter); visitors connecting right now may be reset", "addr", v.ln.Addr().String())
		}
	}
	v.ln.Close()
	accepted := v.served // plain HTTP: Serve has taken every connection
	if v.tls != nil {
		handshook := make(chan struct{})
		go func() {
			v.wg.Wait() // the accept loop, then each handshake
			close(handshook)
		}()
		accepted = handshook
	}
	select {
	case <-accepted:
	case <-ctx.Done():
	}
	v.srv.SetKeepAlivesEnabled(false)
	v.waitFirstRequests(ctx)
	v.stopAccepting()
	err := v.srv.Shutdown(ctx)
	v.close()
	return err
}

// connState follows which HTTP/1.1 connections have not had their first
// request read. HTTP/2 ones (the *tls.Conn the server is given) are left
// out: Shutdown's GOAWAY tells their clients which streams it took.
func (v *visitorServer) connState(c net.Conn, st http.ConnState) {
	if tc, ok := c.(*taggedConn); ok {
		v.fresh1(tc, st == http.StateNew)
	}
}

// fresh1 records that c waits for its first request to be read (or no
// longer does).
func (v *visitorServer) fresh1(c *taggedConn, waits bool) {
	if c.fresh.Swap(waits) == waits {
		return // no change: a later request's state, or a second report
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if waits {
		v.fresh[c] = struct{}{}
		return
	}
	delete(v.fresh, c)
	if len(v.fresh) == 0 && v.idle != nil {
		close(v.idle)
		v.idle = nil
	}
}

// waitFirstRequests waits until no HTTP/1.1 connection accepted is
// waiting for its first request to be read, or ctx ends, or
// ReadHeaderTimeout (by which the server ends a silent one) has passed.
func (v *visitorServer) waitFirstRequests(ctx context.Context) {
	v.mu.Lock()
	if len(v.fresh) == 0 {
		v.mu.Unlock()
		return
	}
	idle := make(chan struct{})
	v.idle = idle
	v.mu.Unlock()
	t := time.NewTimer(v.e.cfg.ReadHeaderTimeout)
	defer t.Stop()
	select {
	case <-idle:
	case <-t.C:
	case <-ctx.Done():
	}
	v.mu.Lock()
	v.idle = nil
	v.mu.Unlock()
}

// close stops everything at once and waits for the listener's goroutines.
func (v *visitorServer) close() {
	v.stopAccepting()
	v.srv.Close()
	v.wg.Wait()
	if v.queue != nil {
		v.queue.discard()
	}
}

func (v *visitorServer) stopAccepting() {
	v.once.Do(func() {
		close(v.done)
		v.ln.Close()
	})
}

// chanListener hands the HTTP/1.1 server the connections the terminator
// has shaken hands with.
type chanListener struct{ v *visitorServer }

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.v.conns:
		return c, nil
	case <-l.v.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.v.stopAccepting()
	return nil
}

func (l *chanListener) Addr() net.Addr { return l.v.ln.Addr() }

// looksLikeHTTP reports whether the first bytes of a TLS record are a
// plaintext HTTP request (net/http's test).
func looksLikeHTTP(hdr []byte) bool {
	switch string(hdr) {
	case "GET /", "HEAD ", "POST ", "PUT /", "OPTIO":
		return true
	}
	return false
}

var plainOnTLSResponse = []byte("HTTP/1.0 400 Bad Request\r\n" + mux.ErrorHeader + ": " + mux.CodeBadRequest +
	"\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n")

// taggingListener wraps each plain-HTTP connection in a taggedConn.
type taggingListener struct {
	net.Listener
	m *metrics
}

func (l taggingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &taggedConn{Conn: c, m: l.m}, nil
}

// taggedConn adds Ngstone-Error to the responses net/http's HTTP/1.1
// server writes straight to the connection for a request it could not read:
// such a write is one Write of a status line followed at once by
// "Content-Type: text/plain; charset=utf-8" and "Connection: close", where
// a response of a handler always carries Date first.
type taggedConn struct {
	net.Conn
	tls *tls.Conn // the TLS connection under it, on the HTTPS listener
	m   *metrics
	// fresh: its first request is not read yet (visitorServer.fresh), so
	// that the states of the requests after it cost no lock.
	fresh atomic.Bool
}

var internalErrorHead = []byte("\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n")

func (c *taggedConn) Write(p []byte) (int, error) {
	if status, ok := internalError(p); ok {
		code := mux.CodeBadRequest
		if status == http.StatusRequestHeaderFieldsTooLarge {
			code = mux.CodeHeadersTooLarge
		}
		c.m.observe(status, code, 0)
		i := bytes.IndexByte(p, '\r')
		out := make([]byte, 0, len(p)+64)
		out = append(out, p[:i]...)
		out = append(out, "\r\n"+mux.ErrorHeader+": "+code...)
		out = append(out, p[i:]...)
		if _, err := c.Conn.Write(out); err != nil {
			return 0, err
		}
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// CloseWrite lets the server half-close after an error response, so that
// the visitor reads it before the connection ends.
func (c *taggedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// internalError reports whether p is one of net/http's own error responses,
// and its status.
func internalError(p []byte) (int, bool) {
	if len(p) < 13 || !bytes.HasPrefix(p, []byte("HTTP/1.")) || p[8] != ' ' {
		return 0, false
	}
	i := bytes.IndexByte(p, '\r')
	if i < 0 || !bytes.HasPrefix(p[i:], internalErrorHead) {
		return 0, false
	}
	status, err := strconv.Atoi(string(p[9:12]))
	if err != nil || status < 400 {
		return 0, false
	}
	return status, true
}
