package edge

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"

	"github.com/ngstone/ngstone/mux"
)

// The direct path: a visitor request for a session of this edge is written
// to a new stream of that session and its response copied back, without
// httputil.ReverseProxy, which clones every request, its headers and its
// URL, and copies every response header once more. It does what the
// reverse proxy did on this path: hop-by-hop headers dropped both ways,
// X-Forwarded-* set (or, for a request another edge forwarded, kept),
// bodies streaming both ways at once, chunked bodies when the length is
// unknown, trailers, responses of unknown length flushed as they come, and
// a response cut short aborted rather than ended. Upgrades, and requests
// for another edge, still go through the reverse proxy.

// hopHeaders are the hop-by-hop header fields (RFC 9110, 7.6.1) that
// never cross the edge, as httputil.ReverseProxy drops them.
var hopHeaders = map[string]bool{
	"Connection":          true,
	"Proxy-Connection":    true,
	"Keep-Alive":          true,
	"Proxy-Authenticate":  true,
	"Proxy-Authorization": true,
	"Te":                  true,
	"Trailer":             true,
	"Transfer-Encoding":   true,
	"Upgrade":             true,
}

// forwardedHeaders are set by the edge that met the visitor.
var forwardedHeaders = map[string]bool{
	"X-Forwarded-For":   true,
	"X-Forwarded-Host":  true,
	"X-Forwarded-Proto": true,
}

// serveDirect relays r to rt's session. forwarded: r came from another
// edge of the cluster, whose X-Forwarded-* it keeps.
func (e *Edge) serveDirect(w http.ResponseWriter, r *http.Request, rt route, forwarded bool) {
	conn, err := e.openStream(rt)
	if err != nil {
		e.visitorFailed(w, r, rt.hostname, err)
		return
	}
	x := &exchange{conn: conn, visitor: w}
	hasBody := r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0
	resp, wrote, err := x.start(r, hasBody, func() error { return writeDirect(conn, r, forwarded, hasBody) }, e.cfg.TunnelTimeout)
	if err != nil {
		select {
		case werr := <-wrote:
			// A body over the limit ends the exchange: say so.
			if errors.As(werr, new(*http.MaxBytesError)) {
				err = werr
			}
		default: // no body, or still being read from the visitor
		}
		e.visitorFailed(w, r, rt.hostname, err)
		return
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// Not asked for (upgrades take the reverse proxy): refuse it.
		resp.Body.Close()
		e.visitorFailed(w, r, rt.hostname, errors.New("edge: the agent switched protocols unasked"))
		return
	}
	h := w.Header()
	dropHopHeaders(resp.Header)
	if forwarded {
		resp.Header.Del(routeHeader) // an agent's response must not pose as the owner's refusal
	}
	for k, vv := range resp.Header {
		h[k] = vv
	}
	if len(resp.Trailer) > 0 {
		names := make([]string, 0, len(resp.Trailer))
		for k := range resp.Trailer {
			names = append(names, k)
		}
		h["Trailer"] = []string{strings.Join(names, ", ")}
	}
	w.WriteHeader(resp.StatusCode)
	err = copyResponse(w, r, resp.Body, resp.ContentLength == -1 || isEventStream(resp.Header))
	resp.Body.Close()
	if err != nil {
		// The response cannot end well: abort it, so that the visitor
		// sees a broken response rather than a short one.
		e.log.Debug("visitor response cut short", "hostname", rt.hostname, "err", err)
		panic(http.ErrAbortHandler)
	}
	for k, vv := range resp.Trailer {
		h[http.TrailerPrefix+k] = vv
	}
}

// writeDirect writes r's head, and its body when withBody, to the stream.
func writeDirect(conn net.Conn, r *http.Request, forwarded, withBody bool) error {
	bw := requestWriters.Get().(*bufio.Writer)
	bw.Reset(conn)
	defer func() {
		bw.Reset(nil)
		requestWriters.Put(bw)
	}()
	chunked := withBody && r.ContentLength < 0
	writeHead(bw, r, forwarded, chunked, withBody)
	if withBody {
		var err error
		if chunked {
			cw := httputil.NewChunkedWriter(bw)
			if _, err = io.Copy(cw, r.Body); err == nil {
				cw.Close()
				err = writeTrailers(bw, r.Trailer)
			}
		} else {
			var n int64
			n, err = io.Copy(bw, r.Body)
			if err == nil && n != r.ContentLength {
				err = io.ErrUnexpectedEOF
			}
		}
		if err != nil {
			return err
		}
	}
	return bw.Flush()
}

// writeHead writes the request line and header section of r. The body's
// framing is the edge's to write: the visitor's Content-Length (which
// net/http leaves in r.Header) is not copied, as a second one would make
// many servers refuse the request.
func writeHead(bw *bufio.Writer, r *http.Request, forwarded, chunked, withBody bool) {
	bw.WriteString(r.Method)
	bw.WriteByte(' ')
	bw.WriteString(r.URL.RequestURI())
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(r.Host)
	bw.WriteString("\r\n")
	connection := r.Header["Connection"]
	for k, vv := range r.Header {
		if hopHeaders[k] || k == "Content-Length" || (!forwarded && forwardedHeaders[k]) || namedIn(connection, k) {
			continue
		}
		for _, v := range vv {
			writeField(bw, k, v)
		}
	}
	if !forwarded {
		if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
			writeField(bw, "X-Forwarded-For", ip)
		}
		writeField(bw, "X-Forwarded-Host", r.Host)
		proto := "http"
		if r.TLS != nil {
			proto = "https"
		}
		writeField(bw, "X-Forwarded-Proto", proto)
	}
	if namedIn(r.Header["Te"], "trailers") {
		writeField(bw, "Te", "trailers")
	}
	switch {
	case chunked:
		writeField(bw, "Transfer-Encoding", "chunked")
	case withBody:
		writeField(bw, "Content-Length", strconv.FormatInt(r.ContentLength, 10))
	}
	bw.WriteString("\r\n")
}

func writeField(bw *bufio.Writer, k, v string) {
	bw.WriteString(k)
	bw.WriteString(": ")
	bw.WriteString(v)
	bw.WriteString("\r\n")
}

// writeTrailers ends a chunked body: its trailer fields, then a blank line.
func writeTrailers(bw *bufio.Writer, trailer http.Header) error {
	for k, vv := range trailer {
		if hopHeaders[k] {
			continue
		}
		for _, v := range vv {
			writeField(bw, k, v)
		}
	}
	_, err := bw.WriteString("\r\n")
	return err
}

// namedIn reports whether the comma-separated values list token, in any
// case.
func namedIn(values []string, token string) bool {
	for _, v := range values {
		for t := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// dropHopHeaders removes the hop-by-hop fields and those Connection names.
func dropHopHeaders(h http.Header) {
	for _, v := range h["Connection"] {
		for t := range strings.SplitSeq(v, ",") {
			if t = strings.TrimSpace(t); t != "" {
				h.Del(t)
			}
		}
	}
	for k := range hopHeaders {
		delete(h, k)
	}
}

func isEventStream(h http.Header) bool {
	ct, _, _ := strings.Cut(h.Get("Content-Type"), ";")
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// connKey is the context key of a visitor request's connection.
type connKey struct{}

// copyResponse copies body to w through a pooled buffer, flushing after
// every write when flush is set (a body of unknown length, server-sent
// events), so nothing waits in the edge for more to come. Otherwise, on an
// HTTP/1 connection over TLS, the records of each write leave in one
// syscall (mux.Cork) instead of one per 16 KiB. An error is a failed read
// of the body or a failed write to the visitor; either ends the response.
func copyResponse(w http.ResponseWriter, r *http.Request, body io.Reader, flush bool) error {
	buf := mux.BufferPool{}.Get()
	defer mux.BufferPool{}.Put(buf)
	f, _ := w.(http.Flusher)
	conn, _ := r.Context().Value(connKey{}).(net.Conn)
	cork := !flush && r.ProtoMajor == 1 && conn != nil
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			var uncork mux.Uncorker
			if cork {
				uncork = mux.Cork(conn)
				cork = uncork != nil
			}
			_, err := w.Write(buf[:n])
			if uncork != nil {
				if uerr := uncork.Uncork(); err == nil {
					err = uerr
				}
			}
			if err != nil {
				return err
			}
			if flush && f != nil {
				f.Flush()
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

// openStream opens a new stream on rt's session, counted against the
// session's limit of concurrent requests.
func (e *Edge) openStream(rt route) (net.Conn, error) {
	s := rt.s
	if s.isClosed() || !s.holds(rt.hostname, rt.generation) {
		return nil, errNoRoute
	}
	if !s.streams.TryAdd(e.cfg.MaxStreamsPerSession) {
		return nil, errTooManyStreams
	}
	st, err := s.ys.OpenStream()
	if err != nil {
		s.streams.Done()
		return nil, errors.Join(errNoRoute, err)
	}
	return &trackedConn{Conn: st, done: s.streams.Done}, nil
}
