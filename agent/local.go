package agent

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"sync"
	"syscall"
	"time"
)

// localTransport is the agent's http.RoundTripper to a plain-HTTP local
// service. It does what http.Transport does for the reverse proxy, in the
// calling goroutine: write the request on a pooled keep-alive connection,
// read the response, and put the connection back once the body has been
// read to its end. http.Transport hands each exchange to a reader and a
// writer goroutine of the connection; here one exchange costs no goroutine
// unless the request has a body (which streams while the response is read).
type localTransport struct {
	addr          string // the local service's HOST:PORT
	dialer        net.Dialer
	headerTimeout time.Duration // for the response headers; 0: none
	maxIdle       int
	idleTimeout   time.Duration
	probeIdle     time.Duration // see defaultProbeIdle

	mu   sync.Mutex
	idle []*localConn // most recently used last
}

const (
	// defaultProbeIdle is how long a pooled connection may sit unused
	// before it is checked for a close by the local service (keep-alive
	// timeouts are seconds) ahead of a request that could not be sent
	// again. http.Transport learns of such closes from a reader goroutine
	// per connection.
	defaultProbeIdle = 500 * time.Millisecond
	// maxHeaderBytes bounds a response's headers, 1xx responses included,
	// as http.Transport does.
	maxHeaderBytes = 10 << 20
	// max1xx bounds the informational responses before the final one.
	max1xx = 16
	// maxWriteWait bounds the wait for a request body still being
	// written when its response has ended (http.Transport's figure).
	maxWriteWait = 50 * time.Millisecond
)

var (
	errHeadersTooLarge = errors.New("agent: local service response headers too large")
	errTooMany1xx      = errors.New("agent: too many informational responses from the local service")
)

// localConn is one keep-alive connection to the local service.
type localConn struct {
	net.Conn
	br     *bufio.Reader
	bw     *bufio.Writer
	limit  int64 // bytes the header reader may still read; <0: no limit
	nread  int64 // bytes read in this exchange
	usedAt time.Time
}

func (c *localConn) Read(p []byte) (int, error) {
	if c.limit >= 0 {
		if c.limit == 0 {
			return 0, errHeadersTooLarge
		}
		p = p[:min(int64(len(p)), c.limit)]
	}
	n, err := c.Conn.Read(p)
	c.nread += int64(n)
	if c.limit >= 0 {
		c.limit -= int64(n)
	}
	return n, err
}

func (t *localTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	for retry := true; ; retry = false {
		lc, reused, err := t.conn(req.Context())
		if err != nil {
			if req.Body != nil {
				req.Body.Close()
			}
			return nil, err
		}
		resp, err := t.exchange(lc, req)
		// A pooled connection the local service closed just before
		// the request: send a request without a body once more, on a
		// new connection, as http.Transport does.
		if err != nil && reused && retry && lc.nread == 0 && replayable(req) && req.Context().Err() == nil && closedByPeer(err) {
			continue
		}
		return resp, err
	}
}

// replayable reports whether req may be sent twice, by http.Transport's
// rule.
func replayable(req *http.Request) bool {
	if req.Body != nil && req.Body != http.NoBody {
		return false
	}
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return req.Header.Get("Idempotency-Key") != "" || req.Header.Get("X-Idempotency-Key") != ""
}

func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// exchange sends req on lc and reads the response headers. On error lc is
// closed; on success the response body owns it.
func (t *localTransport) exchange(lc *localConn, req *http.Request) (*http.Response, error) {
	lc.nread = 0
	hasBody := req.Body != nil && req.Body != http.NoBody
	x := &localExchange{t: t, lc: lc, writing: hasBody}
	x.stop = context.AfterFunc(req.Context(), func() { lc.Close() })
	if !hasBody {
		if err := writeLocal(lc, req); err != nil {
			x.end(false)
			return nil, err
		}
	} else {
		// The body streams while the response is read: the local
		// service may answer before it has read all of it.
		x.wrote = make(chan struct{})
		go func() { x.written(writeLocal(lc, req)) }()
	}
	resp, err := t.readResponse(lc, req)
	if err != nil {
		x.end(false)
		if ctxErr := req.Context().Err(); ctxErr != nil {
			err = ctxErr
		}
		return nil, err
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The reverse proxy copies both ways on the connection; it is
		// never pooled again.
		resp.Body = &upgradedLocal{br: lc.br, Conn: lc.Conn, stop: x.stop}
		return resp, nil
	}
	x.keep = !resp.Close && !req.Close
	x.body = resp.Body
	resp.Body = x
	if x.body == http.NoBody {
		x.end(true)
	}
	return resp, nil
}

func writeLocal(lc *localConn, req *http.Request) error {
	if err := req.Write(lc.bw); err != nil {
		return err
	}
	return lc.bw.Flush()
}

// readResponse reads the final response's headers within headerTimeout,
// passing informational responses other than 101 to the request's trace
// (the reverse proxy forwards them).
func (t *localTransport) readResponse(lc *localConn, req *http.Request) (*http.Response, error) {
	if t.headerTimeout > 0 {
		lc.SetReadDeadline(time.Now().Add(t.headerTimeout))
		defer lc.SetReadDeadline(time.Time{})
	}
	lc.limit = maxHeaderBytes
	defer func() { lc.limit = -1 }()
	trace := httptrace.ContextClientTrace(req.Context())
	for range max1xx {
		resp, err := http.ReadResponse(lc.br, req)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			return resp, nil
		}
		if trace != nil && trace.Got1xxResponse != nil {
			if err := trace.Got1xxResponse(resp.StatusCode, textproto.MIMEHeader(resp.Header)); err != nil {
				return nil, err
			}
			lc.limit = maxHeaderBytes
		}
	}
	return nil, errTooMany1xx
}

// localExchange is the response body. The connection goes back to the
// pool once the body has been read to its end and the request body, if
// any, written whole; it is closed otherwise.
type localExchange struct {
	t     *localTransport
	lc    *localConn
	body  io.ReadCloser
	stop  func() bool
	keep  bool          // neither side asked to close
	wrote chan struct{} // closed when the request body is written; nil: no body

	mu       sync.Mutex
	writing  bool // the request body is being written
	writeErr error
	ended    bool // the response is over: lc is closed or pooled
}

func (x *localExchange) Read(p []byte) (int, error) {
	n, err := x.body.Read(p)
	if err == io.EOF {
		x.end(true)
	}
	return n, err
}

// Close ends the exchange. A body not read to its end is not drained: the
// connection is closed instead.
func (x *localExchange) Close() error {
	x.end(false)
	return nil
}

// end records the end of the response, complete or not, and closes or
// pools the connection.
func (x *localExchange) end(complete bool) {
	if complete && x.wrote != nil {
		// As http.Transport does, give a request body still being
		// written a moment to end before giving the connection up.
		select {
		case <-x.wrote:
		default:
			t := time.NewTimer(maxWriteWait)
			select {
			case <-x.wrote:
			case <-t.C:
			}
			t.Stop()
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.ended {
		return
	}
	x.ended = true
	x.stop()
	if complete && x.keep && !x.writing && x.writeErr == nil {
		x.t.put(x.lc)
		return
	}
	x.lc.Close()
}

// written records the end of the request body.
func (x *localExchange) written(err error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.writing, x.writeErr = false, err
	close(x.wrote)
	if err != nil && !x.ended {
		x.lc.Close() // the exchange cannot end well: reads fail at once
	}
}

// upgradedLocal is the connection after a 101: reads take what the header
// reader had buffered first.
type upgradedLocal struct {
	net.Conn
	br   *bufio.Reader
	stop func() bool
}

func (u *upgradedLocal) Read(p []byte) (int, error) {
	if u.br != nil {
		if u.br.Buffered() > 0 {
			return u.br.Read(p[:min(len(p), u.br.Buffered())])
		}
		u.br = nil
	}
	return u.Conn.Read(p)
}

func (u *upgradedLocal) Close() error {
	u.stop()
	return u.Conn.Close()
}

// conn returns a pooled connection (reused true) or dials one.
func (t *localTransport) conn(ctx context.Context) (*localConn, bool, error) {
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
	c, err := t.dialer.DialContext(ctx, "tcp", t.addr)
	if err != nil {
		return nil, false, err
	}
	lc := &localConn{Conn: c, limit: -1}
	lc.br = bufio.NewReader(lc)
	lc.bw = bufio.NewWriter(c)
	return lc, false, nil
}

// alive reports whether the local service has left an idle connection
// open: a read that would block says so, in about a microsecond.
func (c *localConn) alive() bool {
	c.Conn.SetReadDeadline(time.Now().Add(time.Microsecond))
	var b [1]byte
	_, err := c.Conn.Read(b[:])
	c.Conn.SetReadDeadline(time.Time{})
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func (t *localTransport) pop() *localConn {
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

func (t *localTransport) put(lc *localConn) {
	if lc.br.Buffered() > 0 {
		lc.Close() // bytes past the response: not a connection to reuse
		return
	}
	lc.usedAt = time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	// The least recently used connection goes first: when the pool is
	// full, or when it has been idle too long.
	if len(t.idle) > 0 && (len(t.idle) >= t.maxIdle || time.Since(t.idle[0].usedAt) > t.idleTimeout) {
		t.idle[0].Close()
		t.idle = append(t.idle[:0], t.idle[1:]...)
	}
	t.idle = append(t.idle, lc)
}

// CloseIdleConnections closes the pooled connections.
func (t *localTransport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, lc := range idle {
		lc.Close()
	}
}
