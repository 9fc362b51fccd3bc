package agent

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The inspector (--inspect-addr) keeps the last requests the agent relayed,
// as they went to the local service and came back, and serves them on a
// local web page and JSON API, as ngrok's at 127.0.0.1:4040 does: what a
// webhook sent, and what the local service answered. A request whose body
// was kept whole can be replayed to the local service.

const (
	// inspectKeep is how many exchanges the inspector keeps.
	inspectKeep = 100
	// inspectBodyMax is how much of each body it keeps.
	inspectBodyMax = 64 << 10
	// inspectHeadMax bounds a kept head (the agent's own limit is larger).
	inspectHeadMax = 64 << 10
)

// Capture is one exchange as the inspector shows it.
type Capture struct {
	ID       uint64        `json:"id"`
	Start    time.Time     `json:"start"`
	Duration time.Duration `json:"duration_ns"`
	Method   string        `json:"method"`
	Path     string        `json:"path"`
	// Status is the final status sent back (0: none, the exchange broke);
	// Code the agent's own error code when it answered itself.
	Status int    `json:"status"`
	Code   string `json:"code,omitempty"`
	// Replay marks an exchange the inspector sent itself.
	Replay   bool    `json:"replay,omitempty"`
	Request  Message `json:"request"`
	Response Message `json:"response"`
}

// Message is one side of an exchange, as it crossed the agent: the head
// (request or status line and fields) and the start of the body, in its
// wire form (a chunked body keeps its chunk lines).
type Message struct {
	Head string `json:"head"`
	Body []byte `json:"body"`
	// Size counts the body's bytes, kept or not; Truncated says some were
	// not kept.
	Size      int64 `json:"size"`
	Truncated bool  `json:"truncated,omitempty"`
}

// capBuf records the first bytes written through a teeWriter.
type capBuf struct {
	mu    sync.Mutex
	b     []byte
	total int64
}

func (c *capBuf) record(p []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.total += int64(len(p))
	if room := inspectHeadMax + inspectBodyMax - len(c.b); room > 0 {
		c.b = append(c.b, p[:min(room, len(p))]...)
	}
}

func (c *capBuf) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.b, c.total = c.b[:0], 0
}

// message splits what was recorded into head and body.
func (c *capBuf) message() Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	return splitMessage(c.b, c.total)
}

func splitMessage(b []byte, total int64) Message {
	i, sep := bytes.Index(b, []byte("\r\n\r\n")), 4
	if j := bytes.Index(b, []byte("\n\n")); j >= 0 && (i < 0 || j < i) {
		i, sep = j, 2
	}
	if i < 0 {
		return Message{Head: string(b), Truncated: total > int64(len(b))}
	}
	head := b[:i+sep]
	body := bytes.Clone(b[i+sep:])
	if len(body) > inspectBodyMax {
		body = body[:inspectBodyMax]
	}
	size := total - int64(len(head))
	return Message{Head: string(head), Body: body, Size: size, Truncated: size > int64(len(body))}
}

// teeWriter writes to w and records what w took.
type teeWriter struct {
	w io.Writer
	c *capBuf
}

func (t teeWriter) Write(p []byte) (int, error) {
	n, err := t.w.Write(p)
	t.c.record(p[:n])
	return n, err
}

// capture is what a relay records for the inspector.
type capture struct {
	start     time.Time
	req, resp capBuf
}

// Inspector keeps the agent's last exchanges.
type Inspector struct {
	a *Agent

	mu   sync.Mutex
	next uint64
	ring []Capture // oldest first
}

func newInspector(a *Agent) *Inspector { return &Inspector{a: a} }

// add keeps c, dropping the oldest beyond inspectKeep, and returns its id.
func (in *Inspector) add(c Capture) uint64 {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.next++
	c.ID = in.next
	if len(in.ring) == inspectKeep {
		in.ring = append(in.ring[:0], in.ring[1:]...)
	}
	in.ring = append(in.ring, c)
	return c.ID
}

// list returns the kept exchanges, newest first.
func (in *Inspector) list() []Capture {
	in.mu.Lock()
	defer in.mu.Unlock()
	out := make([]Capture, len(in.ring))
	for i, c := range in.ring {
		out[len(in.ring)-1-i] = c
	}
	return out
}

func (in *Inspector) get(id uint64) (Capture, bool) {
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, c := range in.ring {
		if c.ID == id {
			return c, true
		}
	}
	return Capture{}, false
}

// record keeps the exchange x ran for req, once its request body has gone
// to the local service: a body still streaming when the response ended is
// kept when it is done, so that its record is whole.
func (in *Inspector) record(x *relay, req *head) {
	method, target := requestLine(req.raw)
	c := Capture{
		Start: x.cap.start, Duration: time.Since(x.cap.start),
		Method: method, Path: target, Status: x.status, Code: x.code,
		Response: x.cap.resp.message(),
	}
	if body := x.body; body != nil {
		// The head went out before the body did. req's buffer goes back
		// to its pool when the exchange returns: the goroutine reads only
		// the record.
		go func() {
			<-body // closed when the body goroutine ends, as it does with the exchange's connections
			c.Request = x.cap.req.message()
			in.add(c)
		}()
		return
	}
	c.Request = x.cap.req.message()
	if c.Request.Head == "" {
		// Nothing went to the local service (the agent answered itself):
		// show the head as it came, its body as not kept.
		c.Request = Message{Head: string(req.raw), Truncated: req.chunked || req.length > 0}
	}
	in.add(c)
}

// requestLine returns a request head's method and target.
func requestLine(raw []byte) (method, target string) {
	first, _, _ := firstLine(raw)
	m, rest, _ := bytes.Cut(first, []byte(" "))
	t, _, _ := bytes.Cut(rest, []byte(" "))
	return string(m), string(t)
}

//go:embed inspect.html
var inspectPage []byte

// Handler serves the page and its API: GET /api/requests (newest first),
// GET /api/requests/{id}, POST /api/requests/{id}/replay.
func (in *Inspector) Handler() http.Handler {
	m := http.NewServeMux()
	m.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'")
		w.Write(inspectPage)
	})
	m.HandleFunc("GET /api/requests", func(w http.ResponseWriter, r *http.Request) {
		mux.WriteJSON(w, http.StatusOK, in.list())
	})
	m.HandleFunc("GET /api/requests/{id}", func(w http.ResponseWriter, r *http.Request) {
		c, ok := in.lookup(w, r)
		if ok {
			mux.WriteJSON(w, http.StatusOK, c)
		}
	})
	m.HandleFunc("POST /api/requests/{id}/replay", func(w http.ResponseWriter, r *http.Request) {
		c, ok := in.lookup(w, r)
		if !ok {
			return
		}
		if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
			// Another web page the browser visits must not replay
			// requests to the local service.
			mux.WriteJSON(w, http.StatusForbidden, map[string]string{"error": "replay refused: asked by another site (" + site + ")"})
			return
		}
		id, err := in.replay(r.Context(), c)
		if err != nil {
			mux.WriteJSON(w, http.StatusConflict, map[string]string{"error": err.Error()})
			return
		}
		got, _ := in.get(id)
		mux.WriteJSON(w, http.StatusOK, got)
	})
	return loopbackHost(m)
}

// loopbackHost refuses requests whose Host is not a loopback address or
// localhost: a web page whose name an attacker rebinds to 127.0.0.1 must
// not read the requests kept here.
func loopbackHost(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, err := net.SplitHostPort(r.Host)
		if err != nil {
			host = r.Host
		}
		if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			mux.WriteJSON(w, http.StatusForbidden, map[string]string{"error": "the inspector answers only to a loopback address, such as http://127.0.0.1:PORT"})
			return
		}
		h.ServeHTTP(w, r)
	})
}

func (in *Inspector) lookup(w http.ResponseWriter, r *http.Request) (Capture, bool) {
	id, err := strconv.ParseUint(r.PathValue("id"), 10, 64)
	c, ok := in.get(id)
	if err != nil || !ok {
		mux.WriteJSON(w, http.StatusNotFound, map[string]string{"error": "no such request (the inspector keeps the last " + strconv.Itoa(inspectKeep) + ")"})
		return Capture{}, false
	}
	return c, true
}

// errNotWhole refuses to replay a request whose body was not kept whole.
var errNotWhole = errors.New("the request body was not kept whole (over 64 KiB, or cut short): it cannot be replayed")

// replay sends c's request again to the local service, on a connection of
// its own, and keeps the exchange as a new capture.
func (in *Inspector) replay(ctx context.Context, c Capture) (uint64, error) {
	if c.Request.Truncated || c.Request.Head == "" {
		return 0, errNotWhole
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, in.a.cfg.UpstreamDialTimeout+in.a.cfg.UpstreamTimeout)
	defer cancel()
	conn, err := in.a.pool.dial()
	if err != nil {
		return 0, fmt.Errorf("connect to the local service: %w", err)
	}
	defer conn.Close()
	if d, ok := ctx.Deadline(); ok {
		conn.SetDeadline(d)
	}
	var req, resp capBuf
	if _, err := (teeWriter{conn, &req}).Write(append([]byte(c.Request.Head), c.Request.Body...)); err != nil {
		return 0, fmt.Errorf("send to the local service: %w", err)
	}
	br := bufio.NewReader(io.TeeReader(conn, writerFunc(resp.record)))
	method, target := requestLine([]byte(c.Request.Head))
	var status int
	for {
		res, err := http.ReadResponse(br, &http.Request{Method: method})
		if err != nil {
			return 0, fmt.Errorf("read the local service's response: %w", err)
		}
		if res.StatusCode >= 200 || res.StatusCode == http.StatusSwitchingProtocols {
			status = res.StatusCode
			io.Copy(io.Discard, io.LimitReader(res.Body, inspectBodyMax+1))
			res.Body.Close()
			break
		}
	}
	return in.add(Capture{
		Start: start, Duration: time.Since(start), Method: method, Path: target, Status: status, Replay: true,
		Request: req.message(), Response: resp.message(),
	}), nil
}

// writerFunc records what a TeeReader reads.
type writerFunc func([]byte)

func (f writerFunc) Write(p []byte) (int, error) { f(p); return len(p), nil }

// serve serves in on ln until ctx ends.
func (in *Inspector) serve(ctx context.Context, ln net.Listener) {
	srv := &http.Server{Handler: in.Handler(), ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	srv.Serve(ln)
}
