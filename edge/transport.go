package edge

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// streamTransport sends each request through its session's pool of
// streams (session.pool): net/http's Transport, whose dial opens a yamux
// stream on that session, so that a stream carries one exchange after
// another as a keep-alive connection does, and never another session's.
// The Transport bounds the response head (MaxResponseHead) and the wait
// for it (TunnelTimeout, from the end of the request body); each write to
// a stream is bounded by the tunnel timeout too (poolStream). An exchange
// counts against MaxStreamsPerSession until its response body is closed.
type streamTransport struct{ e *Edge }

// Errors of an exchange with an agent, for visitorFailed.
var (
	// errHeadTooLarge: the response head (informational heads included)
	// is over MaxResponseHead.
	errHeadTooLarge = errors.New("edge: the agent's response head is over the limit")
	// errBadResponse: the agent sent what is not a response, or ended
	// the stream before one while its session is up.
	errBadResponse = errors.New("edge: the agent sent no readable response")
	// errTooMany1xx: more informational responses than an agent passes on.
	errTooMany1xx = fmt.Errorf("%w: too many informational responses", errBadResponse)
	// errVisitorRead: the visitor's request body broke or stalled.
	errVisitorRead = errors.New("edge: reading the visitor's request body")
)

func (t *streamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	rt, _ := req.Context().Value(routeKey{}).(route)
	s := rt.s
	var err error
	switch {
	case s == nil || s.isClosed() || !s.holds(rt.hostname, rt.generation):
		err = errNoRoute
	case !s.streams.TryAdd(t.e.cfg.MaxStreamsPerSession):
		err = errTooManyStreams
	}
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	resp, err := s.pool.RoundTrip(req)
	if err == nil {
		if err = checkStatus(resp, req); err != nil {
			resp.Body.Close()
		}
	}
	if err != nil {
		s.streams.Done()
		return nil, s.exchangeError(err)
	}
	if rwc, ok := resp.Body.(io.ReadWriteCloser); ok {
		// An upgraded connection: the reverse proxy copies both ways.
		resp.Body = &upgradedBody{exchangeBody{ReadCloser: rwc, s: s}, rwc}
	} else {
		resp.Body = &exchangeBody{ReadCloser: resp.Body, s: s}
	}
	return resp, nil
}

// newPool returns the session's pool of streams.
func (s *session) newPool() *http.Transport {
	cfg := s.e.cfg
	tr := &http.Transport{
		DialContext:            s.dialStream,
		MaxIdleConns:           cfg.IdleStreams,
		MaxIdleConnsPerHost:    cfg.IdleStreams,
		IdleConnTimeout:        cfg.IdleStreamTimeout,
		ResponseHeaderTimeout:  cfg.TunnelTimeout,
		MaxResponseHeaderBytes: cfg.MaxResponseHead,
		DisableCompression:     true, // the visitor's Accept-Encoding goes as it came
	}
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetHTTP1(true)
	return tr
}

// dialStream opens a stream of the session for its pool.
func (s *session) dialStream(context.Context, string, string) (net.Conn, error) {
	st, err := s.ys.OpenStream()
	if err != nil {
		return nil, errors.Join(errNoRoute, err)
	}
	return &poolStream{Stream: st, timeout: s.e.cfg.TunnelTimeout}, nil
}

// poolStream gives each write to its stream the tunnel timeout afresh: the
// agent takes a request body as fast as its local service does, and one
// that has taken none of it for that long (its window closed: a local
// service that reads nothing and does not answer, or an agent that never
// reads) ends the exchange with 504 tunnel_timeout, where the write would
// otherwise wait for as long as the session lives. The same holds for an
// upgraded connection's writes. The agent holds its local service to a
// finer bound of its own (--upstream-timeout, at each write).
type poolStream struct {
	*yamux.Stream
	timeout time.Duration
}

func (c *poolStream) Write(p []byte) (int, error) {
	c.Stream.SetWriteDeadline(time.Now().Add(c.timeout))
	return c.Stream.Write(p)
}

// exchangeError says why an exchange failed: the limits, the tunnel
// timeout, the session's end (tunnel_interrupted), or, the session up, an
// agent that answered with what is not a response.
func (s *session) exchangeError(err error) error {
	var ne net.Error
	switch {
	case errors.Is(err, errNoRoute), errors.Is(err, errBadResponse):
		return err
	case strings.Contains(err.Error(), "server response headers exceeded"):
		// net/http's Transport says so only in its error's text; the
		// hostile-peer test of a large head pins it.
		return errHeadTooLarge
	case errors.As(err, &ne) && ne.Timeout():
		return err
	case s.isClosed() || s.ys.IsClosed():
		return err
	}
	return errors.Join(errBadResponse, err)
}

// checkStatus refuses a status net/http reads (any three digits, a sign
// too) but no response may carry, as the agent refuses its local
// service's. It refuses a switch of protocols the request did not ask
// for, as the reverse proxy would, but with the code of a bad response.
func checkStatus(resp *http.Response, req *http.Request) error {
	switch code := resp.StatusCode; {
	case code < 100 || code > 599:
		return fmt.Errorf("%w: status %d", errBadResponse, code)
	case code == http.StatusSwitchingProtocols && req.Header.Get("Upgrade") == "":
		return fmt.Errorf("%w: switching protocols unasked", errBadResponse)
	}
	return nil
}

// exchangeBody is a response body; closing it ends the exchange's count.
type exchangeBody struct {
	io.ReadCloser
	s    *session
	once sync.Once
}

func (b *exchangeBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.s.streams.Done)
	return err
}

// upgradedBody is the stream after a 101, counted until it is closed.
type upgradedBody struct {
	exchangeBody
	io.Writer
}

// readErrBody records the error a read of the visitor's body failed with.
type readErrBody struct {
	io.ReadCloser
	mu  sync.Mutex
	err error
}

func (b *readErrBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF {
		b.mu.Lock()
		b.err = err
		b.mu.Unlock()
	}
	return n, err
}

// failed returns the error a read of the visitor's body failed with,
// marked errVisitorRead (a body over the limit keeps its own type).
func (b *readErrBody) failed() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err == nil || errors.As(b.err, new(*http.MaxBytesError)) || errors.Is(b.err, errVisitorRead) {
		return b.err
	}
	return errors.Join(errVisitorRead, b.err)
}
