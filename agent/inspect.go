package agent

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The inspector (--inspect-addr) keeps the last requests the agent relayed,
// as they went to the local service and came back, and serves them on a
// local web page and JSON API, as ngrok's at 127.0.0.1:4040 does: what a
// webhook sent, and what the local service answered. A request whose body
// was kept whole can be replayed to the local service. A TCP or TLS
// tunnel's connections are listed among them from when they open, with
// their bytes counted as they cross and none kept; they are never
// replayed.

const (
	// inspectKeep is how many exchanges the inspector keeps.
	inspectKeep = 100
	// inspectBodyMax is how much of each body it keeps.
	inspectBodyMax = 64 << 10
)

// Capture is one exchange as the inspector shows it.
type Capture struct {
	ID       uint64        `json:"id"`
	Start    time.Time     `json:"start"`
	Duration time.Duration `json:"duration_ns"`
	Method   string        `json:"method"`
	Path     string        `json:"path"`
	// Tunnel is the name of the tunnel the exchange came for
	// ("command_line" for the command line's; empty for none of the
	// agent's).
	Tunnel string `json:"tunnel,omitempty"`
	// Status is the final status sent back (0: none, the exchange broke);
	// Code the agent's own error code when it answered itself.
	Status int    `json:"status"`
	Code   string `json:"code,omitempty"`
	// Replay marks an exchange the inspector sent itself: ReplayOf is the
	// exchange it sent again, Edited says its request was edited first.
	Replay   bool   `json:"replay,omitempty"`
	ReplayOf uint64 `json:"replay_of,omitempty"`
	Edited   bool   `json:"edited,omitempty"`
	// GRPCStatus is a gRPC call's status code as its client got it: from
	// the local server's trailers, or the agent's own answer when it
	// answered the call itself (the local server down, a password asked
	// for). Its bodies are kept as they came, not decoded.
	GRPCStatus string `json:"grpc_status,omitempty"`
	// Upgrade is the protocol a 101 switched the connection to
	// (websocket); then Request.Size and Response.Size count the bytes
	// that crossed each way after the switch, none of them kept, and
	// Duration is how long the connection stayed open.
	Upgrade  string  `json:"upgrade,omitempty"`
	Request  Message `json:"request"`
	Response Message `json:"response"`
	// Conn is set for a TCP or TLS tunnel's connection (Method TCP or
	// TLS), listed from when it opens: Duration is how long it has been
	// open so far, and Request and Response are empty.
	Conn *Conn `json:"conn,omitempty"`
	// Refused is why the edge answered the request itself (Code), which
	// therefore never reached the agent: a webhook whose signature did
	// not verify. Its Request and Response are empty.
	Refused string `json:"refused,omitempty"`

	live *connMeter // a connection's, read when listed
}

// Conn is a TCP or TLS tunnel's connection as the inspector shows it.
type Conn struct {
	Proto     string `json:"proto"`      // tcp, or tls (passed through by SNI)
	PublicURL string `json:"public_url"` // the tunnel's when the connection came
	Visitor   string `json:"visitor"`    // the visitor's HOST:PORT, as the edge saw it
	// BytesIn and BytesOut count what came from the visitor and what went
	// to it so far.
	BytesIn  int64 `json:"bytes_in"`
	BytesOut int64 `json:"bytes_out"`
	Open     bool  `json:"open"`
	// End is how a closed connection ended, by the side that ended first:
	// visitor_closed, local_closed, or local_unreachable (the agent
	// could not connect to the local service).
	End string `json:"end,omitempty"`
}

// Message is one side of an exchange, as it crossed the agent: the head
// (request or status line and fields) and the start of the body (decoded
// from its transfer framing).
type Message struct {
	Head string `json:"head"`
	Body []byte `json:"body"`
	// Size counts the body's bytes, kept or not; Truncated says some were
	// not kept, or the body did not end.
	Size      int64 `json:"size"`
	Truncated bool  `json:"truncated,omitempty"`

	head *head // what Head is written from, until it is
}

// filled returns m with its Head written.
func (m Message) filled() Message {
	if m.head != nil {
		m.Head, m.head = m.head.String(), nil
	}
	return m
}

// head is a head as it crossed the agent, written in HTTP/1.1 form only
// when the inspector is read (at a person's pace), not on the request
// path. Its fields are copied when it is taken.
type head struct {
	line   string // the request's method and target, or the response's version and status
	host   string // a request's
	req    bool   // a request's head, which has a Host line
	fields http.Header
	once   sync.Once
	s      string
}

func (h *head) String() string {
	h.once.Do(func() {
		var b strings.Builder
		b.WriteString(h.line)
		b.WriteString("\r\n")
		if h.req {
			b.WriteString("Host: " + h.host + "\r\n")
		}
		h.fields.Write(&b)
		b.WriteString("\r\n")
		h.s = b.String()
		h.fields = nil
	})
	return h.s
}

// capBuf records a head and the first bytes of its body.
type capBuf struct {
	mu    sync.Mutex
	head  *head
	b     []byte
	total int64
	eof   bool // the body was read to its end
	// upgraded counts what crosses an upgraded connection, keeping none.
	upgraded atomic.Int64
}

func (c *capBuf) record(p []byte, eof bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.total += int64(len(p))
	if room := inspectBodyMax - len(c.b); room > 0 {
		c.b = append(c.b, p[:min(room, len(p))]...)
	}
	c.eof = c.eof || eof
}

// reset starts the record over with head: a request sent again (the
// transport's retry on a fresh connection) is the one that counts.
func (c *capBuf) reset(head *head, bodyless bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.head, c.b, c.total, c.eof = head, c.b[:0], 0, bodyless
}

func (c *capBuf) message() Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.head == nil {
		return Message{}
	}
	return Message{head: c.head, Body: bytes.Clone(c.b), Size: c.total + c.upgraded.Load(), Truncated: !c.eof || c.total > int64(len(c.b))}
}

// teeBody records what is read of a body.
type teeBody struct {
	io.ReadCloser
	c *capBuf
}

func (t *teeBody) Read(p []byte) (int, error) {
	n, err := t.ReadCloser.Read(p)
	t.c.record(p[:n], err == io.EOF)
	return n, err
}

// capture is what an exchange records for the inspector: the request as it
// went to the local service, and the response as it came back.
type capture struct {
	req, resp capBuf
	localResp *http.Response // for its trailers, once it has ended
	upgrade   string         // the protocol a 101 switched to
}

// request records req, the request to the local service.
func (c *capture) request(req *http.Request) {
	bodyless := req.Body == nil || req.Body == http.NoBody
	c.req.reset(requestHead(req), bodyless)
	if !bodyless {
		req.Body = &teeBody{ReadCloser: req.Body, c: &c.req}
	}
}

// response records resp, the local service's response.
func (c *capture) response(resp *http.Response) {
	c.localResp = resp
	bodyless := resp.Body == nil || resp.Body == http.NoBody
	c.resp.reset(responseHead(resp), bodyless)
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The connection's bytes are counted (upgradedBody), none kept.
		c.upgrade = resp.Header.Get("Upgrade")
		c.resp.record(nil, true)
		return
	}
	if !bodyless {
		resp.Body = &teeBody{ReadCloser: resp.Body, c: &c.resp}
	}
}

// requestHead is req's head, to be written in HTTP/1.1 form.
func requestHead(req *http.Request) *head {
	h := &head{line: req.Method + " " + req.URL.RequestURI() + " HTTP/1.1", host: req.Host, req: true, fields: req.Header.Clone()}
	switch {
	case req.ContentLength > 0:
		h.fields.Set("Content-Length", strconv.FormatInt(req.ContentLength, 10))
	case req.ContentLength < 0 && req.Body != nil && req.Body != http.NoBody:
		h.fields.Set("Transfer-Encoding", "chunked")
	}
	return h
}

// responseHead is resp's head, to be written in HTTP/1.1 form.
func responseHead(resp *http.Response) *head {
	h := &head{line: "HTTP/" + strconv.Itoa(resp.ProtoMajor) + "." + strconv.Itoa(resp.ProtoMinor) + " " + resp.Status,
		fields: resp.Header.Clone()}
	if resp.ContentLength >= 0 {
		h.fields.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	if len(resp.TransferEncoding) > 0 {
		h.fields.Set("Transfer-Encoding", strings.Join(resp.TransferEncoding, ", "))
	}
	return h
}

// Inspector keeps the agent's last exchanges.
type Inspector struct {
	a *Agent

	mu   sync.Mutex
	next uint64
	ring ring[Capture]
}

func newInspector(a *Agent) *Inspector {
	return &Inspector{a: a, ring: ring[Capture]{size: inspectKeep}}
}

// add keeps c, over the oldest beyond inspectKeep, and returns its id.
func (in *Inspector) add(c Capture) uint64 {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.next++
	c.ID = in.next
	in.ring.add(c)
	return c.ID
}

// List returns the kept exchanges, newest first.
func (in *Inspector) List() []Capture { return in.list() }

// list returns the kept exchanges, newest first, their heads written.
// Newest is by when each reached the agent: an exchange is kept once its
// stream is done, which can come after the visitor has its answer and has
// sent its next request, so the order kept is not always the order sent.
func (in *Inspector) list() []Capture {
	in.mu.Lock()
	defer in.mu.Unlock()
	out := in.ring.newestFirst()
	for i := range out {
		out[i] = out[i].filled()
	}
	slices.SortStableFunc(out, func(a, b Capture) int { return b.Start.Compare(a.Start) })
	return out
}

func (in *Inspector) get(id uint64) (Capture, bool) {
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, c := range in.ring.v {
		if c.ID == id {
			return c.filled(), true
		}
	}
	return Capture{}, false
}

// filled returns c with its heads written, or a connection as it stands.
func (c Capture) filled() Capture {
	if c.live != nil {
		conn, took := c.live.conn(c.Start)
		c.Conn, c.Duration = &conn, took
		return c
	}
	c.Request, c.Response = c.Request.filled(), c.Response.filled()
	return c
}

// addConn lists a connection of t's from r's visitor, which m counts,
// at once: it shows open until the relay closes m. It takes a place in
// the list as an exchange does, and holds only m while it stays open.
func (in *Inspector) addConn(t *tunnel, r *http.Request, start time.Time, m *connMeter) {
	m.info = Conn{Proto: t.cfg.Proto, PublicURL: t.publicURL(), Visitor: r.Header.Get(mux.HeaderTCPSource)}
	in.add(Capture{Start: start, Method: strings.ToUpper(t.cfg.Proto), Tunnel: t.name, live: m})
}

// addRefused lists a request the edge refused for t (mux.Refused).
func (in *Inspector) addRefused(t *tunnel, m *mux.Refused) {
	in.add(Capture{Start: time.Now(), Method: m.Method, Path: m.Path, Tunnel: in.a.shownName(t),
		Status: http.StatusForbidden, Code: m.Code, Refused: m.Reason})
}

// record keeps the exchange x ran for r, the request from the edge for
// path.
func (in *Inspector) record(x *exchange, r *http.Request, path string) {
	c := Capture{
		Start: x.start, Duration: time.Since(x.start),
		Method: r.Method, Path: path, Status: int(x.status.Load()), Code: x.errCode(),
		Request: x.cap.req.message(), Response: x.cap.resp.message(),
	}
	if x.t != nil {
		c.Tunnel = x.t.name
	}
	c.Upgrade = x.cap.upgrade
	if mux.IsGRPC(r) {
		c.GRPCStatus = x.grpcStatus()
	}
	if c.Request.head == nil {
		// Nothing went to the local service (the agent answered itself):
		// show the head as it came, its body as not kept.
		c.Request = Message{head: requestHead(r), Truncated: r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0}
	}
	in.add(c)
}

// grpcStatus is the grpc-status the client of x, a gRPC call, got: the
// agent's own answer's, else the local server's, from its trailers or a
// response of trailers only.
func (x *exchange) grpcStatus() string {
	if x.grpc != "" {
		return x.grpc
	}
	return localGRPCStatus(x.cap.localResp)
}

// localGRPCStatus is the grpc-status of resp, a local server's response
// (nil: none): in its trailers once its body has ended, or in its head (a
// response of trailers only).
func localGRPCStatus(resp *http.Response) string {
	if resp == nil {
		return ""
	}
	if s := resp.Trailer.Get("Grpc-Status"); s != "" {
		return s
	}
	return resp.Header.Get("Grpc-Status")
}

//go:embed inspect.html
var inspectPage []byte

// Handler serves the page and its API: GET /api/requests (newest first,
// TCP and TLS connections among the exchanges), GET /api/requests/{id},
// GET /api/requests/{id}/{request|response}/body (the kept bytes, as a
// download), POST /api/requests/{id}/replay (with an optional JSON body
// {"head": ..., "body": base64} to send an edited request instead; 409
// for a connection), and the local API of the agent's tunnels in ngrok's
// shape: GET /api/tunnels, GET /api/tunnels/{name}.
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
	m.HandleFunc("GET /api/requests/{id}/{side}/body", in.serveBody)
	m.HandleFunc("POST /api/requests/{id}/replay", in.serveReplay)
	m.HandleFunc("GET /api/tunnels", func(w http.ResponseWriter, r *http.Request) {
		mux.WriteJSON(w, http.StatusOK, apiTunnelList{Tunnels: in.tunnels(), URI: "/api/tunnels"})
	})
	m.HandleFunc("GET /api/tunnels/{name}", func(w http.ResponseWriter, r *http.Request) {
		for _, t := range in.tunnels() {
			if t.Name == r.PathValue("name") {
				mux.WriteJSON(w, http.StatusOK, t)
				return
			}
		}
		mux.WriteJSON(w, http.StatusNotFound, map[string]string{"error": "no tunnel named " + strconv.Quote(r.PathValue("name")) + " (GET /api/tunnels lists them)"})
	})
	// Another web page the browser visits must not replay requests to the
	// local service: net/http's cross-origin protection refuses a request
	// of another site by Sec-Fetch-Site, or by an Origin that is not the
	// inspector's own.
	return loopbackHost(sameOrigin(m))
}

// sameOrigin refuses non-safe requests from another origin.
func sameOrigin(h http.Handler) http.Handler {
	cop := http.NewCrossOriginProtection()
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mux.WriteJSON(w, http.StatusForbidden, map[string]string{"error": "refused: asked by another site (" + r.Header.Get("Origin") + r.Header.Get("Sec-Fetch-Site") + ")"})
	}))
	return cop.Handler(h)
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

// apiTunnelList and apiTunnel are ngrok's agent API shapes, so that
// scripts that ask ngrok's agent for its URL work unchanged.
type apiTunnelList struct {
	Tunnels []apiTunnel `json:"tunnels"`
	URI     string      `json:"uri"`
}

type apiTunnel struct {
	Name      string          `json:"name"`
	URI       string          `json:"uri"`
	PublicURL string          `json:"public_url"`
	Proto     string          `json:"proto"`
	Config    apiTunnelConfig `json:"config"`
}

type apiTunnelConfig struct {
	Addr    string `json:"addr"`
	Inspect bool   `json:"inspect"`
	// VerifyWebhook is ngstone's own: the provider whose signatures the
	// edge checks.
	VerifyWebhook string `json:"verify_webhook,omitempty"`
	// OAuth is the provider visitors sign in with at the edge.
	OAuth string `json:"oauth,omitempty"`
	// Pool: the name is shared with other agents (--pool); PoolDown is
	// why this one is out of the pool now.
	Pool     bool   `json:"pool,omitempty"`
	PoolDown string `json:"pool_down,omitempty"`
}

func (in *Inspector) tunnels() []apiTunnel {
	out := []apiTunnel{}
	for _, t := range in.a.Status().Endpoints() {
		out = append(out, apiTunnel{Name: t.Name, URI: "/api/tunnels/" + url.PathEscape(t.Name),
			PublicURL: t.PublicURL, Proto: t.Proto, Config: apiTunnelConfig{Addr: t.Local, Inspect: true, VerifyWebhook: t.VerifyWebhook, OAuth: t.OAuth,
				Pool: t.Pool, PoolDown: t.Down}})
	}
	return out
}

// serveBody sends a kept body as a download: the bytes are a visitor's
// or a local service's, so the browser must neither render nor sniff them
// on the inspector's origin.
func (in *Inspector) serveBody(w http.ResponseWriter, r *http.Request) {
	c, ok := in.lookup(w, r)
	if !ok {
		return
	}
	side := r.PathValue("side")
	msg := map[string]Message{"request": c.Request, "response": c.Response}
	m, ok := msg[side]
	if !ok {
		mux.WriteJSON(w, http.StatusNotFound, map[string]string{"error": "want request or response"})
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Security-Policy", "sandbox")
	h.Set("Content-Disposition", fmt.Sprintf(`attachment; filename="%s-%d.bin"`, side, c.ID))
	h.Set("Content-Length", strconv.Itoa(len(m.Body)))
	w.Write(m.Body)
}

// replayEdit is an edited request to send instead of the kept one: its
// head as text, and its body (nil: the kept body).
type replayEdit struct {
	Head string  `json:"head"`
	Body *[]byte `json:"body"`
}

// Replay answers.
var (
	// errNotWhole refuses to replay a request whose body was not kept whole.
	errNotWhole = errors.New("the request body was not kept whole (over 64 KiB, or cut short): it cannot be replayed as it was; edit it to send another")
	// errBadEdit refuses an edited request the agent cannot send.
	errBadEdit = errors.New("the edited request")
	// errNoTunnel refuses to replay an exchange that came for none of
	// the agent's tunnels: there is no local service to send it to.
	errNoTunnel = errors.New("the exchange came for none of this agent's tunnels")
	// errConn refuses to replay a TCP or TLS connection: none of its
	// bytes are kept, and a connection is not a request to send again.
	errConn = errors.New("a TCP or TLS connection cannot be replayed: its bytes are relayed, not kept; only HTTP requests can")
	// errRefused refuses to replay a request the edge refused: it never
	// reached the agent, which has nothing of it to send.
	errRefused = errors.New("the edge refused this request before it crossed the tunnel: the agent never had it to send again")
)

func (in *Inspector) serveReplay(w http.ResponseWriter, r *http.Request) {
	c, ok := in.lookup(w, r)
	if !ok {
		return
	}
	edited, err := readEdit(w, r, &c)
	if err == nil {
		var id uint64
		id, err = in.replay(r.Context(), c, edited)
		if err == nil {
			got, _ := in.get(id)
			mux.WriteJSON(w, http.StatusOK, got)
			return
		}
	}
	status := http.StatusBadGateway
	switch {
	case errors.Is(err, errNotWhole), errors.Is(err, errNoTunnel), errors.Is(err, errConn), errors.Is(err, errRefused):
		status = http.StatusConflict
	case errors.Is(err, errBadEdit):
		status = http.StatusBadRequest
	}
	mux.WriteJSON(w, status, map[string]string{"error": err.Error()})
}

// readEdit applies the edit r carries, if any, to c's request.
func readEdit(w http.ResponseWriter, r *http.Request, c *Capture) (edited bool, err error) {
	if r.ContentLength == 0 {
		return false, nil
	}
	// base64 takes 4 bytes for 3; the head and JSON's own few.
	limit := int64(mux.MaxRequestHead + inspectBodyMax*4/3 + 1024)
	var e replayEdit
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, limit)).Decode(&e); err != nil {
		return false, fmt.Errorf("%w: want JSON {\"head\": TEXT, \"body\": BASE64} of at most %d bytes: %v", errBadEdit, limit, err)
	}
	if e.Head == "" && e.Body == nil {
		return false, nil
	}
	if e.Head != "" {
		c.Request.Head = normalizeHead(e.Head)
	}
	if e.Body != nil {
		if len(*e.Body) > inspectBodyMax {
			return false, fmt.Errorf("%w: a body over %d bytes", errBadEdit, inspectBodyMax)
		}
		c.Request.Body, c.Request.Size, c.Request.Truncated = *e.Body, int64(len(*e.Body)), false
	}
	return true, nil
}

// normalizeHead gives a head typed in a text box (lines ending in \n,
// blank lines missing or doubled) HTTP's form.
func normalizeHead(h string) string {
	lines := strings.Split(strings.TrimSpace(strings.ReplaceAll(h, "\r\n", "\n")), "\n")
	return strings.Join(lines, "\r\n") + "\r\n\r\n"
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

// replay sends c's request again to the local service, keeps the exchange
// as a new capture and logs it (edited: c's request is not the one kept).
func (in *Inspector) replay(ctx context.Context, c Capture, edited bool) (uint64, error) {
	if c.Conn != nil {
		return 0, errConn
	}
	if c.Refused != "" {
		return 0, errRefused
	}
	if c.Request.Truncated || c.Request.Head == "" {
		return 0, errNotWhole
	}
	if len(c.Request.Head) > mux.MaxRequestHead {
		return 0, fmt.Errorf("%w: a head over %d bytes", errBadEdit, mux.MaxRequestHead)
	}
	req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(c.Request.Head)))
	if err != nil {
		return 0, fmt.Errorf("%w: not an HTTP request head: %v", errBadEdit, err)
	}
	t := in.a.tunnelNamed(c.Tunnel)
	if t == nil {
		return 0, errNoTunnel
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, t.cfg.UpstreamDialTimeout+t.cfg.UpstreamTimeout)
	defer cancel()
	req = replayRequest(req.WithContext(ctx), t.local, c.Request.Body)
	var kept capture
	kept.request(req)
	resp, err := t.transport().RoundTrip(req)
	if err != nil {
		in.a.log.Warn("replay failed", "of", c.ID, "method", req.Method, "path", req.URL.RequestURI(), "err", err)
		return 0, fmt.Errorf("send to the local service: %w", err)
	}
	kept.response(resp)
	io.Copy(io.Discard, io.LimitReader(resp.Body, inspectBodyMax+1))
	resp.Body.Close()
	took := time.Since(start)
	kc := Capture{
		Start: start, Duration: took, Method: req.Method, Path: req.URL.RequestURI(), Tunnel: t.name, Status: resp.StatusCode,
		Replay: true, ReplayOf: c.ID, Edited: edited, Request: kept.req.message(), Response: kept.resp.message(),
	}
	if mux.IsGRPC(req) {
		kc.GRPCStatus = localGRPCStatus(resp)
	}
	id := in.add(kc)
	in.a.stats.keep(Request{Start: start, Method: req.Method, Path: req.URL.RequestURI(), Status: resp.StatusCode, Duration: took,
		Replay: true, Tunnel: in.a.shownName(t)})
	in.a.log.Info("replay", "of", c.ID, "edited", edited, "method", req.Method, "path", req.URL.RequestURI(),
		"status", resp.StatusCode, "duration", took.Round(10*time.Microsecond))
	return id, nil
}

// replayRequest addresses req, read from a kept head, to the local service
// with body.
func replayRequest(req *http.Request, local *url.URL, body []byte) *http.Request {
	req.RequestURI = ""
	req.URL.Scheme, req.URL.Host = local.Scheme, local.Host
	req.TransferEncoding = nil
	req.Header.Del("Transfer-Encoding")
	req.Header.Del("Content-Length")
	req.ContentLength = int64(len(body))
	req.Body = http.NoBody
	if len(body) > 0 {
		req.Body = io.NopCloser(bytes.NewReader(body))
	}
	return req
}

// serve serves in on ln until ctx ends.
func (in *Inspector) serve(ctx context.Context, ln net.Listener) {
	srv := &http.Server{Handler: in.Handler(), ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	srv.Serve(ln)
}
