package edge

import (
	"bufio"
	"context"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// streamTransport runs each request as one HTTP/1.1 exchange on a new
// stream of the request's session. It stands in for http.Transport, whose
// dial machinery, two goroutines and two buffers per connection cost more
// than the exchange itself when no connection is ever reused; here a stream
// is never pooled, so it can never serve another session or generation.
type streamTransport struct{ e *Edge }

// requestWriters buffer the request line, headers and body chunks of
// uploads, so an upload leaves in frames of this size.
var requestWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 32<<10) }}

func (t *streamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	conn, err := t.e.dialStream(req.Context(), "", "")
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	// The reverse proxy passes informational responses on.
	x := &exchange{conn: conn, trace: httptrace.ContextClientTrace(req.Context())}
	hasBody := req.Body != nil && req.Body != http.NoBody
	resp, _, err := x.start(req, hasBody, func() error { return writeRequest(conn, req) }, t.e.cfg.TunnelTimeout)
	return resp, err
}

// start runs the exchange up to the response head: it writes the request
// with write, at once when it has no body and on a goroutine of its own
// otherwise (the agent may answer before it has read all of the body, and
// the body streams while the response is read), then reads the response
// head within timeout. The exchange ends when req's context does. When the
// body streams, wrote receives write's error. On an error the exchange is
// over.
func (x *exchange) start(req *http.Request, hasBody bool, write func() error, timeout time.Duration) (resp *http.Response, wrote <-chan error, err error) {
	x.stop = context.AfterFunc(req.Context(), x.close)
	if !hasBody {
		if err := write(); err != nil {
			x.close()
			return nil, nil, err
		}
	} else {
		ch := make(chan error, 1)
		go func() {
			err := write()
			ch <- err // before the close, which the response read sees
			if err != nil {
				x.close()
			}
		}()
		wrote = ch
	}
	resp, err = x.readResponse(req, timeout)
	if err != nil {
		x.close()
		x.release()
		return nil, wrote, err
	}
	return resp, wrote, nil
}

func writeRequest(conn net.Conn, req *http.Request) error {
	bw := requestWriters.Get().(*bufio.Writer)
	bw.Reset(conn)
	err := req.Write(bw)
	if err == nil {
		err = bw.Flush()
	}
	bw.Reset(nil)
	requestWriters.Put(bw)
	return err
}

// responseReaders read response headers and bodies from streams.
var responseReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}

// exchange is one request's stream; closing it ends the exchange. It is
// also the response body the reverse proxy reads and closes.
type exchange struct {
	conn net.Conn
	br   *bufio.Reader
	body io.ReadCloser // the response body, read from br
	eof  bool          // body has returned io.EOF: it reads br no more
	stop func() bool
	// Informational responses go to visitor (the direct path) or to
	// trace (the reverse proxy's); with neither, they are dropped.
	visitor  http.ResponseWriter
	trace    *httptrace.ClientTrace
	timedOut atomic.Bool
	once     sync.Once
}

// close ends the exchange; it may run on another goroutine than the reads
// (a visitor gone, a timeout), so it leaves br alone.
func (x *exchange) close() {
	x.once.Do(func() {
		x.stop()
		x.conn.Close()
	})
}

// release gives br back once nothing reads it any more.
func (x *exchange) release() {
	if x.br != nil {
		x.br.Reset(nil)
		responseReaders.Put(x.br)
		x.br = nil
	}
}

// errTunnelTimeout: the agent sent no response headers within the tunnel
// timeout.
var errTunnelTimeout = timeoutError{}

type timeoutError struct{}

func (timeoutError) Error() string   { return "edge: no response headers from the agent in time" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

// readResponse reads the response headers within timeout, passing
// informational responses other than 101 on (inform).
func (x *exchange) readResponse(req *http.Request, timeout time.Duration) (*http.Response, error) {
	x.br = responseReaders.Get().(*bufio.Reader)
	x.br.Reset(x.conn)
	t := time.AfterFunc(timeout, func() {
		x.timedOut.Store(true)
		x.close()
	})
	resp, err := x.readFinal(req)
	if !t.Stop() && x.timedOut.Load() {
		err = errTunnelTimeout
	}
	if err != nil {
		return nil, err
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The reverse proxy copies both ways on an upgraded body, on two
		// goroutines: its reader is never pooled again.
		resp.Body = &upgradedBody{x: x, br: x.br}
		x.br = nil
		return resp, nil
	}
	x.body = resp.Body
	resp.Body = x
	return resp, nil
}

var errTooMany1xx = errors.New("edge: too many informational responses from the agent")

// readFinal reads informational responses, passing each on, until the
// final one (or a 101).
func (x *exchange) readFinal(req *http.Request) (*http.Response, error) {
	for range mux.Max1xx {
		resp, err := http.ReadResponse(x.br, req)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			return resp, nil
		}
		resp.Body.Close()
		if err := x.inform(resp.StatusCode, resp.Header); err != nil {
			return nil, err
		}
	}
	return nil, errTooMany1xx
}

// inform passes an informational response on: 103 Early Hints and the
// like reach the visitor as they come.
func (x *exchange) inform(code int, h http.Header) error {
	switch {
	case x.trace != nil && x.trace.Got1xxResponse != nil:
		return x.trace.Got1xxResponse(code, textproto.MIMEHeader(h))
	case x.visitor == nil, code == http.StatusContinue:
		// The visitor's server sends its own 100 when the body is read.
		return nil
	}
	dropHopHeaders(h)
	// The visitor's header map is both what WriteHeader(1xx) sends and
	// what the final response will send: the 1xx goes out with its own
	// fields only, and the map is given back as it was.
	dst := x.visitor.Header()
	kept := maps.Clone(dst)
	clear(dst)
	maps.Copy(dst, h)
	x.visitor.WriteHeader(code)
	clear(dst)
	maps.Copy(dst, kept)
	return nil
}

func (x *exchange) Read(p []byte) (int, error) {
	n, err := x.body.Read(p)
	if err == io.EOF {
		x.eof = true
	}
	return n, err
}

// Close ends the exchange when the reverse proxy is done with the body.
// br goes back to its pool only if the body was read to its end: a read
// cut short may still be under way on another goroutine.
func (x *exchange) Close() error {
	x.close()
	if x.eof || x.body == http.NoBody {
		x.release()
	}
	return nil
}

// upgradedBody is the stream after a 101: reads take what the header
// reader had buffered first.
type upgradedBody struct {
	x  *exchange
	br *bufio.Reader
}

func (b *upgradedBody) Read(p []byte) (int, error)  { return b.br.Read(p) }
func (b *upgradedBody) Write(p []byte) (int, error) { return b.x.conn.Write(p) }
func (b *upgradedBody) Close() error {
	b.x.close()
	return nil
}
