package agent

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
)

// localPool keeps the agent's connections to the local service alive
// between exchanges: a request costs a new stream, never a new local TCP
// connection.
type localPool struct {
	dial        func() (net.Conn, error)
	maxIdle     int
	idleTimeout time.Duration
	probeIdle   time.Duration // see defaultProbeIdle

	mu     sync.Mutex
	idle   []*localConn // most recently used last
	closed bool         // CloseIdleConnections ran: keep nothing
}

// defaultProbeIdle is how long a pooled connection may sit unused before it
// is checked for a close by the local service (keep-alive timeouts are
// seconds) ahead of a request that could not be sent again. http.Transport
// learns of such closes from a reader goroutine per connection.
const defaultProbeIdle = 500 * time.Millisecond

// localConn is one keep-alive connection to the local service.
type localConn struct {
	net.Conn
	br     *bufio.Reader
	nread  int64 // bytes read in this exchange
	usedAt time.Time
}

func (c *localConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.nread += int64(n)
	return n, err
}

func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// conn returns a pooled connection (reused true) or dials one.
func (t *localPool) conn() (*localConn, bool, error) {
	for {
		lc := t.pop()
		if lc == nil {
			break
		}
		if time.Since(lc.usedAt) < t.probeIdle || lc.alive() {
			return lc, true, nil
		}
		lc.Close()
	}
	c, err := t.dial()
	if err != nil {
		return nil, false, err
	}
	lc := &localConn{Conn: c}
	lc.br = bufio.NewReader(lc)
	return lc, false, nil
}

// alive reports whether the local service has left an idle connection
// open: nothing to read on it yet, neither bytes nor the end.
func (c *localConn) alive() bool {
	raw := c.Conn
	if tc, ok := raw.(*tls.Conn); ok {
		raw = tc.NetConn() // a close_notify or a FIN both say no
	}
	return socketIdle(raw)
}

// aliveByDeadline is socketIdle where the socket cannot be peeked at: a
// read with a short deadline must time out. The deadline leaves the read
// time to reach the socket (one that has already passed fails before it).
func aliveByDeadline(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(time.Millisecond))
	var b [1]byte
	_, err := c.Read(b[:])
	c.SetReadDeadline(time.Time{})
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func (t *localPool) pop() *localConn {
	t.mu.Lock()
	defer t.mu.Unlock()
	for n := len(t.idle); n > 0; n = len(t.idle) {
		lc := t.idle[n-1]
		t.idle[n-1] = nil
		t.idle = t.idle[:n-1]
		if time.Since(lc.usedAt) <= t.idleTimeout {
			return lc
		}
		lc.Close()
	}
	return nil
}

func (t *localPool) put(lc *localConn) {
	if lc.br.Buffered() > 0 {
		lc.Close() // bytes past the response: not a connection to reuse
		return
	}
	lc.usedAt = time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		lc.Close() // an exchange that outlived Run
		return
	}
	// The least recently used connection goes first: when the pool is
	// full, or when it has been idle too long.
	if len(t.idle) > 0 && (len(t.idle) >= t.maxIdle || time.Since(t.idle[0].usedAt) > t.idleTimeout) {
		t.idle[0].Close()
		t.idle = append(t.idle[:0], t.idle[1:]...)
	}
	t.idle = append(t.idle, lc)
}

// CloseIdleConnections closes the pooled connections, and any that an
// exchange still running gives back later.
func (t *localPool) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle, t.closed = nil, true
	t.mu.Unlock()
	for _, lc := range idle {
		lc.Close()
	}
}
