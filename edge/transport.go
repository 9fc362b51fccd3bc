package edge

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
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
	x := &exchange{conn: conn}
	x.stop = context.AfterFunc(req.Context(), x.close)
	if req.Body == nil || req.Body == http.NoBody {
		if err := writeRequest(conn, req); err != nil {
			x.close()
			return nil, err
		}
	} else {
		// The body streams while the response is read: the agent may
		// answer before it has read all of it.
		go func() {
			if writeRequest(conn, req) != nil {
				x.close()
			}
		}()
	}
	resp, err := x.readResponse(req, t.e.cfg.TunnelTimeout)
	if err != nil {
		x.close()
		return nil, err
	}
	return resp, nil
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

// exchange is one request's stream; closing it ends the exchange.
type exchange struct {
	conn net.Conn
	br   *bufio.Reader
	stop func() bool
	once sync.Once
}

func (x *exchange) close() {
	x.once.Do(func() {
		x.stop()
		x.conn.Close()
	})
}

// readResponse reads the response headers within timeout, skipping
// informational responses other than 101.
func (x *exchange) readResponse(req *http.Request, timeout time.Duration) (*http.Response, error) {
	x.br = bufio.NewReaderSize(x.conn, 4<<10)
	x.conn.SetReadDeadline(time.Now().Add(timeout))
	var resp *http.Response
	for {
		var err error
		resp, err = http.ReadResponse(x.br, req)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
		resp.Body.Close()
	}
	x.conn.SetReadDeadline(time.Time{})
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The reverse proxy copies both ways on an upgraded body.
		resp.Body = &upgradedBody{x: x}
		return resp, nil
	}
	resp.Body = &responseBody{ReadCloser: resp.Body, x: x}
	return resp, nil
}

// responseBody ends the exchange when the reverse proxy closes it.
type responseBody struct {
	io.ReadCloser
	x *exchange
}

func (b *responseBody) Close() error {
	b.x.close()
	return nil
}

// upgradedBody is the stream after a 101: reads take what the header
// reader had buffered first.
type upgradedBody struct{ x *exchange }

func (b *upgradedBody) Read(p []byte) (int, error)  { return b.x.br.Read(p) }
func (b *upgradedBody) Write(p []byte) (int, error) { return b.x.conn.Write(p) }
func (b *upgradedBody) Close() error {
	b.x.close()
	return nil
}
