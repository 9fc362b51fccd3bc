package agent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/ngstone/ngstone/mux"
)

// The agent's own path for a stream. A stream carries exactly one
// exchange, which net/http's server pays for as if it carried many: a
// goroutine that grows its stack through the server, the reverse proxy's
// copy of the request and the transport; a read in the background; the
// reverse proxy's second trace. So the agent reads each stream's request
// itself with http.ReadRequest and, when it is one whose relay needs
// nothing the reverse proxy does beyond what is below (no upgrade, no
// Expect, no hop-by-hop field, a query the proxy would not rewrite, a head
// net/http's server accepts), sends it to the local service through the
// same transport and trace, and writes the response with Response.Write.
// Any other request goes, with the bytes read of it, to the session's
// http.Server, as every request did before (see serveStreams). The framing
// read and written is net/http's either way.

// handoff is the listener of the session's http.Server: it accepts the
// streams serveStream hands over. The server is started with the first
// (most sessions never hand one over, and need no goroutine for it).
type handoff struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	addr  net.Addr

	serve  func(net.Listener) // serves the listener until it is closed
	start  sync.Once
	served chan struct{} // closed when serve returned; nil: never started
}

func newHandoff(addr net.Addr, serve func(net.Listener)) *handoff {
	return &handoff{conns: make(chan net.Conn), done: make(chan struct{}), addr: addr, serve: serve}
}

func (h *handoff) Accept() (net.Conn, error) {
	select {
	case c := <-h.conns:
		return c, nil
	case <-h.done:
		return nil, net.ErrClosed
	}
}

// Close ends Accept; streams not yet accepted are not taken.
func (h *handoff) Close() error {
	h.once.Do(func() { close(h.done) })
	return nil
}

func (h *handoff) Addr() net.Addr { return h.addr }

// closeAndWait closes the listener and waits for the server, if started,
// to return.
func (h *handoff) closeAndWait() {
	h.Close()
	h.start.Do(func() {})
	if h.served != nil {
		<-h.served
	}
}

// give hands c to the server, starting it for the first; false once the
// listener is closed.
func (h *handoff) give(c net.Conn) bool {
	h.start.Do(func() {
		h.served = make(chan struct{})
		go func() {
			defer close(h.served)
			h.serve(h)
		}()
	})
	select {
	case h.conns <- c:
		return true
	case <-h.done:
		return false
	}
}

// workers serve a session's streams on goroutines kept between streams,
// so that each exchange starts on a stack the ones before it grew: a new
// goroutine's stack grows, and is copied each time, on an exchange's way
// through ReadRequest, the transport and Response.Write. Each worker waits
// for its next stream in the session's accept itself, so a stream goes
// from yamux's receiver straight to the goroutine that serves it, where a
// loop accepting them handed each over (a goroutine's wait and wake-up on
// the path of every request). At least one always waits; one that takes a
// stream when none other is left waiting starts another first. There are
// as many as streams were served at once, each but the last waiting one
// ending once idle for workerIdle, and all with the session.
type workers struct {
	a         *Agent
	sl        *streamListener
	hand      *handoff
	waiting   atomic.Int32   // workers waiting for a stream
	accepting sync.WaitGroup // workers that have not ended
}

// workerIdle is how long a worker waits for another stream: under any
// load streams come far more often, and a burst's workers are not kept
// long after it.
const workerIdle = 2 * time.Second

// start starts a worker; the caller is counted in the agent's WaitGroup.
func (w *workers) start() {
	w.accepting.Add(1)
	w.a.wg.Add(1)
	go w.work()
}

func (w *workers) work() {
	defer w.a.wg.Done()
	defer w.accepting.Done()
	ctx, cancel := context.WithCancel(context.Background())
	idle := time.AfterFunc(workerIdle, cancel)
	defer func() {
		idle.Stop()
		cancel()
	}()
	w.waiting.Add(1)
	for {
		sc, err := w.sl.acceptContext(ctx)
		if err == nil {
			idle.Stop()
			if w.waiting.Add(-1) == 0 {
				w.start()
			}
			w.a.serveStream(sc, w.hand)
			w.waiting.Add(1)
		} else if ctx.Err() == nil || w.leave() {
			// The session is over, or this worker idle and not the
			// last waiting.
			if ctx.Err() == nil {
				w.waiting.Add(-1)
			}
			return
		}
		if ctx.Err() != nil {
			// Idle, but the last one waiting; or the wait ran out as
			// a stream came.
			ctx, cancel = context.WithCancel(context.Background())
			idle = time.AfterFunc(workerIdle, cancel)
		} else {
			idle.Reset(workerIdle)
		}
	}
}

// leave takes an idle worker off the waiting ones unless it is the last,
// and reports whether it did.
func (w *workers) leave() bool {
	for {
		n := w.waiting.Load()
		if n <= 1 {
			return false
		}
		if w.waiting.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// serveApart serves sc on a goroutine of its own: a stream that did not
// come from the session's accept (the agent's spare).
func (w *workers) serveApart(sc *streamConn) {
	w.a.wg.Add(1) // sc is counted: never from zero
	go func() {
		defer w.a.wg.Done()
		w.a.serveStream(sc, w.hand)
	}()
}

var (
	streamReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}
	streamWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 4<<10) }}
	headBufs      = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}
)

// headBufKeep bounds a head buffer put back for the next stream: one a
// long head grew is left to the collector.
const headBufKeep = 64 << 10

// serveStream serves the stream sc: on the agent's own path, or by
// handing it to the server.
func (a *Agent) serveStream(sc *streamConn, hand *handoff) {
	defer func() {
		if p := recover(); p != nil {
			a.log.Error("agent: exchange failed", "panic", p, "stack", string(debug.Stack()))
			sc.Close()
			sc.state(http.StateClosed)
		}
	}()
	br := streamReaders.Get().(*bufio.Reader)
	br.Reset(sc)
	req, next := a.readHead(sc, br)
	switch next {
	case headServer:
		br.Reset(nil)
		streamReaders.Put(br)
		sc.replay, sc.rec = sc.rec, nil
		if hand.give(sc) {
			return
		}
	case headOurs:
		if a.relay(sc, br, req) {
			br.Reset(nil)
			streamReaders.Put(br)
		}
	}
	sc.Close()
	sc.state(http.StateClosed)
}

// What readHead found.
const (
	headClose  = iota // nothing to answer: the stream ended or timed out
	headOurs          // a request for the agent's own path
	headServer        // a request (or bytes) for the server
)

// readHead reads sc's request head, keeping what it read (for the server,
// which would answer a head that ReadRequest refused, or close the stream
// on a timeout, as headClose does).
func (a *Agent) readHead(sc *streamConn, br *bufio.Reader) (*http.Request, int) {
	p := headBufs.Get().(*[]byte)
	sc.rec, sc.recording = (*p)[:0], true
	if a.cfg.DialTimeout > 0 {
		sc.SetReadDeadline(time.Now().Add(a.cfg.DialTimeout))
	}
	req, err := http.ReadRequest(br)
	sc.recording = false
	sc.SetReadDeadline(time.Time{})
	var ne net.Error
	switch {
	case err == nil && !a.serverOnly && ownPath(req):
		if cap(sc.rec) <= headBufKeep {
			*p = sc.rec[:0]
			headBufs.Put(p)
		}
		sc.rec = nil
		return req, headOurs
	case err != nil && (len(sc.rec) == 0 || errors.As(err, &ne) && ne.Timeout()):
		return nil, headClose
	}
	return nil, headServer
}

// ownPath reports whether r can be relayed without the reverse proxy and
// the server: what they would do to it is what relay does. Every field is
// one net/http's server accepts, and none is one the reverse proxy drops or
// rewrites (hop-by-hop fields, an upgrade), nor an Expect the server
// answers.
func ownPath(r *http.Request) bool {
	if r.ProtoMajor != 1 || r.ProtoMinor != 1 || r.Method == http.MethodConnect ||
		!strings.HasPrefix(r.RequestURI, "/") || r.URL.Host != "" || !cleanQuery(r.URL.RawQuery) {
		return false
	}
	if r.Host == "" || !httpguts.ValidHostHeader(r.Host) {
		return false // ReadRequest took the one Host line (it refuses two)
	}
	for k, vv := range r.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return false
		}
		for _, v := range vv {
			if !httpguts.ValidHeaderFieldValue(v) {
				return false
			}
		}
		switch k {
		case "Expect", "Connection", "Proxy-Connection", "Keep-Alive", "Upgrade",
			"Transfer-Encoding", "Trailer", "Proxy-Authenticate", "Proxy-Authorization":
			return false
		case "Te":
			if len(vv) != 1 || vv[0] != "trailers" {
				return false
			}
		}
	}
	return true
}

// cleanQuery reports whether the reverse proxy would pass the query q on
// as it is: no ';' and no '%' that does not start an escape.
func cleanQuery(q string) bool {
	for i := 0; i < len(q); i++ {
		switch q[i] {
		case ';':
			return false
		case '%':
			if i+2 >= len(q) || !isHex(q[i+1]) || !isHex(q[i+2]) {
				return false
			}
			i += 2
		}
	}
	return true
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// relay serves r, read from sc (through br), on the agent's own path. It
// reports whether br is done with: nothing may read it any more (the
// request had no body, or its body was read to its end).
func (a *Agent) relay(sc *streamConn, br *bufio.Reader, r *http.Request) (brDone bool) {
	x := &sc.x
	a.ownPath.Add(1)
	a.begin(x, r)
	defer a.ended(x, r)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ctx = a.withExchange(context.WithValue(ctx, streamKey{}, sc), x)
	bw := streamWriters.Get().(*bufio.Writer)
	bw.Reset(sc)
	w := &respWriter{bw: bw, sc: sc}
	x.out = w
	watch := &watcher{br: br, sc: sc, cancel: cancel}
	var body *ownBody
	if r.Body == nil || r.Body == http.NoBody {
		watch.start()
	} else {
		body = &ownBody{ReadCloser: r.Body, eof: watch.start}
	}
	switch t := x.t; {
	case t == nil:
		a.answerOwn(w, x, r, mux.CodeTunnelNotFound)
	case t.auth != nil && !t.auth.allows(r):
		a.answerOwn(w, x, r, mux.CodeBasicAuthRequired)
	default:
		t.relay(ctx, w, x, r, body)
	}
	watch.stop()
	w.close()
	return body == nil || body.done.Load()
}

// relay sends r to the local service and its response to the edge.
func (t *tunnel) relay(ctx context.Context, w *respWriter, x *exchange, r *http.Request, body *ownBody) {
	out := t.outgoing(ctx, r, body)
	resp, err := upstreamTransport{t}.RoundTrip(out)
	w.final()
	if err == nil && resp.StatusCode == http.StatusSwitchingProtocols {
		// The reverse proxy refuses an upgrade nobody asked for.
		resp.Body.Close()
		err = errUnaskedUpgrade
	}
	if err == nil {
		dropHopFields(resp.Header)
		if err = t.modifyResponse(resp); err != nil {
			resp.Body.Close()
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			// The edge gave the exchange up: nobody reads an answer.
			x.status.CompareAndSwap(0, http.StatusBadGateway)
			return
		}
		w.writeOwn(x, r, func(rw http.ResponseWriter) { t.answerFailed(rw, r, x, err) })
		return
	}
	x.status.CompareAndSwap(0, int64(resp.StatusCode))
	if err := w.respond(resp, r); err != nil {
		// Broken off: the local service cut its response short, or
		// the edge went. If none of it had left, the edge answers.
		// What a streaming response wrote goes (the reverse proxy
		// flushes it at once); a buffered one's start does not, as the
		// server's buffer of it does not.
		x.cut = true
		if w.streaming {
			w.bw.Flush()
		} else {
			w.discard()
		}
		if w.sc.written.Load() == 0 {
			x.status.Store(http.StatusBadGateway)
			x.code.Store(mux.CodeBadResponse)
		}
	}
}

// errUnaskedUpgrade: the local service switched protocols for a request
// that asked for no upgrade.
var errUnaskedUpgrade = errors.New("agent: the local service switched protocols unasked")

// noUserAgent is the User-Agent of a request that had none: the transport
// then sends none of its own.
var noUserAgent = []string{""}

// outgoing is r addressed to the local service, as the reverse proxy and
// rewrite make it: one shallow copy (its fields are r's, which is the
// agent's own), without the proxy's copy of the header.
func (t *tunnel) outgoing(ctx context.Context, r *http.Request, body *ownBody) *http.Request {
	out := r.WithContext(ctx)
	u := *r.URL
	u.Scheme, u.Host = t.local.Scheme, t.local.Host
	out.URL = &u
	out.Host = r.Host
	if t.hostHeader != "" {
		out.Host = t.hostHeader
	}
	out.Close = false
	delete(out.Header, "Forwarded") // the edge's X-Forwarded-* stay, as rewrite keeps them
	if body == nil || r.ContentLength == 0 {
		out.Body = nil
	} else {
		out.Body = body
	}
	mux.PassTrailers(out, r)
	t.headers.request(out)
	if _, ok := out.Header["User-Agent"]; !ok {
		out.Header["User-Agent"] = noUserAgent
	}
	if out.Body != nil {
		out.GetBody = func() (io.ReadCloser, error) { return nil, errBodyGone }
	}
	return out
}

// ownBody is a request body on the agent's own path: the transport's Close
// does not close it (which would read the rest of it from the edge), and
// its end starts the watch on the stream.
type ownBody struct {
	io.ReadCloser
	eof  func()
	done atomic.Bool // read to its end: nothing reads the stream for it any more
}

func (b *ownBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && !b.done.Swap(true) {
		b.eof()
	}
	return n, err
}

func (b *ownBody) Close() error { return nil }

// hopFields are the fields of one connection (RFC 9110, section 7.6.1),
// which the reverse proxy drops from a response.
var hopFields = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// dropHopFields drops the hop-by-hop fields of h, and those its Connection
// names.
func dropHopFields(h http.Header) {
	for _, f := range h["Connection"] {
		for sf := range strings.SplitSeq(f, ",") {
			if sf = textproto.TrimString(sf); sf != "" {
				h.Del(sf)
			}
		}
	}
	for _, f := range hopFields {
		delete(h, f)
	}
}

// watcher watches the stream once the request is read, as net/http's
// server does: the edge closing it ends the exchange (the visitor left).
// The watch starts watchAfter after the request's end, on the timer's own
// goroutine: most exchanges are over by then, and a watch from the start
// cost each of them a goroutine, a wait on the stream and a wake-up to end
// it, for a cancellation that a visitor leaving within watchAfter gets that
// much later.
type watcher struct {
	br      *bufio.Reader
	sc      *streamConn
	cancel  context.CancelFunc
	mu      sync.Mutex
	timer   *time.Timer   // armed by start
	stopped bool          // stop has run: no watch starts after it
	done    chan struct{} // closed when the watch, once started, ends
	b       [1]byte
}

// watchAfter is how long after a request's end the watch on its stream
// starts.
const watchAfter = 10 * time.Millisecond

func (w *watcher) start() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || w.timer != nil {
		return
	}
	w.timer = time.AfterFunc(watchAfter, w.run)
}

func (w *watcher) run() {
	w.mu.Lock()
	if w.stopped {
		w.mu.Unlock()
		return
	}
	done := make(chan struct{})
	w.done = done
	w.mu.Unlock()
	defer close(done)
	for {
		if _, err := w.br.Read(w.b[:]); err != nil {
			w.mu.Lock()
			stopped := w.stopped // stop ended the read: nothing to cancel
			w.mu.Unlock()
			if !stopped {
				w.cancel()
			}
			return
		}
	}
}

// stop ends the watch, and waits for it.
func (w *watcher) stop() {
	w.mu.Lock()
	w.stopped = true
	if w.timer != nil {
		w.timer.Stop()
	}
	done := w.done
	w.mu.Unlock()
	if done == nil {
		return
	}
	w.sc.SetReadDeadline(aLongTimeAgo)
	<-done
}

var aLongTimeAgo = time.Unix(1, 0)

// respWriter writes one exchange's response to the stream, through a
// buffer.
type respWriter struct {
	bw *bufio.Writer
	sc *streamConn

	mu      sync.Mutex // the 1xx passed on from the transport's goroutine, and final
	isFinal bool

	dirty     bool // written to since the last flush
	streaming bool // written out before each read of the body, else when the buffer is full
}

func (w *respWriter) Write(p []byte) (int, error) {
	w.dirty = true
	return w.bw.Write(p)
}

// write1xx passes on an informational response, unless the final one is
// there.
func (w *respWriter) write1xx(code int, h http.Header) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.isFinal {
		return nil
	}
	resp := &http.Response{StatusCode: code, ProtoMajor: 1, ProtoMinor: 1, Header: h, Request: headOnly}
	if err := resp.Write(w.bw); err != nil {
		return err
	}
	return w.bw.Flush()
}

// headOnly is the request of a response written without a body or a
// Content-Length of its own (an informational one, 204, 304).
var headOnly = &http.Request{Method: http.MethodHead}

// final ends the passing on of informational responses.
func (w *respWriter) final() {
	w.mu.Lock()
	w.isFinal = true
	w.mu.Unlock()
}

var chunkedTE = []string{"chunked"}

// respond writes resp, the answer to r, as net/http's server would: status
// text of its own, chunked when its length is unknown (or it declares
// trailers), its trailers after the body, Connection: close (a stream
// carries one exchange).
func (w *respWriter) respond(resp *http.Response, r *http.Request) error {
	resp.Status, resp.Proto, resp.ProtoMajor, resp.ProtoMinor = "", "HTTP/1.1", 1, 1
	resp.Close = true
	code := resp.StatusCode
	switch {
	case code == http.StatusNoContent || code == http.StatusNotModified:
		resp.Request = headOnly
		resp.TransferEncoding = nil
	case r.Method == http.MethodHead:
		resp.Request = r
	case resp.ContentLength < 0 || len(resp.Trailer) > 0:
		return w.respondChunked(resp, r)
	default:
		resp.Request, resp.TransferEncoding = r, nil
	}
	if resp.Body != nil && resp.Body != http.NoBody {
		resp.Body = &flushingBody{ReadCloser: resp.Body, w: w}
	}
	w.streaming = isEventStream(resp.Header)
	if err := resp.Write(w); err != nil {
		return err
	}
	return w.bw.Flush()
}

// respondChunked writes resp chunked, with the trailers it declared and
// those that came after its body.
func (w *respWriter) respondChunked(resp *http.Response, r *http.Request) error {
	declared := http.Header{}
	for k := range resp.Trailer {
		if httpguts.ValidTrailerHeader(k) {
			declared[k] = nil
		}
	}
	out := *resp
	out.Request, out.TransferEncoding, out.ContentLength, out.Trailer = r, chunkedTE, -1, declared
	out.Body = &flushingBody{ReadCloser: resp.Body, w: w, from: resp, to: declared}
	w.streaming = true
	if err := out.Write(w); err != nil {
		return err
	}
	return w.bw.Flush()
}

func isEventStream(h http.Header) bool {
	ct, _, _ := strings.Cut(h.Get("Content-Type"), ";")
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// discard drops what is buffered and not written: a response broken off.
func (w *respWriter) discard() {
	w.bw.Reset(w.sc)
	w.dirty = false
}

// close gives the buffer back; the response is written, or given up.
func (w *respWriter) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.isFinal = true
	w.bw.Reset(nil)
	streamWriters.Put(w.bw)
	w.bw = nil
}

// flushingBody is a response body that, when the response streams (its
// length unknown, or events), writes out what is buffered before its next
// read, which may wait on the local service: as the reverse proxy flushes
// such a response after every write. At its end it takes the trailers of
// from (those valid as trailers) into to.
type flushingBody struct {
	io.ReadCloser
	w      *respWriter
	from   *http.Response
	to     http.Header
	copied bool
}

func (b *flushingBody) Read(p []byte) (int, error) {
	if b.w.dirty && b.w.streaming {
		if err := b.w.bw.Flush(); err != nil {
			return 0, err
		}
		b.w.dirty = false
	}
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && b.to != nil && !b.copied {
		b.copied = true
		for k, vv := range b.from.Trailer {
			if httpguts.ValidTrailerHeader(k) {
				b.to[k] = vv
			}
		}
	}
	return n, err
}

// answerOwn ends the exchange x of r with the agent's own response for
// code.
func (a *Agent) answerOwn(w *respWriter, x *exchange, r *http.Request, code string) {
	w.writeOwn(x, r, func(rw http.ResponseWriter) {
		x.code.Store(code)
		mux.WriteVisitorErrorFor(rw, r, code, visitorHost(r))
	})
}

// writeOwn ends the exchange x of r with the answer fill makes.
func (w *respWriter) writeOwn(x *exchange, r *http.Request, fill func(http.ResponseWriter)) {
	aw := &answerWriter{h: http.Header{}}
	fill(&exchangeWriter{ResponseWriter: aw, x: x})
	aw.WriteHeader(http.StatusOK) // as the server answers a handler that wrote nothing
	resp := &http.Response{StatusCode: aw.code, ProtoMajor: 1, ProtoMinor: 1, Header: aw.h,
		ContentLength: int64(aw.body.Len()), Close: true, Request: r}
	if aw.body.Len() > 0 {
		resp.Body = io.NopCloser(&aw.body)
	}
	if resp.Write(w) == nil {
		w.bw.Flush()
	}
}

// answerWriter keeps an answer of the agent's own until it is written.
type answerWriter struct {
	h    http.Header
	code int
	body bytes.Buffer
}

func (w *answerWriter) Header() http.Header { return w.h }

func (w *answerWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}

func (w *answerWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.body.Write(p)
}
