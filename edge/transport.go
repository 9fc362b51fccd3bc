package edge

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// streamTransport runs each request as one HTTP/1.1 exchange on a new
// stream of the request's session, with net/http's own framing: the request
// written by Request.Write, the response read by http.ReadResponse. It
// stands in for http.Transport, whose dial machinery, two goroutines and
// two buffers per connection cost more than the exchange itself when no
// connection is ever reused; here a stream is never pooled, so it can never
// serve another session or generation. It bounds what http.Transport
// bounds: the response head's size (MaxResponseHead), the wait for it
// (TunnelTimeout, from the end of the request body, as
// ResponseHeaderTimeout), the wait for the agent to take any of the body
// (TunnelTimeout, afresh at each write), and the informational responses
// before the head.
type streamTransport struct{ e *Edge }

// requestWriters buffer the request line, headers and body chunks of
// uploads, so an upload leaves in frames of this size.
var requestWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 32<<10) }}

// Errors of an exchange with an agent, for visitorFailed.
var (
	// errHeadTooLarge: the response head (informational heads included)
	// is over MaxResponseHead.
	errHeadTooLarge = errors.New("edge: the agent's response head is over the limit")
	// errBadResponse: the agent sent what is not a response, or ended
	// the stream before one while its session is up.
	errBadResponse = errors.New("edge: the agent sent no readable response")
	// errVisitorRead: the visitor's request body broke or stalled.
	errVisitorRead = errors.New("edge: reading the visitor's request body")
)

func (t *streamTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	conn, err := t.e.dialStream(req)
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	x := &exchange{
		conn: conn, trace: httptrace.ContextClientTrace(req.Context()),
		headMax: t.e.cfg.MaxResponseHead, timeout: t.e.cfg.TunnelTimeout,
	}
	return x.start(req)
}

// exchange is one request's stream; closing it ends the exchange. It is
// also the response body the reverse proxy reads and closes.
type exchange struct {
	conn    *trackedConn
	trace   *httptrace.ClientTrace // passes informational responses on
	headMax int64
	timeout time.Duration

	src  headLimit     // the stream, bounded while the head is read
	br   *bufio.Reader // reads src
	body io.ReadCloser // the response body, read from br
	eof  bool          // body has returned io.EOF: it reads br no more
	stop func() bool

	mu       sync.Mutex
	headDone bool        // the final head was read: the timer is not needed
	timer    *time.Timer // the tunnel timeout, armed once the request is sent
	timedOut atomic.Bool
	once     sync.Once
}

// start writes the request, at once when it has no body and on a goroutine
// of its own otherwise (the agent may answer before it has read all of the
// body, and the body streams while the response is read), then reads the
// response head. The exchange ends when req's context does; on an error it
// is over.
func (x *exchange) start(req *http.Request) (*http.Response, error) {
	x.stop = context.AfterFunc(req.Context(), x.left)
	if req.Body != nil && req.Body != http.NoBody {
		go func() {
			if err := x.write(req); err != nil {
				x.close()
			}
		}()
	} else if err := x.write(req); err != nil {
		x.close()
		return nil, err
	}
	resp, err := x.readResponse(req)
	if err != nil {
		x.close()
		x.release()
		return nil, err
	}
	return resp, nil
}

// write writes req to the stream, then arms the tunnel timeout unless the
// response head is in already. A body larger than the stream's first
// window waits for the agent to accept the stream (awaitAccept), unless
// the stream is the agent's own spare.
func (x *exchange) write(req *http.Request) error {
	if req.ContentLength > mux.InitialWindow && !x.conn.opened {
		if err := x.awaitAccept(req.Context()); err != nil {
			req.Body.Close() // as req.Write would have
			return err
		}
	}
	bw := requestWriters.Get().(*bufio.Writer)
	var sw *stallWriter
	if req.Body != nil && req.Body != http.NoBody {
		sw = &stallWriter{c: x.conn, timeout: x.timeout}
		bw.Reset(sw)
	} else {
		bw.Reset(x.conn)
	}
	err := req.Write(bw)
	if err == nil {
		err = bw.Flush()
	}
	bw.Reset(nil)
	requestWriters.Put(bw)
	if sw != nil {
		x.conn.SetWriteDeadline(time.Time{}) // an upgraded stream writes on
		if sw.stalled {
			x.stalled()
		}
	}
	if err == nil {
		x.arm()
	}
	return err
}

// stallWriter writes a request to its stream, each write given the tunnel
// timeout afresh: the agent takes a body as fast as its local service
// does, and one that has taken none of it for that long (its window
// closed: a local service that reads nothing of the body and does not
// answer, or an agent that never reads) ends the exchange as the tunnel
// timeout does. The wait for the response head is counted from the end of
// the body, which would otherwise never come, and hold the visitor for as
// long as it waits. The edge sees the agent's progress only as yamux's
// window updates, sent once half the window is read: a local service
// taking less than half a window per tunnel timeout (512 KiB a minute
// with the 1 MiB window of a LAN) counts as stalled. The agent holds its
// local service to a finer bound of its own (--upstream-timeout, at each
// write), which a stalled one meets first.
type stallWriter struct {
	c       net.Conn
	timeout time.Duration
	stalled bool
}

func (w *stallWriter) Write(p []byte) (int, error) {
	w.c.SetWriteDeadline(time.Now().Add(w.timeout))
	n, err := w.c.Write(p)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		w.stalled = true
	}
	return n, err
}

// awaitAccept waits, at most the tunnel timeout, until the agent has
// accepted the stream and so granted its whole window: a known-length
// body sent into yamux's first window alone recovers slowly from a loss
// on a lossy link (BENCHMARKS.md). An agent that does not accept within
// the tunnel timeout gets 504 tunnel_timeout.
func (x *exchange) awaitAccept(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, x.timeout)
	defer cancel()
	if mux.AwaitAnswer(wctx, x.conn.s.link, x.conn.id) {
		return nil
	}
	if ctx.Err() == nil && wctx.Err() != nil {
		x.timeOut()
		return errTunnelTimeout
	}
	return errNotAccepted
}

// timeOut ends the exchange as the tunnel timeout ends it. Closing a
// yamux stream only ends its writing side, so the read of the response
// head is ended too: an agent that never answers the stream's end, or
// never accepted the stream, would hold it until the session died.
func (x *exchange) timeOut() {
	x.timedOut.Store(true)
	x.conn.SetReadDeadline(time.Now())
	x.close()
}

// stalled ends the exchange as the tunnel timeout does, its upload
// stalled, unless the response head is in: that response goes on, and the
// rest of the body is not sent.
func (x *exchange) stalled() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if !x.headDone {
		x.timeOut()
	}
}

// errNotAccepted: the session ended, or the visitor left, before the agent
// accepted an upload's stream.
var errNotAccepted = errors.New("edge: the agent did not accept the request's stream")

// arm starts the wait for the response head.
func (x *exchange) arm() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.headDone {
		return
	}
	x.timer = time.AfterFunc(x.timeout, x.timeOut)
}

// headRead stops the wait for the response head, and reports whether it
// had run out.
func (x *exchange) headRead() (timedOut bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.headDone = true
	if x.timedOut.Load() {
		return true
	}
	if x.timer != nil && !x.timer.Stop() {
		return x.timedOut.Load()
	}
	return false
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

// close ends the exchange; it may run on another goroutine than the reads
// (a timeout), so it leaves br alone.
func (x *exchange) close() {
	x.once.Do(func() {
		x.stop()
		x.conn.Close()
	})
}

// left ends the exchange when the request's context ends (the visitor
// left). It runs on the context's own goroutine, which a context done
// already starts before start has stored stop, so it leaves stop alone:
// the call it would cancel is this one.
func (x *exchange) left() {
	x.once.Do(func() { x.conn.Close() })
}

// release gives br back once nothing reads it any more.
func (x *exchange) release() {
	if x.br != nil {
		x.br.Reset(nil)
		responseReaders.Put(x.br)
		x.br = nil
	}
}

// responseReaders read response headers and bodies from streams.
var responseReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}

// errTunnelTimeout: the agent sent no response headers within the tunnel
// timeout.
var errTunnelTimeout = timeoutError{}

type timeoutError struct{}

func (timeoutError) Error() string   { return "edge: no response headers from the agent in time" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

// readResponse reads the response head, passing informational responses
// other than 101 on.
func (x *exchange) readResponse(req *http.Request) (*http.Response, error) {
	x.src = headLimit{r: x.conn, n: x.headMax + responseReaderSize}
	x.br = responseReaders.Get().(*bufio.Reader)
	x.br.Reset(&x.src)
	resp, err := x.readFinal(req)
	if x.headRead() {
		err = errTunnelTimeout
	}
	if err != nil {
		return nil, err
	}
	x.src.n = 1<<63 - 1 // the body is bounded by the visitor's patience, not here
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

// responseReaderSize is the size of responseReaders' buffers: the head
// limit allows for what the reader holds of the body beyond it.
const responseReaderSize = 4 << 10

// readFinal reads informational responses, passing each on, until the
// final one (or a 101). The agent passes on at most mux.Max1xx from its
// local service, and may send a 100 Continue of its own.
func (x *exchange) readFinal(req *http.Request) (*http.Response, error) {
	for range mux.Max1xx + 2 {
		resp, err := http.ReadResponse(x.br, req)
		if err != nil {
			return nil, x.readError(err)
		}
		if read := x.headMax + responseReaderSize - x.src.n - int64(x.br.Buffered()); read > x.headMax {
			return nil, errHeadTooLarge
		}
		if err := checkStatus(resp, req); err != nil {
			resp.Body.Close()
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
	return nil, errors.Join(errBadResponse, errors.New("too many informational responses"))
}

// checkStatus refuses a status net/http reads (any three digits, a sign
// too) but no response may carry, as the agent refuses its local
// service's: one under 100 would be passed on as informational, which the
// visitor's server refuses with a panic. It refuses a switch of protocols
// the request did not ask for, as the reverse proxy would, but with the
// code of a bad response.
func checkStatus(resp *http.Response, req *http.Request) error {
	switch code := resp.StatusCode; {
	case code < 100 || code > 599:
		return fmt.Errorf("%w: status %d", errBadResponse, code)
	case code == http.StatusSwitchingProtocols && req.Header.Get("Upgrade") == "":
		return fmt.Errorf("%w: switching protocols unasked", errBadResponse)
	}
	return nil
}

// readError says why a response head could not be read: the limit, the
// stream breaking (the session's errors, or the stream's end while the
// session is down), or an agent that answered with what is not a response.
func (x *exchange) readError(err error) error {
	switch {
	case errors.Is(err, errHeadTooLarge):
		return errHeadTooLarge
	case x.src.err != nil && !errors.Is(x.src.err, io.EOF):
		return err // the stream broke: the session's error
	case x.conn.s.isClosed() || x.conn.s.ys.IsClosed():
		return err
	}
	return errors.Join(errBadResponse, err)
}

// headLimit reads at most n bytes more from r, then fails with
// errHeadTooLarge; it records r's first error.
type headLimit struct {
	r   io.Reader
	n   int64
	err error
}

func (l *headLimit) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errHeadTooLarge
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	if err != nil && l.err == nil {
		l.err = err
	}
	return n, err
}

// inform passes an informational response on: 103 Early Hints and the
// like reach the visitor as they come, with their own fields only (the
// reverse proxy's trace writes them).
func (x *exchange) inform(code int, h http.Header) error {
	if x.trace == nil || x.trace.Got1xxResponse == nil {
		return nil
	}
	h = maps.Clone(h)
	for _, v := range h["Connection"] {
		for f := range strings.SplitSeq(v, ",") {
			h.Del(strings.TrimSpace(f))
		}
	}
	for _, k := range []string{"Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade"} {
		delete(h, k)
	}
	return x.trace.Got1xxResponse(code, textproto.MIMEHeader(h))
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

func (b *upgradedBody) Read(p []byte) (int, error) { return b.br.Read(p) }

// Write gives each write the tunnel timeout afresh, as a request body's
// (stallWriter): an agent that takes nothing of the upgraded connection
// for that long ends it, where the copy towards it would wait on its
// closed window for as long as the session lives, the visitor gone or not.
func (b *upgradedBody) Write(p []byte) (int, error) {
	b.x.conn.SetWriteDeadline(time.Now().Add(b.x.timeout))
	return b.x.conn.Write(p)
}

func (b *upgradedBody) Close() error {
	b.x.close()
	return nil
}
