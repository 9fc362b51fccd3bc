package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/ngstone/ngstone/internal/conntest"
	"github.com/ngstone/ngstone/mux"
)

// relayAgent is an agent that relays to local and nothing else: the tests
// below play the edge, with a loopback TCP connection for each stream.
func relayAgent(t *testing.T, local string) *relayTester {
	t.Helper()
	return relayAgentWith(t, local, Config{}, slog.New(slog.DiscardHandler))
}

// relayTester is an agent serving the streams of a TCP listener.
type relayTester struct {
	*Agent
	ln   net.Listener
	held *mux.Tracker
}

// relayAgentWith is relayAgent with the settings of cfg (New's, with no
// edge dialled) and a logger.
// setup runs before the agent serves a stream.
func relayAgentWith(t *testing.T, local string, cfg Config, log *slog.Logger, setup ...func(*Agent)) *relayTester {
	t.Helper()
	cfg.Edge, cfg.Local = "localhost:1", local
	if cfg.UpstreamTimeout == 0 {
		cfg.UpstreamTimeout = 5 * time.Second
	}
	cfg.UpstreamDialTimeout = 5 * time.Second
	a, err := New(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.tunnels[0].loadUpstreamCA(); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relayTester{Agent: a, ln: ln, held: new(mux.Tracker)}
	for _, f := range setup {
		f(a)
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		a.serveStreams(ln, r.held, new(atomic.Int64))
	}()
	t.Cleanup(func() {
		ln.Close()
		a.wg.Wait()
		a.tunnels[0].transport().CloseIdleConnections()
	})
	return r
}

// stream is one relayed exchange seen from the edge's side.
type stream struct {
	c  net.Conn
	br *bufio.Reader
	r  *relayTester
}

// open starts an exchange on a new stream.
func open(t *testing.T, r *relayTester) *stream {
	t.Helper()
	c, err := net.Dial("tcp", r.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &stream{c: c, br: bufio.NewReader(c), r: r}
}

// roundTrip sends req as the edge would and reads the final response.
func (x *stream) roundTrip(t *testing.T, req *http.Request) (*http.Response, string, error) {
	t.Helper()
	go req.Write(x.c)
	for {
		resp, err := http.ReadResponse(x.br, req)
		if err != nil {
			return nil, "", err
		}
		if resp.StatusCode < 200 && resp.StatusCode != 101 {
			continue
		}
		b, err := io.ReadAll(resp.Body)
		return resp, string(b), err
	}
}

// do runs one exchange of method with body on a new stream.
func do(t *testing.T, r *relayTester, method, body string) (*http.Response, string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequest(method, "http://app.ngstone.test/", rd)
	resp, got, err := relayOnce(t, r, req)
	if err != nil {
		t.Fatalf("%s: %v", method, err)
	}
	return resp, got
}

// relayOnce runs req as one exchange on a new stream, which it then ends
// as the edge would, and waits for the agent to let it go.
func relayOnce(t *testing.T, r *relayTester, req *http.Request) (*http.Response, string, error) {
	t.Helper()
	x := open(t, r)
	resp, got, err := x.roundTrip(t, req)
	x.c.Close()
	waitDone(t, x)
	return resp, got, err
}

// waitDone waits until no exchange holds up a drain: the agent let the
// stream go.
func waitDone(t *testing.T, x *stream) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for x.r.held.Count() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the agent did not let the exchange go")
		}
		time.Sleep(time.Millisecond)
	}
}

// countingServer is an httptest server that counts the connections it
// accepted.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			n.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &n
}

// TestRelayKeepsConnectionsAlive relays bodies of every framing both ways
// (none, a length, chunked; small enough to arrive with the head and large
// enough to stream) on one local connection.
func TestRelayKeepsConnectionsAlive(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Query().Has("chunked") {
			// Two flushes: the response is chunked.
			io.WriteString(w, r.Method+" ")
			w.(http.Flusher).Flush()
			w.Write(b)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(r.Method)+1+len(b)))
		io.WriteString(w, r.Method+" "+string(b))
	})
	a := relayAgent(t, s.URL)
	for i := range 24 {
		method, body := "GET", ""
		if i%2 == 1 {
			method, body = "POST", strings.Repeat("x", i*3000)
		}
		target := "http://app.ngstone.test/"
		if i%3 == 0 {
			target += "?chunked"
		}
		var r io.Reader
		if body != "" {
			r = strings.NewReader(body)
			if i%4 == 3 {
				r = io.MultiReader(r) // no length known: a chunked request
			}
		}
		req, _ := http.NewRequest(method, target, r)
		resp, got, err := relayOnce(t, a, req)
		if err != nil || resp.StatusCode != 200 || got != method+" "+body {
			t.Fatalf("request %d: %v %.20q %v", i, resp, got, err)
		}
		if i%3 == 0 && len(resp.TransferEncoding) == 0 {
			t.Errorf("request %d: the response was meant to be chunked", i)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("24 requests used %d connections, want 1", n)
	}
}

func TestRelayConnectionClose(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		io.WriteString(w, "bye")
	})
	a := relayAgent(t, s.URL)
	for i := range 3 {
		if resp, got := do(t, a, "GET", ""); resp.StatusCode != 200 || got != "bye" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
	}
	if n := conns.Load(); n != 3 {
		t.Errorf("3 requests answered with Connection: close used %d connections, want 3", n)
	}
}

// rawServer answers each request on a new connection with reply, then
// closes the connection; closed receives once it has.
func rawServer(t *testing.T, reply string) (addr string, accepted *atomic.Int32, closed chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted, closed = new(atomic.Int32), make(chan struct{}, 16)
	conntest.Serve(t, ln, func(c net.Conn) {
		accepted.Add(1)
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err == nil {
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, reply)
		}
		c.Close()
		closed <- struct{}{}
	})
	return ln.Addr().String(), accepted, closed
}

func TestRelayPeerClosedIdleConnection(t *testing.T) {
	addr, accepted, closed := rawServer(t, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	a := relayAgent(t, addr)
	for i := range 3 {
		// Whether or not the transport has seen the close yet, a GET on
		// a connection the local service closed is sent again on a new
		// one.
		if resp, got := do(t, a, "GET", ""); resp.StatusCode != 200 || got != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("server did not close the connection")
		}
	}
	if n := accepted.Load(); n != 3 {
		t.Errorf("server accepted %d connections, want 3", n)
	}
}

// TestRelayUntilClose: a response with neither a length nor chunks runs to
// the end of the local connection, which is then not pooled.
func TestRelayUntilClose(t *testing.T) {
	addr, accepted, _ := rawServer(t, "HTTP/1.0 200 OK\r\n\r\nall of it")
	a := relayAgent(t, addr)
	for range 2 {
		if resp, got := do(t, a, "GET", ""); resp.StatusCode != 200 || got != "all of it" {
			t.Fatalf("%d %q", resp.StatusCode, got)
		}
	}
	if n := accepted.Load(); n != 2 {
		t.Errorf("server accepted %d connections, want 2", n)
	}
}

func TestRelayHeadAndNoContent(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/empty" {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		w.Header().Set("Content-Length", "5")
		io.WriteString(w, "hello")
	})
	a := relayAgent(t, s.URL)
	for _, path := range []string{"/", "/empty", "/", "/empty"} {
		req, _ := http.NewRequest("HEAD", "http://app.ngstone.test"+path, nil)
		resp, got, err := relayOnce(t, a, req)
		if err != nil || got != "" || (path == "/" && resp.ContentLength != 5) {
			t.Fatalf("HEAD %s: %v %q %v", path, resp, got, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

func TestRelayEarlyResponse(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == "POST" {
			http.Error(w, "too large", http.StatusRequestEntityTooLarge)
			return
		}
		io.WriteString(w, "ok")
	})
	a := relayAgent(t, s.URL)
	if resp, _ := do(t, a, "POST", strings.Repeat("x", 1<<20)); resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("POST answered before its body was read: status %d, want 413", resp.StatusCode)
	}
	if resp, got := do(t, a, "GET", ""); resp.StatusCode != 200 || got != "ok" {
		t.Fatalf("GET after: %d %q", resp.StatusCode, got)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("%d connections, want 2: the one whose request body was cut short is not reused", n)
	}
}

func TestRelayInformational(t *testing.T) {
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</app.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		io.WriteString(w, "final")
	})
	a := relayAgent(t, s.URL)
	req, _ := http.NewRequest("GET", "http://app.ngstone.test/", nil)
	x := open(t, a)
	go req.Write(x.c)
	first, err := http.ReadResponse(x.br, req)
	if err != nil || first.StatusCode != http.StatusEarlyHints || first.Header.Get("Link") == "" {
		t.Fatalf("first response %v %v, want 103 with its Link", first, err)
	}
	final, err := http.ReadResponse(x.br, req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(final.Body)
	if final.StatusCode != 200 || string(b) != "final" || final.Header.Get("Link") != "" {
		t.Fatalf("final response %d %q %v", final.StatusCode, b, final.Header)
	}
}

// silentServer reads requests and never answers; it counts the
// connections it saw closed.
func silentServer(t *testing.T) (string, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var closed atomic.Int32
	conntest.Serve(t, ln, func(c net.Conn) { io.Copy(io.Discard, c); closed.Add(1) })
	return ln.Addr().String(), &closed
}

func wantVisitorError(t *testing.T, resp *http.Response, body string, code string) {
	t.Helper()
	if resp.StatusCode != mux.VisitorStatus(code) || resp.Header.Get(mux.ErrorHeader) != code || !strings.Contains(body, "app.ngstone.test") {
		t.Errorf("got %d %s=%q %q, want %d %s naming the host", resp.StatusCode, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader), body, mux.VisitorStatus(code), code)
	}
}

func TestRelayTimeoutAndAbandon(t *testing.T) {
	addr, closed := silentServer(t)
	a := relayAgentWith(t, addr, Config{Tunnel: Tunnel{UpstreamTimeout: 50 * time.Millisecond}}, slog.New(slog.DiscardHandler))
	resp, body := do(t, a, "GET", "")
	wantVisitorError(t, resp, body, mux.CodeUpstreamTimeout)

	// The edge gives an exchange up (its visitor left): the local
	// request is cut short.
	a = relayAgentWith(t, addr, Config{Tunnel: Tunnel{UpstreamTimeout: time.Minute}}, slog.New(slog.DiscardHandler))
	for _, body := range []string{"", "body"} {
		before := closed.Load()
		req, _ := http.NewRequest("POST", "http://app.ngstone.test/", strings.NewReader(body))
		x := open(t, a)
		if err := req.Write(x.c); err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(20*time.Millisecond, func() { x.c.Close() })
		waitDone(t, x)
		deadline := time.Now().Add(5 * time.Second)
		for closed.Load() == before && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if closed.Load() == before {
			t.Fatalf("body %q: the local connection of an abandoned exchange stayed open", body)
		}
	}
}

func TestRelayLocalErrors(t *testing.T) {
	dead := conntest.DeadAddr(t)
	resp, body := do(t, relayAgent(t, dead), "GET", "")
	wantVisitorError(t, resp, body, mux.CodeUpstreamUnreachable)

	for name, tc := range map[string]struct{ reply, code string }{
		"not HTTP":          {"SSH-2.0-OpenSSH\r\n\r\n", mux.CodeBadResponse},
		"bad length":        {"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", mux.CodeBadResponse},
		"signed length":     {"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", mux.CodeBadResponse},
		"two lengths":       {"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", mux.CodeBadResponse},
		"gzip framing":      {"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", mux.CodeBadResponse},
		"gzip then chunked": {"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", mux.CodeBadResponse},
		"NUL in a value":    {"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n", mux.CodeBadResponse},
		"unasked upgrade":   {"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", mux.CodeBadResponse},
		"nothing at all":    {"", mux.CodeUpstreamUnreachable},
		// net/http reads these two (the fold as one value, the name
		// without its space); the agent passes on what it read.
		"folded header":    {"HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n", ""},
		"space before `:`": {"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n", ""},
	} {
		addr, _, _ := rawServer(t, tc.reply)
		resp, body := do(t, relayAgent(t, addr), "GET", "")
		if resp.Header.Get(mux.ErrorHeader) != tc.code {
			t.Errorf("%s: %d %s=%q %q, want %d %s", name, resp.StatusCode, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader), body, mux.VisitorStatus(tc.code), tc.code)
		}
	}

	// A chunked body cut short once the response went out: the exchange
	// is cut, not answered twice.
	addr, _, _ := rawServer(t, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
	req, _ := http.NewRequest("GET", "http://app.ngstone.test/", nil)
	x := open(t, relayAgent(t, addr))
	resp, got, err := x.roundTrip(t, req)
	if !errors.Is(err, io.ErrUnexpectedEOF) || resp.StatusCode != 200 || got != "hel" {
		t.Errorf("truncated body: %v %q %v, want 200, hel and an unexpected EOF", resp, got, err)
	}
}

// TestRelayHTTPSLocal: an https:// local service is reached over TLS and
// its certificate checked against the system's roots, so a self-signed
// one is refused with 502 upstream_unreachable and a warning that names
// the two ways out; --upstream-ca-file with its CA, or --upstream-insecure,
// let requests through.
func TestRelayHTTPSLocal(t *testing.T) {
	var got atomic.Int32
	s := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Add(1)
		io.WriteString(w, "secure")
	}))
	t.Cleanup(s.Close)
	s.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake

	var logs strings.Builder
	resp, body := do(t, relayAgentWith(t, s.URL, Config{}, slog.New(slog.NewTextHandler(&logs, nil))), "GET", "")
	wantVisitorError(t, resp, body, mux.CodeUpstreamUnreachable)
	if got.Load() != 0 {
		t.Error("the request reached a local service whose certificate is not trusted")
	}
	for _, want := range []string{"level=WARN", "request to the local service failed", "--upstream-ca-file", "--upstream-insecure"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log %q lacks %q", logs.String(), want)
		}
	}

	caFile := filepath.Join(t.TempDir(), "local-ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, cfg := range map[string]Config{
		"upstream CA file":  {Tunnel: Tunnel{UpstreamCAFile: caFile}},
		"upstream insecure": {Tunnel: Tunnel{UpstreamInsecure: true}},
	} {
		resp, body := do(t, relayAgentWith(t, s.URL, cfg, slog.New(slog.DiscardHandler)), "GET", "")
		if resp.StatusCode != 200 || body != "secure" {
			t.Errorf("%s: %d %q, want 200 secure", name, resp.StatusCode, body)
		}
	}
	if got.Load() != 2 {
		t.Errorf("the local service served %d requests, want 2", got.Load())
	}
}

// TestLocalFailureWarnings: a local service that refuses connections is
// reported as a warning with a hint, at most once every localWarnEvery;
// the next warning counts the failures in between.
func TestLocalFailureWarnings(t *testing.T) {
	var logs strings.Builder
	a := relayAgentWith(t, conntest.DeadAddr(t), Config{}, slog.New(slog.NewTextHandler(&logs, nil)))
	for range 3 {
		resp, body := do(t, a, "GET", "")
		wantVisitorError(t, resp, body, mux.CodeUpstreamUnreachable)
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
		t.Fatalf("%d warnings for 3 failures within %s, want 1:\n%s", n, localWarnEvery, logs.String())
	}
	if want := "is the local service running?"; !strings.Contains(logs.String(), want) {
		t.Errorf("log %q lacks %q", logs.String(), want)
	}
	a.tunnels[0].failures.mu.Lock()
	a.tunnels[0].failures.last = a.tunnels[0].failures.last.Add(-localWarnEvery)
	a.tunnels[0].failures.mu.Unlock()
	logs.Reset()
	do(t, a, "GET", "")
	if want := "failures_not_logged=2"; !strings.Contains(logs.String(), want) {
		t.Errorf("log %q lacks %q", logs.String(), want)
	}
}

// TestHTTP2OnlyLocalServiceHint: a local service that speaks only HTTP/2
// (a gRPC server) gets 502 bad_response and a warning naming
// --upstream-protocol http2, whether its SETTINGS frame comes as the
// answer to the request or before the request was written (as on a busy
// machine: the transport then finds bytes on an idle connection, closes
// it, and the request fails writing).
func TestHTTP2OnlyLocalServiceHint(t *testing.T) {
	t.Run("settings as the answer", func(t *testing.T) {
		addr, _, _ := rawServer(t, "\x00\x00\x00\x04\x00\x00\x00\x00\x00") // an empty SETTINGS frame
		wantHTTP2Hint(t, addr)
	})
	t.Run("settings before the request", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := grpc.NewServer()
		go srv.Serve(ln)
		defer srv.Stop()
		wantHTTP2Hint(t, ln.Addr().String(), func(a *Agent) {
			tr := a.tunnels[0].transport()
			dial := tr.DialContext
			tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := dial(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				deadline := time.Now().Add(5 * time.Second)
				for _, clean := watchedOf(c).idle(); clean && time.Now().Before(deadline); _, clean = watchedOf(c).idle() {
					time.Sleep(time.Millisecond)
				}
				return c, nil
			}
		})
	})
}

// wantHTTP2Hint posts to the local service at addr through an agent made
// with setup, and wants 502 bad_response and the hint.
func wantHTTP2Hint(t *testing.T, addr string, setup ...func(*Agent)) {
	t.Helper()
	var logs strings.Builder
	a := relayAgentWith(t, addr, Config{}, slog.New(slog.NewTextHandler(&logs, nil)), setup...)
	resp, body := do(t, a, "POST", "hello")
	wantVisitorError(t, resp, body, mux.CodeBadResponse)
	if want := "--upstream-protocol http2"; !strings.Contains(logs.String(), want) {
		t.Errorf("log %q lacks %q", logs.String(), want)
	}
}

// TestExchangesShareLocalConnection: exchanges one after another, each on
// a stream the edge ends the moment the response is in, share one local
// connection.
func TestExchangesShareLocalConnection(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	a := relayAgent(t, s.URL)
	for i := range 200 {
		if resp, got := do(t, a, "GET", ""); resp.StatusCode != 200 || got != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("200 requests used %d connections, want 1", n)
	}
}

// TestLogRequests: with LogRequests, each exchange is one log line with its
// method, path, status and duration, and the agent's own error code when it
// answered for the local service; without it, none.
func TestLogRequests(t *testing.T) {
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/missing" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, "ok")
	})
	lines := func(logs *bytes.Buffer) []map[string]any {
		var out []map[string]any
		for l := range strings.Lines(logs.String()) {
			var m map[string]any
			if err := json.Unmarshal([]byte(l), &m); err != nil {
				t.Fatalf("log line %q: %v", l, err)
			}
			if m["msg"] == "request" {
				out = append(out, m)
			}
		}
		return out
	}
	var logs bytes.Buffer
	a := relayAgentWith(t, s.URL, Config{LogRequests: true}, slog.New(slog.NewJSONHandler(&logs, nil)))
	req, _ := http.NewRequest("POST", "http://app.ngstone.test/hook?x=1", strings.NewReader("payload"))
	if resp, _, err := relayOnce(t, a, req); err != nil || resp.StatusCode != 200 {
		t.Fatalf("POST /hook: %v", err)
	}
	req, _ = http.NewRequest("GET", "http://app.ngstone.test/missing", nil)
	relayOnce(t, a, req)

	dead := conntest.DeadAddr(t)
	down := relayAgentWith(t, dead, Config{LogRequests: true}, slog.New(slog.NewJSONHandler(&logs, nil)))
	do(t, down, "GET", "")

	got := lines(&logs)
	want := []struct {
		method, path string
		status       float64
		code         any
	}{
		{"POST", "/hook?x=1", 200, nil},
		{"GET", "/missing", 404, nil},
		{"GET", "/", 502, mux.CodeUpstreamUnreachable},
	}
	if len(got) != len(want) {
		t.Fatalf("%d request lines, want %d:\n%s", len(got), len(want), logs.String())
	}
	for i, w := range want {
		g := got[i]
		if g["method"] != w.method || g["path"] != w.path || g["status"] != w.status || g["code"] != w.code {
			t.Errorf("line %d: %v, want %s %s %v code %v", i, g, w.method, w.path, w.status, w.code)
		}
		if d, ok := g["duration"].(float64); !ok || d <= 0 {
			t.Errorf("line %d: duration %v", i, g["duration"])
		}
	}

	logs.Reset()
	quiet := relayAgentWith(t, s.URL, Config{}, slog.New(slog.NewJSONHandler(&logs, nil)))
	do(t, quiet, "GET", "")
	if got := lines(&logs); len(got) != 0 {
		t.Fatalf("request lines without LogRequests: %v", got)
	}
}

// TestHostHeader: --host-header gives the local service its own host
// (rewrite) or a given one in place of the visitor's, which it still finds
// in X-Forwarded-Host; an error page names the visitor's host.
func TestHostHeader(t *testing.T) {
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %s", r.Host, r.Header.Get("X-Forwarded-Host"))
	})
	local := strings.TrimPrefix(s.URL, "http://")
	for _, tc := range []struct{ option, want string }{
		{"", "app.ngstone.test"},
		{"rewrite", local},
		{"dev.internal:5173", "dev.internal:5173"},
	} {
		a := relayAgentWith(t, s.URL, Config{Tunnel: Tunnel{HostHeader: tc.option}}, slog.New(slog.DiscardHandler))
		req, _ := http.NewRequest("GET", "http://app.ngstone.test/", nil)
		req.Header.Set("X-Forwarded-Host", "app.ngstone.test")
		resp, got, err := relayOnce(t, a, req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("host-header %q: %v %v", tc.option, resp, err)
		}
		if want := tc.want + " app.ngstone.test"; got != want {
			t.Errorf("host-header %q: the local service saw Host and X-Forwarded-Host %q, want %q", tc.option, got, want)
		}
	}
	dead := conntest.DeadAddr(t)
	a := relayAgentWith(t, dead, Config{Tunnel: Tunnel{HostHeader: "rewrite"}}, slog.New(slog.DiscardHandler))
	req, _ := http.NewRequest("GET", "http://app.ngstone.test/", nil)
	req.Header.Set("X-Forwarded-Host", "app.ngstone.test")
	resp, got, _ := relayOnce(t, a, req)
	wantVisitorError(t, resp, got, mux.CodeUpstreamUnreachable)
	if !strings.Contains(got, "app.ngstone.test") {
		t.Errorf("error page %q does not name the visitor's host", got)
	}
}
