package edge_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

func hello(token string) *mux.Hello {
	return &mux.Hello{Version: mux.Version, InstanceID: agent.NewInstanceID(), Token: token}
}

func bindCode(t *testing.T, e *tunneltest.Edge, token, sub string) string {
	t.Helper()
	r, m := e.DialRaw(t, hello(token))
	if em, ok := m.(*mux.Error); ok {
		return em.Code
	}
	switch m := r.Bind(t, &mux.Bind{Subdomain: sub}).(type) {
	case *mux.BindError:
		if m.Message == "" {
			t.Errorf("bind %q refused with %s but no sentence", sub, m.Code)
		}
		return m.Code
	case *mux.BindOK:
		return "ok"
	}
	return "?"
}

// TestAgentRefusals: one row per refusal an agent can meet, with its code.
func TestAgentRefusals(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.Tokens = []string{"plain"}
	cfg.TokenPolicies = []edge.TokenPolicy{
		{Token: "team", Subdomains: []string{"team-*"}},
		{Token: "one", MaxBindings: 1, MaxSessions: 2},
	}
	e := tunneltest.StartEdge(t, cfg)
	if code := bindCode(t, e, "one", "first"); code != "ok" {
		t.Fatalf("setup bind: %s", code)
	}
	cases := []struct {
		name, token, sub, code string
	}{
		{"unknown token", "nope", "x", mux.CodeUnauthorized},
		{"empty token", "", "x", mux.CodeUnauthorized},
		{"token prefix is not the token", "plai", "x", mux.CodeUnauthorized},
		{"reserved name", "plain", "admin", mux.CodeReservedName},
		{"upper case", "plain", "App", mux.CodeInvalidName},
		{"leading dash", "plain", "-app", mux.CodeInvalidName},
		{"dot", "plain", "a.b", mux.CodeInvalidName},
		{"64 characters", "plain", strings.Repeat("a", 64), mux.CodeInvalidName},
		{"token limited to names", "team", "other", mux.CodeUnauthorized},
		{"token limited to names, random", "team", "", mux.CodeUnauthorized},
		{"token within its names", "team", "team-a", "ok"},
		{"63 characters", "plain", strings.Repeat("b", 63), "ok"},
		{"binding limit", "one", "second", mux.CodeLimitExceeded},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := bindCode(t, e, tc.token, tc.sub); got != tc.code {
				t.Errorf("got %s, want %s", got, tc.code)
			}
		})
	}
}

func TestTokenSessionLimit(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "two", MaxSessions: 2}}
	e := tunneltest.StartEdge(t, cfg)
	same := hello("two")
	for range 2 {
		if _, m := e.DialRaw(t, hello("two")); m.MessageType() != mux.TypeHelloOK {
			t.Fatalf("within limit: %v", m)
		}
	}
	if _, m := e.DialRaw(t, hello("two")); m.(*mux.Error).Code != mux.CodeLimitExceeded {
		t.Fatalf("past limit: %v", m)
	}
	// A third instance is refused, but a reconnecting one is not: its own
	// sessions do not count.
	e2cfg := tunneltest.EdgeConfig(t)
	e2cfg.TokenPolicies = []edge.TokenPolicy{{Token: "one", MaxSessions: 1}}
	e2 := tunneltest.StartEdge(t, e2cfg)
	e2.DialRaw(t, same)
	same.Token = "one"
	for range 3 {
		if _, m := e2.DialRaw(t, same); m.MessageType() != mux.TypeHelloOK {
			t.Fatalf("reconnect of the same instance refused: %v", m)
		}
	}
}

// TestAuthFailuresRateLimited: after the limit of failed hellos, the
// address is refused, even with a good token: the first connection after
// the ban is told why and for how long, inside TLS; the next ones within a
// second are closed before the TLS handshake.
func TestAuthFailuresRateLimited(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.Tokens = []string{"good"}
	cfg.AuthFailureLimit = 3
	e := tunneltest.StartEdge(t, cfg)
	for range 3 {
		if _, m := e.DialRaw(t, hello("bad")); m.(*mux.Error).Code != mux.CodeUnauthorized {
			t.Fatalf("bad token: %v", m)
		}
	}
	_, m := e.DialRaw(t, hello("good"))
	refusal, ok := m.(*mux.Error)
	if !ok || refusal.Code != mux.CodeTooManyFailures || refusal.RetryAfterMS <= 0 || refusal.RetryAfterMS > cfg.AuthFailureWindow.Milliseconds() ||
		!strings.Contains(refusal.Message, "refused until") {
		t.Fatalf("a good token from a banned address: %+v, want %s with when to retry", m, mux.CodeTooManyFailures)
	}
	_, err := tls.Dial("tcp", e.Addr("control").String(), &tls.Config{RootCAs: e.Roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
	if err == nil {
		t.Fatal("a banned address completed a second TLS handshake within a second")
	}
}

func visitorStatus(t *testing.T, c *http.Client, req *http.Request) (int, string) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get(mux.ErrorHeader)
}

// TestVisitorRefusals: one row per refusal a visitor can meet.
func TestVisitorRefusals(t *testing.T) {
	b := tunneltest.StartBackend(t)
	cfg := tunneltest.EdgeConfig(t)
	cfg.MaxRequestBody = 1 << 10
	cfg.MaxStreamsPerSession = 1
	e := tunneltest.StartEdge(t, cfg)
	ac := e.AgentConfig("", b.Addr())
	ac.Subdomain = "app"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	c := e.Client()
	d := tunneltest.Domain
	req := func(method, url, host string, body io.Reader, mod func(*http.Request)) *http.Request {
		r, _ := http.NewRequest(method, url, body)
		if host != "" {
			r.Host = host
		}
		if mod != nil {
			mod(r)
		}
		return r
	}
	cases := []struct {
		name   string
		req    *http.Request
		status int
		code   string
	}{
		{"two labels deep", req("GET", "http://x.app."+d+"/", "", nil, nil), 404, mux.CodeTunnelNotFound},
		{"domain as a prefix", req("GET", "http://app."+d+".evil.com/", "", nil, nil), 404, mux.CodeTunnelNotFound},
		{"apex", req("GET", "http://"+d+"/", "", nil, nil), 404, mux.CodeTunnelNotFound},
		{"bad host characters", req("GET", "http://app."+d+"/", "app_x."+d, nil, nil), 400, mux.CodeBadHost},
		{"SNI and Host disagree", req("GET", "https://app."+d+"/hello", "other."+d, nil, nil), 421, mux.CodeMisdirected},
		{"body too large, declared", req("POST", "http://app."+d+"/echo", "", strings.NewReader(strings.Repeat("x", 2<<10)), nil), 413, mux.CodeBodyTooLarge},
		{"headers too large", req("GET", "http://app."+d+"/hello", "", nil, func(r *http.Request) { r.Header.Set("X-Big", strings.Repeat("x", 70<<10)) }), 431, mux.CodeHeadersTooLarge},
		{"within limits", req("POST", "http://app."+d+"/echo", "", strings.NewReader("small"), nil), 200, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// A fresh connection per case: Go's server checks the header
			// limit reliably only on a connection's first request.
			fresh := e.Client()
			defer fresh.CloseIdleConnections()
			status, code := visitorStatus(t, fresh, tc.req)
			if status != tc.status || code != tc.code {
				t.Errorf("got %d %q, want %d %q", status, code, tc.status, tc.code)
			}
		})
	}
	t.Run("empty Host", func(t *testing.T) {
		conn, err := net.Dial("tcp", e.Addr("http").String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		io.WriteString(conn, "GET / HTTP/1.0\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 400 || resp.Header.Get(mux.ErrorHeader) != mux.CodeBadHost {
			t.Errorf("got %d %q", resp.StatusCode, resp.Header.Get(mux.ErrorHeader))
		}
	})
	t.Run("streams per session", func(t *testing.T) {
		done := make(chan int, 1)
		go func() {
			s, _ := visitorStatus(t, c, req("GET", "http://app."+d+"/slow", "", nil, nil))
			done <- s
		}()
		<-b.Entered
		status, code := visitorStatus(t, c, req("GET", "http://app."+d+"/hello", "", nil, nil))
		b.Release()
		if status != 503 || code != mux.CodeTooManyRequests {
			t.Errorf("second concurrent request: %d %q, want 503 %s", status, code, mux.CodeTooManyRequests)
		}
		if s := <-done; s != 200 {
			t.Errorf("first request: %d", s)
		}
	})
}

// TestControlPortGarbage: random bytes raw and inside TLS, and a TLS
// connection that never says hello: the other tunnels keep serving and the
// edge's goroutines return to their level.
func TestControlPortGarbage(t *testing.T) {
	b := tunneltest.StartBackend(t)
	cfg := tunneltest.EdgeConfig(t)
	// Counted from the accept, TLS handshake included: 300 ms cut the
	// test's own handshakes on a loaded machine (EOF at the dial).
	cfg.HelloTimeout = 2 * time.Second
	cfg.AuthFailureLimit = 0
	e := tunneltest.StartEdge(t, cfg)
	ac := e.AgentConfig("", b.Addr())
	ac.Subdomain = "steady"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	c := e.Client()
	serving := func() {
		t.Helper()
		if s, _ := visitorStatus(t, c, mustReq("https://steady."+tunneltest.Domain+"/hello")); s != 200 {
			t.Fatalf("steady tunnel answered %d", s)
		}
	}
	serving()
	base := runtime.NumGoroutine()
	addr := e.Addr("control").String()
	junk := make([]byte, 4096)
	for i := range 20 {
		rand.Read(junk)
		raw, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		raw.Write(junk)
		raw.Close()

		tc, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: e.Roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			tc.Write(junk) // garbage where yamux frames should be
		} else {
			// A valid yamux stream carrying a huge control frame header.
			tc.Write([]byte{0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0})
			tc.Write([]byte{0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5, byte(mux.TypeHello), 0xff, 0xff, 0xff, 0xff})
		}
		tc.Close()
	}
	silent, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: e.Roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	silent.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := silent.Read(make([]byte, 1)); err == nil || errors.Is(err, context.DeadlineExceeded) || isTimeout(err) {
		t.Fatalf("a connection that never says hello was not closed by the edge: %v", err)
	}
	serving()
	c.CloseIdleConnections()
	tunneltest.Eventually(t, 5*time.Second, "goroutines back to their level", func() bool {
		return runtime.NumGoroutine() <= base+3
	})
	serving()
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func mustReq(url string) *http.Request {
	r, err := http.NewRequest("GET", url, nil)
	if err != nil {
		panic(err)
	}
	return r
}

// TestIdleVisitorsAndSlowloris: hundreds of idle connections and a client
// sending its headers a byte at a time: the edge cuts the slow one off and
// keeps serving.
func TestIdleVisitorsAndSlowloris(t *testing.T) {
	b := tunneltest.StartBackend(t)
	cfg := tunneltest.EdgeConfig(t)
	cfg.ReadHeaderTimeout = 500 * time.Millisecond
	e := tunneltest.StartEdge(t, cfg)
	ac := e.AgentConfig("", b.Addr())
	ac.Subdomain = "busy"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	var idle []net.Conn
	t.Cleanup(func() {
		for _, c := range idle {
			c.Close()
		}
	})
	for range 300 {
		conn, err := net.Dial("tcp", e.Addr("http").String())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, conn)
	}
	slow, err := net.Dial("tcp", e.Addr("http").String())
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	start := time.Now()
	cut := make(chan time.Duration, 1)
	go func() {
		msg := "GET /hello HTTP/1.1\r\nHost: busy." + tunneltest.Domain + "\r\nX-Slow: "
		for i := 0; ; i++ {
			if _, err := slow.Write([]byte{msg[i%len(msg)]}); err != nil {
				cut <- time.Since(start)
				return
			}
			if time.Since(start) > 10*time.Second {
				cut <- -1
				return
			}
			time.Sleep(50 * time.Millisecond) // the slowloris's own pace
		}
	}()
	c := e.Client()
	for i := range 20 {
		if s, _ := visitorStatus(t, c, mustReq(fmt.Sprintf("http://busy.%s/hello?i=%d", tunneltest.Domain, i))); s != 200 {
			t.Fatalf("request %d during the attack: %d", i, s)
		}
	}
	if d := <-cut; d < 0 {
		t.Fatal("the slowloris client was never cut off")
	} else {
		t.Logf("slowloris cut off after %s", d.Round(time.Millisecond))
	}
	if s, _ := visitorStatus(t, c, mustReq("https://busy."+tunneltest.Domain+"/hello")); s != 200 {
		t.Fatalf("after the attack: %d", s)
	}
}

// TestConnectionLimits: past the per-address bound, new visitor connections
// are closed at once; closing one frees its place.
func TestConnectionLimits(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.MaxConnsPerIP = 5
	e := tunneltest.StartEdge(t, cfg)
	var held []net.Conn
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
	})
	probe := func() bool {
		c, err := net.Dial("tcp", e.Addr("http").String())
		if err != nil {
			return false
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: x."+tunneltest.Domain+"\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			c.Close()
			return false
		}
		resp.Body.Close()
		held = append(held, c)
		return true
	}
	for i := range 5 {
		if !probe() {
			t.Fatalf("connection %d within the limit refused", i+1)
		}
	}
	if probe() {
		t.Fatal("a sixth connection from one address was served")
	}
	held[0].Close()
	held = held[1:]
	tunneltest.Eventually(t, 5*time.Second, "a freed place to be reusable", probe)
}

// TestTokenBindingLimitRestartedAgent: a token limited to one tunnel lets a
// restarted agent (a new instance) take back the name its dead predecessor
// still holds, and still refuses it a second name.
func TestTokenBindingLimitRestartedAgent(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "one", MaxBindings: 1}}
	cfg.HeartbeatTimeout = time.Minute // the dead agent's binding outlives the test
	e := tunneltest.StartEdge(t, cfg)
	r, _ := e.DialRaw(t, hello("one"))
	if m, ok := r.Bind(t, &mux.Bind{Subdomain: "app"}).(*mux.BindOK); !ok {
		t.Fatalf("first bind: %v", m)
	}
	r.YS.Close() // the agent dies; its binding stays until a new owner takes it
	var code string
	tunneltest.Eventually(t, 5*time.Second, "the restarted agent to get its name back", func() bool {
		code = bindCode(t, e, "one", "app")
		return code == "ok"
	})
	if code = bindCode(t, e, "one", "second"); code != mux.CodeLimitExceeded {
		t.Fatalf("a second name for a token limited to one: %s, want %s", code, mux.CodeLimitExceeded)
	}
}

// TestTakenNameSaysWhenItFrees: a bind refused because another instance
// holds the name says, once that holder has been silent a while, how long
// it has been silent and when the name frees itself: the holder is often
// the user's own agent, on a laptop whose network dropped.
func TestTakenNameSaysWhenItFrees(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = 6 * time.Second // a raw session sends no heartbeats
	e := tunneltest.StartEdge(t, cfg)
	holder, _ := e.DialRaw(t, hello(""))
	if m, ok := holder.Bind(t, &mux.Bind{Subdomain: "mine"}).(*mux.BindOK); !ok {
		t.Fatalf("first bind: %v", m)
	}
	refusal := func() string {
		t.Helper()
		r, _ := e.DialRaw(t, hello(""))
		m, ok := r.Bind(t, &mux.Bind{Subdomain: "mine"}).(*mux.BindError)
		if !ok || m.Code != mux.CodeSubdomainTaken {
			t.Fatalf("a second instance's bind: %v, want %s", m, mux.CodeSubdomainTaken)
		}
		r.YS.Close()
		return m.Message
	}
	if msg := refusal(); strings.Contains(msg, "heard from") {
		t.Errorf("a holder bound a moment ago is called silent: %q", msg)
	}
	var msg string
	tunneltest.Eventually(t, 5*time.Second, "the refusal to name the holder's silence", func() bool {
		msg = refusal()
		return strings.Contains(msg, "has not been heard from for")
	})
	var ds []time.Duration
	for _, f := range strings.FieldsFunc(msg, func(r rune) bool { return r == ' ' || r == ',' }) {
		if d, err := time.ParseDuration(f); err == nil {
			ds = append(ds, d)
		}
	}
	if len(ds) != 2 {
		t.Fatalf("want two durations in %q", msg)
	}
	silent, left := ds[0], ds[1]
	if silent < 2*time.Second || left <= 0 || silent+left < 5900*time.Millisecond || silent+left > 6100*time.Millisecond {
		t.Errorf("silent %s and frees in %s, for a 6s heartbeat timeout: %q", silent, left, msg)
	}
}

// TestEarlyAnswerWhileUploading: the local service answers before it has
// read the visitor's body, while the edge's writer of the stream is still
// waiting for more of it; the exchange ends with the answer and the writer
// is stopped without touching the finished response (an HTTP/2 response
// writer that is used after its handler returned crashes the edge).
func TestEarlyAnswerWhileUploading(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).EnableFullDuplex() // answer now, whatever the body
		w.Header().Set("Content-Length", "5")
		io.WriteString(w, "hello")
	}))
	t.Cleanup(local.Close)
	ac := e.AgentConfig("", local.Listener.Addr().String())
	ac.Subdomain = "early"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	for _, h2 := range []bool{false, true} {
		c := e.Client()
		if !h2 {
			http1Only(c)
		}
		for i := range 20 {
			pr, pw := io.Pipe()
			req, _ := http.NewRequest("POST", tunneltest.URL("https", "early", "/hello"), pr)
			go pw.Write(make([]byte, 1000)) // then nothing, until the answer is in
			resp, err := c.Do(req)
			if err != nil {
				t.Fatalf("h2 %v, round %d: %v", h2, i, err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || string(body) != "hello" || (resp.ProtoMajor == 2) != h2 {
				t.Fatalf("h2 %v, round %d: %s %d %q", h2, i, resp.Proto, resp.StatusCode, body)
			}
			pw.CloseWithError(errors.New("the visitor gives up its upload"))
		}
		c.CloseIdleConnections()
	}
	if code, _ := visitorStatus(t, e.Client(), mustReq(tunneltest.URL("https", "early", "/hello"))); code != http.StatusOK {
		t.Fatalf("the edge after the uploads: %d", code)
	}
}

// TestResponseBrokenOffBeforeBody: an agent whose response head crosses
// the tunnel and whose stream then ends before a byte of the body gets its
// visitor the edge's 502 bad_response (tunnel_interrupted when the whole
// session ends), over HTTP/1.1 and HTTP/2, with none of the broken
// response's fields; not a connection cut or a stream reset with nothing
// on it, which is what the reverse proxy alone gives once it has passed
// the status on.
func TestResponseBrokenOffBeforeBody(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	for _, session := range []bool{false, true} {
		for _, h2 := range []bool{false, true} {
			name := fmt.Sprintf("cut-%v-%v", session, h2)
			r := boundRaw(t, e, name)
			answerStreams(r, func(st net.Conn, _ *http.Request) {
				io.WriteString(st, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\nX-Local: broken\r\n\r\n")
				if session {
					r.YS.Close() // the head is ahead of the session's end in the connection
				}
			})
			c := e.Client()
			if !h2 {
				http1Only(c)
			}
			resp, err := c.Get(tunneltest.URL("https", name, "/"))
			if err != nil {
				t.Fatalf("session ends %v, h2 %v: no response: %v", session, h2, err)
			}
			resp.Body.Close()
			if (resp.ProtoMajor == 2) != h2 {
				t.Fatalf("h2 %v: the visitor spoke %s", h2, resp.Proto)
			}
			code, want := resp.Header.Get(mux.ErrorHeader), mux.CodeBadResponse
			if session {
				want = mux.CodeTunnelInterrupted
			}
			if resp.StatusCode != http.StatusBadGateway || code != string(want) || resp.Header.Get("X-Local") != "" {
				t.Errorf("session ends %v, h2 %v: %d %s=%q X-Local=%q, want 502 %s and no field of the broken response",
					session, h2, resp.StatusCode, mux.ErrorHeader, code, resp.Header.Get("X-Local"), want)
			}
			c.CloseIdleConnections()
		}
	}
}

// TestAgentStatusNotHTTPs: an agent whose status line names no HTTP status
// (net/http reads any three digits: 000, 099 and +20 as below 100, 600,
// 999), or switches protocols for a request that asked for no upgrade,
// gets its visitor 502 bad_response, over HTTP/1.1 and HTTP/2, and the
// visitor's connection serves on. A status under 100 was passed on as an
// informational response, which net/http's server refuses with a panic:
// the visitor's connection (or HTTP/2 stream) was cut with no answer.
func TestAgentStatusNotHTTPs(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	r := boundRaw(t, e, "status")
	final := "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
	replies := map[string]string{
		"/000":     "HTTP/1.1 000 X\r\nContent-Length: 0\r\n\r\n",
		"/099":     "HTTP/1.1 099 X\r\n\r\n" + final,
		"/plus20":  "HTTP/1.1 +20 X\r\n\r\n" + final,
		"/600":     "HTTP/1.1 600 X\r\nContent-Length: 0\r\n\r\n",
		"/999":     "HTTP/1.1 999 X\r\nContent-Length: 0\r\n\r\n",
		"/unasked": "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n",
		"/ok":      final,
	}
	answerStreams(r, func(st net.Conn, req *http.Request) { io.WriteString(st, replies[req.URL.Path]) })
	for _, h2 := range []bool{false, true} {
		c := e.Client()
		if !h2 {
			http1Only(c)
		}
		for path := range replies {
			for _, p := range []string{path, "/ok"} { // and the connection serves on
				resp, err := c.Get(tunneltest.URL("https", "status", p))
				if err != nil {
					t.Fatalf("h2 %v, %s after %s: %v", h2, p, path, err)
				}
				resp.Body.Close()
				status, code := resp.StatusCode, resp.Header.Get(mux.ErrorHeader)
				if p == "/ok" && status != http.StatusOK || p != "/ok" && (status != http.StatusBadGateway || code != mux.CodeBadResponse) {
					t.Errorf("h2 %v, %s after %s: %d %q, want 502 %s (200 for /ok)", h2, p, path, status, code, mux.CodeBadResponse)
				}
			}
		}
		c.CloseIdleConnections()
	}
}

// TestRapidResetVisitor: an HTTP/2 visitor that opens streams and resets
// each at once (RFC 9113's cancel; the rapid reset attack), for requests
// without a body, with one of unknown length and with one larger than a
// stream's first window, cancels requests at every point of their way
// through the edge, before an exchange is set up as well as after. The
// edge serves on, and nothing is left: no stream in flight, no goroutine
// of its own.
// A request whose visitor had left before its exchange started had the
// exchange's end run (on the context's goroutine) while the exchange was
// still being set up: a data race, and a nil function called, which would
// end the process, had that goroutine won it. About a second.
func TestRapidResetVisitor(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	}))
	t.Cleanup(local.Close)
	ac := e.AgentConfig("", local.Listener.Addr().String())
	ac.Subdomain = "app"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	before := peakOf(edgeGoroutines)
	for _, kind := range []string{"get", "chunked", "large"} {
		c, err := tls.Dial("tcp", e.Addr("https").String(), &tls.Config{RootCAs: e.Roots, ServerName: tunnelHost, NextProtos: []string{"h2"}})
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(30 * time.Second))
		io.WriteString(c, http2.ClientPreface)
		fr := http2.NewFramer(c, c)
		fr.WriteSettings()
		go func() { // the edge's frames, read and dropped
			for {
				if _, err := fr.ReadFrame(); err != nil {
					return
				}
			}
		}()
		fields := h2Req("reset")
		switch kind {
		case "chunked":
			fields = append([][2]string{{":method", "POST"}}, fields[1:]...)
		case "large":
			fields = append([][2]string{{":method", "POST"}, {"content-length", strconv.Itoa(4 * mux.InitialWindow)}}, fields[1:]...)
		}
		var block bytes.Buffer
		enc := hpack.NewEncoder(&block)
		for _, f := range fields {
			enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		for i := range 1000 {
			id := uint32(2*i + 1)
			err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block.Bytes(), EndStream: kind == "get", EndHeaders: true})
			if err == nil && kind != "get" {
				err = fr.WriteData(id, false, make([]byte, 1000))
			}
			if err == nil {
				err = fr.WriteRSTStream(id, http2.ErrCodeCancel)
			}
			if err != nil {
				t.Fatalf("%s: stream %d: %v", kind, id, err)
			}
		}
		c.Close()
	}
	tunneltest.Eventually(t, 10*time.Second, "no stream in flight", func() bool {
		return scrape(t, e, "")["ngstone_streams_active"] == 0
	})
	// A reset request's place among its address's requests in flight is
	// given back when its handler returns, which can be after its stream
	// is: until then a request of the same address may be answered 429.
	c := e.Client()
	tunneltest.Eventually(t, 10*time.Second, "a request after the resets to be answered 200", func() bool {
		code, _ := visitorStatus(t, c, mustReq(tunneltest.URL("https", "app", "/")))
		return code == http.StatusOK
	})
	c.CloseIdleConnections()
	deadline := time.Now().Add(10 * time.Second)
	for edgeGoroutines() > before {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for the edge's goroutines of the visitors gone: %d, %d before; the edge's now:\n%s",
				edgeGoroutines(), before, strings.Join(edgeStacks(), "\n\n"))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// edgeGoroutines counts the goroutines running the edge's code (those of
// the local service, the clients' idle connections and the sessions' idle
// streams left aside).
func edgeGoroutines() int { return len(edgeStacks()) }

// peakOf is the most count reports over 100 ms: a baseline for a leak
// check. One snapshot can miss a goroutine that is there to stay, such as
// an HTTP/2 connection's reader between two frames (no edge frame on its
// stack then), and the check would then fail on it.
func peakOf(count func() int) int {
	n := count()
	for range 20 {
		time.Sleep(5 * time.Millisecond)
		n = max(n, count())
	}
	return n
}

// edgeStacks is the stacks of the goroutines running the edge's code, for
// a failure to show what is left. A session's streams kept open between
// exchanges (net/http's persistConn loops, bounded by IdleStreams) are the
// pool's, not a visitor's.
func edgeStacks() []string {
	var out []string
	for g := range strings.SplitSeq(tunneltest.Stacks(), "\n\n") {
		if strings.Contains(g, "ngstone/ngstone/edge.") && !strings.Contains(g, "net/http.(*persistConn)") {
			out = append(out, g)
		}
	}
	return out
}

// boundRaw is a raw agent session of the open edge e holding sub.
func boundRaw(t *testing.T, e *tunneltest.Edge, sub string) *tunneltest.RawSession {
	t.Helper()
	r, m := e.DialRaw(t, hello(""))
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	if m, ok := r.Bind(t, &mux.Bind{Subdomain: sub}).(*mux.BindOK); !ok {
		t.Fatalf("bind %s: %v", sub, m)
	}
	return r
}

// answerStreams has answer write the response to each request the edge
// sends r, until r's session ends.
func answerStreams(r *tunneltest.RawSession, answer func(st net.Conn, req *http.Request)) {
	go func() {
		for {
			st, err := r.YS.AcceptStream()
			if err != nil {
				return
			}
			go func() {
				defer st.Close()
				if req, err := http.ReadRequest(bufio.NewReader(st)); err == nil {
					answer(st, req)
				}
			}()
		}
	}()
}

// http1Only makes c, one of tunneltest.Edge's clients, speak HTTP/1.1 only.
func http1Only(c *http.Client) {
	tr := c.Transport.(*http.Transport)
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetHTTP1(true)
}

// TestWriteTimeoutCutsOnlyStalledVisitors: a visitor who reads nothing of a
// large response is cut once the edge could write nothing for
// --write-timeout, and counted; one who reads slowly, but keeps reading,
// is not cut however long the response takes, since the timeout is counted
// afresh at every write.
func TestWriteTimeoutCutsOnlyStalledVisitors(t *testing.T) {
	const size = 256 << 20
	_, visit, cuts := downloads(t, 2*time.Second, size)
	before := cuts()
	stalled, slow := visit(), visit()

	// The slow visitor reads 16 KiB every 20 ms, for two and a half times
	// the timeout: each of the edge's writes waits on it far less than that.
	slowErr := make(chan error, 1)
	go func() {
		defer slow.Close()
		buf := make([]byte, 16<<10)
		var got int64
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); {
			slow.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := slow.Read(buf)
			got += int64(n)
			if err != nil {
				slowErr <- fmt.Errorf("the slow visitor's connection ended after %d bytes: %w", got, err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		slowErr <- nil
	}()

	tunneltest.Eventually(t, 20*time.Second, "a visitor cut by the write timeout", func() bool { return cuts() > before })
	if err := <-slowErr; err != nil {
		t.Fatal(err)
	}
	counted := cuts() - before
	// The kernels still hold what the edge wrote before the cut; read at
	// once, it ends in the edge's FIN, well short of the body.
	stalled.SetReadDeadline(time.Now().Add(20 * time.Second))
	n, err := io.Copy(io.Discard, stalled)
	if err != nil || n >= size {
		t.Fatalf("the stalled visitor read %d of %d bytes (%v): want its connection cut", n, size, err)
	}
	if counted != 1 {
		t.Errorf("write_timeout counted %v times by the end of the slow visitor's reading, want 1 (the stalled visitor only)", counted)
	}
}

// TestLeftDownloadEndsAtTheAgent: a download whose visitor stopped reading
// and was cut ends at the agent too, within a bound. The agent had filled
// the stream's window and was blocked writing; the edge closed the stream
// and reads no more of it. The edge resets such a stream once the agent has
// not closed it within a second, where yamux would have kept it for five
// minutes, the agent's write blocked and a window of its data held in the
// edge, for every such visitor.
func TestLeftDownloadEndsAtTheAgent(t *testing.T) {
	a, visit, cuts := downloads(t, 500*time.Millisecond, 1<<30)
	before := cuts()
	visit()
	tunneltest.Eventually(t, 10*time.Second, "the download in flight at the agent", func() bool { return a.Stats().Open == 1 })
	tunneltest.Eventually(t, 20*time.Second, "the visitor who reads nothing cut", func() bool { return cuts() > before })
	tunneltest.Eventually(t, 20*time.Second, "the agent's exchange of the cut download to end", func() bool {
		return a.Stats().Open == 0
	})
}

// downloads starts an edge with writeTimeout and a tunnel "big" to the
// test backend, and returns its agent, a visit that asks for a download of
// size bytes over plain HTTP and reads nothing of it (closed at the test's
// end), and the count of visitors the write timeout cut.
func downloads(t *testing.T, writeTimeout time.Duration, size int64) (*tunneltest.Agent, func() *net.TCPConn, func() float64) {
	t.Helper()
	cfg := tunneltest.EdgeConfig(t)
	cfg.WriteTimeout = writeTimeout
	e := tunneltest.StartEdge(t, cfg)
	b := tunneltest.StartBackend(t)
	acfg := e.AgentConfig("", b.Addr())
	acfg.Subdomain = "big"
	a := tunneltest.StartAgent(t, acfg)
	a.WaitOnline(t)
	visit := func() *net.TCPConn {
		c, err := net.Dial("tcp", e.Addr("http").String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		fmt.Fprintf(c, "GET /download?n=%d HTTP/1.1\r\nHost: big.%s\r\n\r\n", size, tunneltest.Domain)
		return c.(*net.TCPConn)
	}
	cuts := func() float64 { return scrape(t, e, "")[`ngstone_limits_total{limit="write_timeout"}`] }
	return a, visit, cuts
}
