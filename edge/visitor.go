package edge

import (
	"crypto/tls"
	"errors"
	"io"
	"net/http"
	"net/textproto"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// A visitor who stops reading a response, or stops sending a request body,
// holds a stream of its tunnel and the buffers behind it. The edge cuts
// such a visitor once it has made no progress for WriteTimeout (reading the
// response) or ReadTimeout (sending the body): both are counted afresh at
// every write and read, so a slow visitor is never cut, only a stalled one.
// And no visitor address may hold more than MaxRequestsPerIP of one
// tunnel's requests at once, so one address cannot take all of a session's
// streams.

// visitorTimeouts wraps w and r's body with the progress timeouts. The
// handler calls done when it returns: the request body may still be read
// after that (the stream's writer goroutine sends what it has left when
// the agent answered early), but the response writer is the server's no
// more. read false leaves the body's reads unbounded (a relayed connection).
func (e *Edge) visitorTimeouts(w http.ResponseWriter, r *http.Request, read bool) (_ *visitorWriter, _ *http.Request, done func()) {
	rc := http.NewResponseController(w)
	vw := &visitorWriter{ResponseWriter: w, rc: rc, timeout: e.cfg.WriteTimeout, m: e.metrics}
	if r.ProtoMajor == 1 {
		vw.tls, _ = r.Context().Value(connKey{}).(*tls.Conn)
	}
	vw.extend()
	if !read || r.Body == nil || r.Body == http.NoBody {
		return vw, r, func() {}
	}
	if r.ProtoMajor == 1 {
		vw.body = &mux.CountedBody{ReadCloser: r.Body, Size: r.ContentLength}
		r.Body = vw.body
	}
	if e.cfg.ReadTimeout > 0 {
		b := &visitorBody{ReadCloser: r.Body, rc: rc, timeout: e.cfg.ReadTimeout, m: e.metrics}
		r.Body = b
		return vw, r, b.handlerDone
	}
	return vw, r, func() {}
}

// visitorWriter moves the write deadline forward before each write, and
// over HTTP/1.1 with TLS gathers each write's records into one syscall
// (mux.Cork). It holds a response's final status until the first byte of
// its body, a flush or the handler's end: a response that breaks off
// before any of it reached the visitor can still be answered with the
// edge's code (serveRoute), where the reverse proxy would abort the
// visitor's connection or stream with nothing on it.
type visitorWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	tls     *tls.Conn        // HTTP/1.1 over TLS: the connection to cork
	body    *mux.CountedBody // an HTTP/1.1 request's body; nil: none
	m       *metrics

	started atomic.Bool // the final status is passed on
	mu      sync.Mutex  // held: the reverse proxy may flush from a timer
	held    int         // the final status held, 0 if none yet
	n1xx    int         // informational responses from the agent
}

// max1xx bounds the informational responses passed on: what an agent
// passes on from its local service (mux.Max1xx), and a 100 Continue of its
// own.
const max1xx = mux.Max1xx + 1

// got1xx, the hook of the exchange's trace, ends an exchange with more
// informational responses than max1xx. The reverse proxy's own hook has
// passed each on (through WriteHeader) before it runs.
func (w *visitorWriter) got1xx(int, textproto.MIMEHeader) error {
	if w.n1xx > max1xx {
		return errTooMany1xx
	}
	return nil
}

func (w *visitorWriter) extend() {
	if w.timeout > 0 {
		w.rc.SetWriteDeadline(time.Now().Add(w.timeout))
	}
}

func (w *visitorWriter) Write(p []byte) (int, error) {
	if !w.started.Load() {
		w.start()
	}
	w.extend()
	var uncork mux.Uncorker
	if w.tls != nil && len(p) > 16<<10 {
		uncork = mux.Cork(w.tls)
	}
	n, err := w.ResponseWriter.Write(p)
	if uncork != nil {
		if uerr := uncork.Uncork(); err == nil {
			err = uerr
		}
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		w.m.limited(limitWriteTimeout)
	}
	return n, err
}

// WriteHeader passes informational responses on but 100 Continue (the
// edge's own server sends that when the body is read, if the visitor asked
// for it), and holds a final one.
func (w *visitorWriter) WriteHeader(code int) {
	if code < 200 && code != http.StatusSwitchingProtocols {
		if w.n1xx++; w.n1xx > max1xx || code == http.StatusContinue {
			clear(w.Header())
			return
		}
		// An informational response goes on with its own fields only,
		// and never with a pool's Unsent (modifyResponse drops it from the final one).
		dropHopFields(w.Header())
		w.Header().Del(mux.UnsentHeader)
	}
	if code >= 200 {
		w.mu.Lock()
		if w.held == 0 && !w.started.Load() {
			w.held = code
		}
		w.mu.Unlock()
		return
	}
	w.extend()
	w.ResponseWriter.WriteHeader(code)
}

// dropHopFields drops the fields of one connection (RFC 9110, 7.6.1) from
// h, and those its Connection field names.
func dropHopFields(h http.Header) {
	for _, v := range h["Connection"] {
		for f := range strings.SplitSeq(v, ",") {
			h.Del(strings.TrimSpace(f))
		}
	}
	for _, k := range []string{"Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade", "Te", "Trailer"} {
		delete(h, k)
	}
}

// start passes the held status on, once. A response without a
// Content-Type goes on without one (mux.KeepUntyped): the edge's server
// would guess one from its body.
func (w *visitorWriter) start() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started.Swap(true) || w.held == 0 {
		return
	}
	w.extend()
	mux.KeepUntyped(w.Header())
	mux.CloseIfUnread(w.Header(), w.body)
	w.ResponseWriter.WriteHeader(w.held)
}

// FlushError passes the held status on and flushes, for
// http.ResponseController (the reverse proxy's streaming).
func (w *visitorWriter) FlushError() error {
	w.start()
	return w.rc.Flush()
}

// unstarted reports whether nothing of the response has been passed on,
// and if so clears what was held of it: the edge answers in its place.
func (w *visitorWriter) unstarted() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started.Load() {
		return false
	}
	w.held = 0
	clear(w.Header())
	return true
}

// Unwrap lets http.ResponseController reach the server's writer (Flush,
// Hijack for upgrades).
func (w *visitorWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// visitorBody moves the read deadline forward before each read of the
// request body, and clears it at the body's end: after it, the server
// reads the connection to notice a visitor who leaves.
type visitorBody struct {
	io.ReadCloser
	rc      *http.ResponseController
	timeout time.Duration
	m       *metrics

	mu   sync.Mutex
	done bool // the handler has returned: rc is not to be used
}

func (b *visitorBody) Read(p []byte) (int, error) {
	b.deadline(time.Now().Add(b.timeout))
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.deadline(time.Time{})
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		b.m.limited(limitReadTimeout)
		err = errors.Join(errVisitorRead, err)
	}
	return n, err
}

// deadline sets the connection's read deadline while the handler runs.
func (b *visitorBody) deadline(t time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.done {
		b.rc.SetReadDeadline(t)
	}
}

func (b *visitorBody) handlerDone() {
	b.mu.Lock()
	b.done = true
	b.mu.Unlock()
}

// visitorSlots counts each visitor address's requests in flight per tunnel.
type visitorSlots struct {
	mu sync.Mutex
	n  map[slotKey]int
}

type slotKey struct{ host, ip string }

// acquire takes one of ip's max slots for host (max zero or less: no
// limit), and returns its release.
func (v *visitorSlots) acquire(host, ip string, max int) (release func(), ok bool) {
	if max <= 0 {
		return func() {}, true
	}
	k := slotKey{host, ip}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.n[k] >= max {
		return nil, false
	}
	if v.n == nil {
		v.n = map[slotKey]int{}
	}
	v.n[k]++
	return func() {
		v.mu.Lock()
		defer v.mu.Unlock()
		if v.n[k]--; v.n[k] <= 0 {
			delete(v.n, k)
		}
	}, true
}
