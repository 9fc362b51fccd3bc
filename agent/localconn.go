package agent

import (
	"context"
	"errors"
	"net"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"time"
)

// A pooled connection to the local service is reused only when it is
// provably clean. net/http's transport closes an idle connection on which
// bytes arrive unasked, but it checks on a goroutine of its own: when the
// machine is busy, the next request can take the connection before that
// goroutine has looked, and the stray bytes (a body after HEAD, 204 or 304,
// more than a Content-Length) are read as that request's response. So each
// connection counts the bytes read from its socket, and two checks hold
// around every request on a reused connection:
//
//   - when the transport hands the connection out (httptrace.GotConn),
//     nothing is waiting on the socket; else the connection is poisoned:
//     its reads and writes fail at once, nothing of the request is written,
//     and the transport sends it again on a new connection;
//   - when the response's first byte is there (GotFirstResponseByte),
//     something was read from the socket since: a response cannot come
//     before its request. Else the response is refused (502 bad_response),
//     and the connection poisoned.
//
// A read of the socket and the first check are serialized (watchedConn's
// mutex), so no byte can slip between them. Bytes that arrive after a
// request was sent cannot be told from its answer, by any HTTP/1.1 client.

// errStrayBytes: the local service sent bytes nobody asked for on a
// connection, which is not used again.
var errStrayBytes = errors.New("agent: the local service sent bytes nobody asked for on an idle connection")

// watchedConn is a connection to the local service, counting the bytes
// read from its socket.
type watchedConn struct {
	net.Conn
	t *tunnel

	mu       sync.Mutex
	read     int64
	poisoned atomic.Bool
	http2    atomic.Bool // the first bytes it read were an HTTP/2 SETTINGS frame
}

// noteFirst notes whether b, the first bytes read from the connection,
// begin with an HTTP/2 SETTINGS frame: what an h2c-only server (a gRPC
// server) sends first, before it has read anything. net/http's transport
// reads it as a malformed response when it comes after the request, but
// as bytes on an idle connection when it comes first, which it closes:
// the request then fails writing, and only this says why.
func (c *watchedConn) noteFirst(b []byte) {
	// A frame's head: a 24-bit length (under 64 KiB: its first byte 0),
	// its type (4, SETTINGS), flags, and stream 0.
	if len(b) >= 9 && b[0] == 0 && b[3] == 4 && b[5]|b[6]|b[7]|b[8] == 0 {
		c.http2.Store(true)
	}
}

func (c *watchedConn) spokeHTTP2() bool { return c.http2.Load() }

// poison makes every later read and write of c fail, and closes it.
func (c *watchedConn) poison() {
	if c.poisoned.CompareAndSwap(false, true) {
		c.t.strayBytes()
		c.Conn.Close()
	}
}

// Write gives each write the upstream timeout afresh: a local service
// that takes nothing of a request body for that long (it reads none of it,
// and does not answer) fails the request with upstream_timeout, where the
// response timeout, counted from the body's end, would never start. A slow
// reader is not cut, only a stalled one.
func (c *watchedConn) Write(p []byte) (int, error) {
	if c.poisoned.Load() {
		return 0, errStrayBytes
	}
	if d := c.t.cfg.UpstreamTimeout; d > 0 {
		c.Conn.SetWriteDeadline(time.Now().Add(d))
	}
	return c.Conn.Write(p)
}

// Read counts what it reads (where the socket cannot be read directly:
// see watchedUnix).
func (c *watchedConn) Read(p []byte) (int, error) {
	if c.poisoned.Load() {
		return 0, errStrayBytes
	}
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	if c.read == 0 {
		c.noteFirst(p[:n])
	}
	c.read += int64(n)
	c.mu.Unlock()
	return n, err
}

// idle returns the bytes read so far, and whether the connection may take
// a request; here without looking at the socket.
func (c *watchedConn) idle() (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.read, !c.poisoned.Load()
}

func (c *watchedConn) isPoisoned() bool { return c.poisoned.Load() }

// watched is a watched connection, whichever way it reads.
type watched interface {
	idle() (int64, bool)
	poison()
	readSoFar() int64
	isPoisoned() bool
	spokeHTTP2() bool
}

// Both ways of reading are watched: watchedOf finds a connection by this
// interface, and one that fell out of it would go unchecked.
var _ watched = (*watchedConn)(nil)

// dialWatched dials the local service with d.
func (t *tunnel) dialWatched(d *net.Dialer) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return newWatchedConn(t, c), nil
	}
}

// watchedOf returns the watched connection under c (a TLS connection's
// socket), or nil.
func watchedOf(c net.Conn) watched {
	if tc, ok := c.(interface{ NetConn() net.Conn }); ok {
		c = tc.NetConn()
	}
	wc, _ := c.(watched)
	return wc
}

// cleanCheck makes the two checks for one request: its exchange's trace
// calls gotConn and gotFirstByte, and roundTrip asks refused once the
// transport returned. It is reset before each try of the request.
type cleanCheck struct {
	mu      sync.Mutex
	wc      watched
	mark    int64
	tainted bool
}

func (k *cleanCheck) reset() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.wc, k.mark, k.tainted = nil, 0, false
}

// gotConn poisons a reused connection with bytes waiting.
func (k *cleanCheck) gotConn(info httptrace.GotConnInfo) {
	c := watchedOf(info.Conn)
	if c == nil {
		return
	}
	m, clean := c.idle()
	k.mu.Lock()
	k.wc, k.mark = c, m
	k.mu.Unlock()
	if info.Reused && !clean {
		c.poison()
	}
}

// gotFirstByte refuses a response nothing was read for since the request.
func (k *cleanCheck) gotFirstByte() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.wc != nil && (k.wc.isPoisoned() || k.wc.readSoFar() == k.mark) {
		k.tainted = true
		k.wc.poison()
	}
}

// spokeHTTP2 reports whether the request's connection began with an
// HTTP/2 SETTINGS frame from the local service.
func (k *cleanCheck) spokeHTTP2() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.wc != nil && k.wc.spokeHTTP2()
}

// refused reports whether the response must be refused.
func (k *cleanCheck) refused() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.tainted
}

func (c *watchedConn) readSoFar() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.read
}
