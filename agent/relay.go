package agent

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The agent relays each of the edge's streams, one HTTP/1.1 exchange, to a
// pooled keep-alive connection to the local service. The edge has already
// parsed and rewritten the visitor's request (the agent sends its head on
// unchanged, so Host and X-Forwarded-* arrive as the edge set them), and the
// edge parses the response again before a visitor sees it; in between the
// agent reads only what frames each body, so that it knows where the
// exchange ends and the local connection can serve the next one. It runs
// no HTTP server and no reverse proxy: one goroutine per exchange, plus
// one while a request body streams in, and none for the response.

const (
	// maxRequestHead bounds a request head from the edge (the edge's
	// visitors are held to 64 KiB).
	maxRequestHead = 1 << 20
	// maxHeaderBytes bounds a response head of the local service, 1xx
	// responses included, as http.Transport does.
	maxHeaderBytes = 10 << 20
	// maxWriteWait bounds the wait for a request body still being
	// written when its response has ended (http.Transport's figure).
	maxWriteWait = 50 * time.Millisecond
	// watchAfter is how long an exchange without a request body runs
	// before a goroutine starts watching its stream, so that the local
	// request is cut short when the edge gives the exchange up (the
	// visitor left, a timeout). Most exchanges end sooner and need none.
	watchAfter = 100 * time.Millisecond
)

var (
	errTooMany1xx      = errors.New("agent: too many informational responses from the local service")
	errUnwantedUpgrade = errors.New("agent: the local service switched protocols unasked")
	errAbandoned       = errors.New("agent: the edge gave the exchange up")
)

// streamReaders read request heads and bodies from the edge's streams.
var streamReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}

// headBufs hold request heads.
var headBufs = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

// putHeadBuf returns a head buffer to its pool, unless a large head made
// it grow.
func putHeadBuf(b *[]byte) {
	if cap(*b) <= 64<<10 {
		headBufs.Put(b)
	}
}

// relay is one exchange.
type relay struct {
	a    *Agent
	st   net.Conn      // the edge's stream
	br   *bufio.Reader // reads st
	done func()        // the exchange no longer holds up a drain

	mu     sync.Mutex
	state  relayState
	lc     *localConn // the current local connection
	lcDone bool       // lc's response was read whole: abort leaves it to finish

	body    chan struct{} // closed when the request body is copied; nil: none in flight
	bodyErr error

	status int    // the final status sent to the edge; 0: none yet
	code   string // the agent's own error code, when it answered for the local service

	cap *capture // what the inspector keeps; nil without one
}

type relayState uint8

const (
	relayRunning relayState = iota
	relayEnded              // the exchange is over; lc is the relay's to pool or close
	relayAborted            // lc and st are closed
)

// serveStream runs one exchange on st, calling done when it no longer
// holds up a drain (at its end, or when it turns into an upgraded
// connection).
func (a *Agent) serveStream(st net.Conn, done func()) {
	x := &relay{a: a, st: st, done: done}
	x.br = streamReaders.Get().(*bufio.Reader)
	x.br.Reset(st)
	hb := headBufs.Get().(*[]byte)
	defer func() {
		if x.done != nil {
			x.done()
		}
		if x.body == nil {
			// Nothing else reads br: it goes back to its pool.
			x.br.Reset(nil)
			streamReaders.Put(x.br)
		}
		putHeadBuf(hb)
	}()
	st.SetReadDeadline(time.Now().Add(a.cfg.DialTimeout))
	raw, err := readHead(x.br, (*hb)[:0], maxRequestHead)
	*hb = raw
	st.SetReadDeadline(time.Time{})
	var req head
	if err == nil {
		req, err = parseRequest(raw)
	}
	if err != nil {
		if err != io.EOF {
			a.log.Debug("bad request from the edge", "err", err)
		}
		st.Close()
		return
	}
	if a.hostHeader != "" {
		nb := headBufs.Get().(*[]byte)
		*nb = setHost((*nb)[:0], raw, a.hostHeader)
		putHeadBuf(hb)
		hb, req.raw = nb, *nb
	}
	x.exchange(&req)
}

// exchange sends req to the local service and its response back.
func (x *relay) exchange(req *head) {
	if x.a.cfg.LogRequests {
		defer x.logRequest(req, time.Now())
	}
	out := outBuf{w: x.st, buf: getBuf()}
	if x.a.inspect != nil {
		x.cap = &capture{start: time.Now()}
		out.w = teeWriter{x.st, &x.cap.resp}
		defer x.a.inspect.record(x, req)
	}
	defer func() { putBuf(out.buf) }()
	if x.a.auth != nil && !x.a.auth.allows(req.raw) {
		x.answer(req, &out, mux.CodeBasicAuthRequired)
		return
	}
	var watch *time.Timer
	defer func() {
		if watch != nil {
			watch.Stop()
		}
	}()
	for retry := true; ; retry = false {
		lc, reused, err := x.a.pool.conn()
		if err == nil && !x.setConn(lc) {
			lc.Close()
			return // the edge gave up while this connection was made
		}
		if err == nil {
			err = x.send(lc, req)
		}
		if err == nil && watch == nil && x.body == nil && !req.upgrade {
			watch = time.AfterFunc(x.a.watchAfter, x.watch)
		}
		var resp head
		if err == nil {
			resp, err = x.receive(lc, req, &out)
		}
		if err == nil {
			x.finish(lc, req, &resp, &out)
			return
		}
		// A pooled connection the local service closed just before the
		// request: send a request without a body once more, on a new
		// connection, as http.Transport does.
		if reused && retry && lc.nread == 0 && !out.final && req.replay && closedByPeer(err) && x.running() {
			lc.Close()
			continue
		}
		x.failed(req, &out, err)
		return
	}
}

// setConn makes lc the exchange's local connection, unless it was given up.
func (x *relay) setConn(lc *localConn) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.lc = lc
	return x.state == relayRunning
}

func (x *relay) running() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.state == relayRunning
}

// abort ends a running exchange at once: both connections are closed, so
// every read and write of it returns; lc is left to finish if its response
// was read whole.
func (x *relay) abort() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.state != relayRunning {
		return
	}
	x.state = relayAborted
	if x.lc != nil && !x.lcDone {
		x.lc.Close()
	}
	x.st.Close()
}

// localDone records that lc's response was read whole; false if the
// exchange was aborted before.
func (x *relay) localDone() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.lcDone = x.state == relayRunning
	return x.lcDone
}

// end marks a running exchange over; false if it was aborted.
func (x *relay) end() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.state != relayRunning {
		return false
	}
	x.state = relayEnded
	return true
}

// watch waits for the edge to end the stream or break it, and aborts the
// exchange if that happens before it ended. The edge sends nothing after
// the request, so any read that returns says so.
func (x *relay) watch() {
	var b [1]byte
	x.st.Read(b[:])
	x.abort()
}

// send writes the request head to lc, with as much of the body as has
// arrived; the rest of the body streams on a goroutine while the response
// is read, as the local service may answer before it has read it all.
func (x *relay) send(lc *localConn, req *head) error {
	lc.nread = 0
	if x.cap != nil {
		x.cap.req.reset() // a second attempt is the one that counts
	}
	w := x.toLocal(lc)
	if !req.chunked && req.length <= 0 {
		_, err := w.Write(req.raw)
		return err
	}
	if !req.chunked && int64(x.br.Buffered()) >= req.length {
		body, _ := x.br.Peek(int(req.length))
		msg := append(req.raw, body...)
		req.raw = msg[:len(req.raw)]
		x.br.Discard(len(body))
		_, err := w.Write(msg)
		return err
	}
	if _, err := w.Write(req.raw); err != nil {
		return err
	}
	x.body = make(chan struct{})
	go x.sendBody(lc, req)
	return nil
}

// toLocal is where the request goes: lc, through the inspector's record
// when there is one (which a second attempt starts anew).
func (x *relay) toLocal(lc *localConn) io.Writer {
	if x.cap == nil {
		return lc.Conn
	}
	return teeWriter{lc.Conn, &x.cap.req}
}

// sendBody copies the request body from the stream to lc, then watches
// the stream as watch does.
func (x *relay) sendBody(lc *localConn, req *head) {
	o := outBuf{w: x.toLocal(lc), buf: getBuf()}
	var err error
	if req.chunked {
		err = o.copyChunked(x.br)
	} else {
		err = o.copyN(x.br, req.length)
	}
	if err == nil {
		err = o.flush()
	}
	putBuf(o.buf)
	x.bodyErr = err
	close(x.body)
	if req.upgrade {
		return // the upgraded copy reads the stream next
	}
	if err != nil {
		// The exchange cannot end well: the edge's side broke, or the
		// local service stopped reading (it may have answered early,
		// as the response read sees).
		if !errors.Is(err, errWrite) {
			x.abort()
			return
		}
		lc.Close()
	}
	x.watch()
}

// receive reads the local service's response and writes it to the
// stream: informational responses at once, then the final head and body.
func (x *relay) receive(lc *localConn, req *head, out *outBuf) (head, error) {
	timeout := x.a.cfg.UpstreamTimeout
	if timeout > 0 {
		lc.SetReadDeadline(time.Now().Add(timeout))
	}
	var resp head
	var start int
	for n := 0; ; n++ {
		if n > mux.Max1xx {
			return resp, errTooMany1xx
		}
		start = len(out.buf)
		buf, err := readHead(lc.br, out.buf, maxHeaderBytes)
		out.buf = buf
		if err == nil {
			resp, err = parseResponse(buf[start:])
		}
		if err != nil {
			out.buf = out.buf[:start]
			return resp, err
		}
		if resp.status >= 200 || resp.status == 101 {
			break
		}
		// 1xx: passed on at once (100 Continue lets the visitor send
		// its body).
		if err := out.flush(); err != nil {
			return resp, errors.Join(errAbandoned, err)
		}
	}
	if timeout > 0 {
		lc.SetReadDeadline(time.Time{})
	}
	if resp.status == 101 {
		if !req.upgrade {
			out.buf = out.buf[:start]
			return resp, errUnwantedUpgrade
		}
		out.final, x.status = true, resp.status
		return resp, out.flush()
	}
	out.final, x.status = true, resp.status
	var err error
	switch {
	case resp.bodyless(req):
	case resp.chunked:
		err = out.copyChunked(lc.br)
	case resp.length >= 0:
		err = out.copyN(lc.br, resp.length)
	default:
		// No length: the body runs to the end of the connection.
		resp.close = true
		err = out.copyEOF(lc.br)
	}
	return resp, err // the rest of out goes in finish
}

// finish ends an exchange whose response was read whole: the rest of it
// goes to the stream, the stream is closed, and lc is pooled if both sides
// left it clean. lc is done with first, so that the edge ending the stream
// once it has the response (which a watcher sees) cannot cost it.
func (x *relay) finish(lc *localConn, req, resp *head, out *outBuf) {
	if resp.status == 101 {
		x.upgraded(lc)
		return
	}
	if !x.localDone() {
		return // aborted before: lc is closed
	}
	keep := !resp.close && !req.close
	if err := out.flush(); err != nil {
		x.abort() // the edge is gone; lc is still clean
	}
	if x.body != nil {
		t := time.NewTimer(maxWriteWait)
		select {
		case <-x.body:
			keep = keep && x.bodyErr == nil
		case <-t.C:
			keep = false
		}
		t.Stop()
		select {
		case <-x.body:
			x.body = nil // br is free again
		default:
		}
	}
	if x.end() {
		x.st.Close()
	}
	if keep {
		x.a.pool.put(lc)
	} else {
		lc.Close()
	}
}

// upgraded copies both ways after a 101 until either side ends, then
// closes both. The exchange no longer holds up a drain.
func (x *relay) upgraded(lc *localConn) {
	if x.body != nil {
		<-x.body
	}
	x.done()
	x.done = nil
	x.end()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		copyConn(lc.Conn, x.br)
		lc.Close()
		x.st.Close()
	}()
	copyConn(x.st, lc.br)
	lc.Close()
	x.st.Close()
	wg.Wait()
	x.body = nil
}

// failed answers the visitor with an error code if no final response went
// out yet, and otherwise cuts the exchange short.
func (x *relay) failed(req *head, out *outBuf, err error) {
	if out.final || !x.running() {
		x.abort()
		return
	}
	code := upstreamCode(err)
	x.a.localFailed(code, err)
	x.answer(req, out, code)
}

// answer ends a running exchange with the agent's own response: code's
// visitor error, in place of anything the local service would have sent.
func (x *relay) answer(req *head, out *outBuf, code string) {
	x.status, x.code = mux.VisitorStatus(code), code
	out.buf = mux.AppendVisitorError(out.buf[:0], code, string(req.host()))
	out.flush()
	if x.end() {
		x.mu.Lock()
		if x.lc != nil {
			x.lc.Close()
		}
		x.mu.Unlock()
		x.st.Close()
	}
}

// logRequest logs the exchange of req, which started at start.
func (x *relay) logRequest(req *head, start time.Time) {
	method, target := requestLine(req.raw)
	args := []any{"method", method, "path", target, "status", x.status}
	switch {
	case x.code != "":
		args = append(args, "code", x.code)
	case x.status == 0:
		args = append(args, "note", "the exchange ended before a response (the visitor left, or the tunnel broke)")
	}
	x.a.log.Info("request", append(args, "duration", time.Since(start).Round(10*time.Microsecond))...)
}

// upstreamCode maps a failed exchange with the local service to a visitor
// error code.
func upstreamCode(err error) string {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() && !isDial(err) {
		return mux.CodeUpstreamTimeout
	}
	return mux.CodeUpstreamUnreachable
}

func isDial(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// host returns the host a visitor asked for, for error messages: the
// X-Forwarded-Host the edge set, else the Host field (which --host-header
// may have replaced).
func (h *head) host() []byte {
	var host, fwd []byte
	_, rest, _ := firstLine(h.raw)
	eachHeader(rest, func(name, value []byte) error {
		switch {
		case asciiEqualFold(name, "Host"):
			host = value
		case asciiEqualFold(name, "X-Forwarded-Host") && fwd == nil:
			fwd = value
		}
		return nil
	})
	if fwd != nil {
		return fwd
	}
	return host
}

// copyConn copies src to dst until either fails, through a pooled buffer.
func copyConn(dst io.Writer, src io.Reader) {
	buf := mux.BufferPool{}.Get()
	io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, buf)
	mux.BufferPool{}.Put(buf)
}

// An outBuf starts small: a head and a small body fit in smallOut, and
// many exchanges at once hold no more. A body that streams moves it to a
// 32 KiB copy buffer (see readSome).
const smallOut = 4 << 10

var smallOutBufs = sync.Pool{New: func() any { return make([]byte, 0, smallOut) }}

func getBuf() []byte { return smallOutBufs.Get().([]byte) }

// putBuf returns an outBuf's buffer to its pool; one that grew for a
// large head is dropped.
func putBuf(b []byte) {
	switch cap(b) {
	case smallOut:
		smallOutBufs.Put(b[:0])
	case 32 << 10:
		mux.BufferPool{}.Put(b[:cap(b)])
	}
}

// errWrite marks a failed write of an outBuf (the reads are the other
// side's).
var errWrite = errors.New("agent: write failed")

// outBuf gathers what goes to one side so that a head and a small body
// leave in one write; it is flushed before any read that would wait, so
// nothing sits in it while the other side is silent (server-sent events).
type outBuf struct {
	w     io.Writer
	buf   []byte
	final bool // a final response head is in buf or was written
}

func (o *outBuf) flush() error {
	if len(o.buf) == 0 {
		return nil
	}
	_, err := o.w.Write(o.buf)
	o.buf = o.buf[:0]
	if err != nil {
		return errors.Join(errWrite, err)
	}
	return nil
}

func (o *outBuf) write(p []byte) error {
	for len(p) > 0 {
		if len(o.buf) == cap(o.buf) {
			if err := o.flush(); err != nil {
				return err
			}
		}
		n := copy(o.buf[len(o.buf):cap(o.buf)], p)
		o.buf = o.buf[:len(o.buf)+n]
		p = p[n:]
	}
	return nil
}

// readSome reads once from src into the free part of buf (at most n
// bytes), flushing first if the read would wait. A body longer than a
// small buffer that has to be waited for moves to a copy buffer.
func (o *outBuf) readSome(src *bufio.Reader, n int64) (int, error) {
	if src.Buffered() == 0 || len(o.buf) == cap(o.buf) {
		if err := o.flush(); err != nil {
			return 0, err
		}
		if cap(o.buf) == smallOut && n > smallOut {
			putBuf(o.buf)
			o.buf = mux.BufferPool{}.Get()[:0]
		}
	}
	room := o.buf[len(o.buf):cap(o.buf)]
	if int64(len(room)) > n {
		room = room[:n]
	}
	m, err := src.Read(room)
	o.buf = o.buf[:len(o.buf)+m]
	return m, err
}

// copyN copies exactly n bytes from src.
func (o *outBuf) copyN(src *bufio.Reader, n int64) error {
	for n > 0 {
		m, err := o.readSome(src, n)
		n -= int64(m)
		if err != nil && n > 0 {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
	}
	return nil
}

// copyEOF copies src to its end.
func (o *outBuf) copyEOF(src *bufio.Reader) error {
	for {
		_, err := o.readSome(src, 1<<62)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// maxChunkLine bounds a chunk-size line and each trailer line.
const maxChunkLine = 4 << 10

// copyChunked copies a chunked body, chunk framing and trailers included,
// from src to its last chunk's final blank line.
func (o *outBuf) copyChunked(src *bufio.Reader) error {
	for {
		line, err := o.line(src)
		if err != nil {
			return err
		}
		size, err := chunkSize(line)
		if err != nil {
			return err
		}
		if err := o.write(line); err != nil {
			return err
		}
		if size == 0 {
			return o.trailers(src)
		}
		if err := o.copyN(src, size); err != nil {
			return err
		}
		if line, err = o.line(src); err != nil {
			return err
		}
		if !bytes.Equal(line, []byte("\r\n")) {
			return errBadChunk
		}
		if err := o.write(line); err != nil {
			return err
		}
	}
}

// trailers copies the trailer section through its blank line.
func (o *outBuf) trailers(src *bufio.Reader) error {
	for total := 0; ; {
		line, err := o.line(src)
		if err != nil {
			return err
		}
		if total += len(line); total > maxHeaderBytes {
			return errHeadTooLarge
		}
		if err := o.write(line); err != nil {
			return err
		}
		if len(line) <= 2 && (len(line) == 1 || line[0] == '\r') {
			return nil
		}
	}
}

// line reads one line (at most maxChunkLine bytes) from src, flushing
// first if it has not arrived whole. The slice is valid until the next
// read of src.
func (o *outBuf) line(src *bufio.Reader) ([]byte, error) {
	if b, _ := src.Peek(src.Buffered()); bytes.IndexByte(b, '\n') < 0 {
		if err := o.flush(); err != nil {
			return nil, err
		}
	}
	line, err := src.ReadSlice('\n')
	switch {
	case err == bufio.ErrBufferFull:
		return nil, errBadChunk // longer than maxChunkLine (src's buffer is 4 KiB)
	case err == io.EOF:
		return nil, io.ErrUnexpectedEOF
	case err != nil:
		return nil, err
	}
	return line, nil
}
