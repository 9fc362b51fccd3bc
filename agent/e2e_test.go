package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// setup starts a backend, an edge and an agent bound to name.
func setup(t *testing.T, name string) (*tunneltest.Backend, *tunneltest.Edge, *tunneltest.Agent) {
	t.Helper()
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", b.Addr())
	cfg.Subdomain = name
	a := tunneltest.StartAgent(t, cfg)
	a.WaitOnline(t)
	return b, e, a
}

func get(t *testing.T, c *http.Client, url string) (*http.Response, string) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: read body: %v", url, err)
	}
	return resp, string(body)
}

func TestGetThroughHTTPSAndHTTP(t *testing.T) {
	_, e, a := setup(t, "app")
	st := a.Status()
	if st.URL != "https://app."+tunneltest.Domain+":"+port(e.Addr("https")) {
		t.Errorf("status URL = %q", st.URL)
	}
	c := e.Client()
	for _, scheme := range []string{"https", "http"} {
		resp, body := get(t, c, tunneltest.URL(scheme, "app", "/hello"))
		if resp.StatusCode != 200 || body != "hello" {
			t.Errorf("%s: status %d body %q", scheme, resp.StatusCode, body)
		}
		if scheme == "https" && resp.ProtoMajor != 2 {
			t.Errorf("https: protocol %s, want HTTP/2 negotiated by ALPN", resp.Proto)
		}
	}
	// Host matching ignores case, port and a trailing dot.
	req, _ := http.NewRequest("GET", tunneltest.URL("http", "app", "/hello"), nil)
	req.Host = "APP." + strings.ToUpper(tunneltest.Domain) + ".:8080"
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("mixed-case host with port and dot: status %d", resp.StatusCode)
	}
}

func port(a net.Addr) string {
	_, p, _ := net.SplitHostPort(a.String())
	return p
}

func TestLargeBodiesByteExact(t *testing.T) {
	_, e, _ := setup(t, "big")
	c := e.Client()
	const down, up = 32 << 20, 16 << 20
	want := sha256.New()
	io.Copy(want, tunneltest.Pattern(down))
	// HTTP/2, and HTTP/1.1 over TLS, whose response records the edge
	// writes corked (mux.Cork).
	h1 := h1Client(e)
	got := sha256.New()
	for _, client := range []*http.Client{c, h1} {
		resp, err := client.Get(tunneltest.URL("https", "big", "/download?n=33554432"))
		if err != nil {
			t.Fatal(err)
		}
		got.Reset()
		n, err := io.Copy(got, resp.Body)
		resp.Body.Close()
		if err != nil || n != down || !bytes.Equal(got.Sum(nil), want.Sum(nil)) || resp.ProtoMajor == 2 && client == h1 {
			t.Fatalf("download over %s: %d bytes, err %v, digest match %v", resp.Proto, n, err, bytes.Equal(got.Sum(nil), want.Sum(nil)))
		}
	}

	want.Reset()
	io.Copy(want, tunneltest.Pattern(up))
	resp, err := c.Post(tunneltest.URL("http", "big", "/echo"), "application/octet-stream", tunneltest.Pattern(up))
	if err != nil {
		t.Fatal(err)
	}
	got.Reset()
	n, err := io.Copy(got, resp.Body)
	resp.Body.Close()
	if err != nil || n != up || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
		t.Fatalf("upload echo: %d bytes, err %v", n, err)
	}
}

// TestServerSentEventsStream proves events arrive one by one: the backend
// sends event i+1 only after the client has read event i and acked it.
func TestServerSentEventsStream(t *testing.T) {
	_, e, _ := setup(t, "sse")
	c := e.Client()
	resp, err := c.Get(tunneltest.URL("https", "sse", "/sse?n=3"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if want := "data: event " + string(rune('0'+i)) + "\n"; line != want {
			t.Fatalf("event %d: got %q want %q", i, line, want)
		}
		r.ReadString('\n') // blank line ending the event
		if i < 2 {
			ack, err := c.Get(tunneltest.URL("http", "sse", "/sse-ack"))
			if err != nil {
				t.Fatalf("ack %d: %v", i, err)
			}
			ack.Body.Close()
		}
	}
}

func TestUpgradeRoundTrip(t *testing.T) {
	_, e, _ := setup(t, "ws")
	tunneltest.UpgradeRoundTrip(t, e.Addr("http").String(), "ws")
}

func TestForwardedHeadersFromEdge(t *testing.T) {
	_, e, _ := setup(t, "fwd")
	c := e.Client()
	// Plain HTTP/1.1: HTTP/2 has no Connection header to test stripping with.
	req, _ := http.NewRequest("GET", tunneltest.URL("http", "fwd", "/headers"), nil)
	req.Header.Set("X-Forwarded-For", "6.6.6.6")
	req.Header.Set("X-Forwarded-Host", "evil.example")
	req.Header.Set("X-Forwarded-Proto", "gopher")
	req.Header.Set("Connection", "X-Hop")
	req.Header.Set("X-Hop", "must be stripped")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got struct {
		Host   string
		Header http.Header
	}
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	h := got.Header
	if xff := h.Values("X-Forwarded-For"); len(xff) != 1 || xff[0] != "127.0.0.1" {
		t.Errorf("X-Forwarded-For = %q, want exactly the edge-seen 127.0.0.1", xff)
	}
	if v := h.Get("X-Forwarded-Host"); v != "fwd."+tunneltest.Domain {
		t.Errorf("X-Forwarded-Host = %q", v)
	}
	if v := h.Get("X-Forwarded-Proto"); v != "http" {
		t.Errorf("X-Forwarded-Proto = %q", v)
	}
	if v := h.Get("X-Hop"); v != "" {
		t.Errorf("hop-by-hop header X-Hop reached the backend: %q", v)
	}
	if got.Host != "fwd."+tunneltest.Domain {
		t.Errorf("Host = %q, want the visitor's", got.Host)
	}
}

func TestRandomName(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	a := tunneltest.StartAgent(t, e.AgentConfig("", b.Addr()))
	st := a.WaitOnline(t)
	name, _, _ := strings.Cut(st.Hostname, ".")
	if len(name) < 8 || !strings.HasSuffix(st.Hostname, "."+tunneltest.Domain) {
		t.Fatalf("random hostname %q", st.Hostname)
	}
	resp, body := get(t, e.Client(), tunneltest.URL("https", name, "/hello"))
	if resp.StatusCode != 200 || body != "hello" {
		t.Fatalf("status %d body %q", resp.StatusCode, body)
	}
}

// wantError checks an answer of ngstone's own: its status, code, text
// naming host, and the type of that text.
func wantError(t *testing.T, resp *http.Response, body string, status int, code, host string) {
	t.Helper()
	if resp.StatusCode != status || resp.Header.Get(mux.ErrorHeader) != code || !strings.Contains(body, host) {
		t.Errorf("got %d %s=%q body %q; want %d %s naming %s", resp.StatusCode, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader), body, status, code, host)
	}
	if ct := resp.Header["Content-Type"]; !slices.Equal(ct, []string{"text/plain; charset=utf-8"}) {
		t.Errorf("%s answered with Content-Type %q, want its own text/plain", code, ct)
	}
}

func TestVisitorErrors(t *testing.T) {
	b := tunneltest.StartBackend(t)
	cfg := tunneltest.EdgeConfig(t)
	cfg.TunnelTimeout = 300 * time.Millisecond
	e := tunneltest.StartEdge(t, cfg)
	c := e.Client()

	// A closed port: nothing listens on the backend's address once closed.
	dead := tunneltest.StartBackend(t)
	deadAddr := dead.Addr()
	dead.Close()

	start := func(name, local string, mod func(*agent.Config)) {
		ac := e.AgentConfig("", local)
		ac.Subdomain = name
		if mod != nil {
			mod(&ac)
		}
		tunneltest.StartAgent(t, ac).WaitOnline(t)
	}
	start("unreach", deadAddr, nil)
	start("slowup", b.Addr(), func(c *agent.Config) { c.UpstreamTimeout = 100 * time.Millisecond })
	start("slowtun", b.Addr(), func(c *agent.Config) { c.UpstreamTimeout = 10 * time.Second })

	cases := []struct {
		name, url, host, code string
		status                int
	}{
		{"not bound", tunneltest.URL("https", "nobody", "/"), "nobody." + tunneltest.Domain, mux.CodeTunnelNotFound, 404},
		{"outside domain", "http://other.example/", "other.example", mux.CodeTunnelNotFound, 404},
		{"upstream unreachable", tunneltest.URL("https", "unreach", "/"), "unreach." + tunneltest.Domain, mux.CodeUpstreamUnreachable, 502},
		{"upstream timeout", tunneltest.URL("https", "slowup", "/hang"), "slowup." + tunneltest.Domain, mux.CodeUpstreamTimeout, 504},
		{"tunnel timeout", tunneltest.URL("http", "slowtun", "/hang"), "slowtun." + tunneltest.Domain, mux.CodeTunnelTimeout, 504},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := get(t, c, tc.url)
			wantError(t, resp, body, tc.status, tc.code, tc.host)
		})
	}
}

// TestTunnelInterrupted kills the agent's connection while a request is in
// flight: the visitor gets 502 tunnel_interrupted at once.
func TestTunnelInterrupted(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	p, err := tunneltest.NewFaultProxy(e.Addr("control").String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ac := e.AgentConfig(p.Addr(), b.Addr())
	ac.Subdomain = "cut"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	type result struct {
		resp *http.Response
		body string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := e.Client().Get(tunneltest.URL("https", "cut", "/slow"))
		if err != nil {
			done <- result{err: err}
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{resp: resp, body: string(body)}
	}()
	<-b.Entered
	p.Reset()
	r := <-done
	b.Release()
	if r.err != nil {
		t.Fatal(r.err)
	}
	wantError(t, r.resp, r.body, 502, mux.CodeTunnelInterrupted, "cut."+tunneltest.Domain)
}

// TestTunnelOffline: the binding exists but its holder stopped heartbeating.
func TestTunnelOffline(t *testing.T) {
	b := tunneltest.StartBackend(t)
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = 300 * time.Millisecond
	e := tunneltest.StartEdge(t, cfg)
	p, err := tunneltest.NewFaultProxy(e.Addr("control").String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ac := e.AgentConfig(p.Addr(), b.Addr())
	ac.Subdomain = "off"
	ac.HeartbeatTimeout = time.Minute // the agent does not notice: the edge must
	a := tunneltest.StartAgent(t, ac)
	a.WaitOnline(t)
	p.Block()
	tunneltest.Eventually(t, 5*time.Second, "the edge to see the holder offline", func() bool {
		ts, _ := e.Tunnels(context.Background())
		return len(ts) == 1 && !ts[0].Online
	})
	start := time.Now()
	resp, body := get(t, e.Client(), tunneltest.URL("https", "off", "/hello"))
	wantError(t, resp, body, 503, mux.CodeTunnelOffline, "off."+tunneltest.Domain)
	if resp.Header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("offline answer took %s; it must not hang", d)
	}
	p.Unblock()
	a.Stop()
	if err := a.Err(); err != nil && !errors.Is(err, agent.ErrEvicted) {
		t.Logf("agent ended with %v", err)
	}
}

// TestMessageFramingEndToEnd: what the edge and agent do to a message on
// its way, beyond its bytes: trailers both ways, hop-by-hop fields dropped
// from the response, HEAD, and a response cut short, which the visitor must
// see broken rather than short.
func TestMessageFramingEndToEnd(t *testing.T) {
	local := http.NewServeMux()
	local.HandleFunc("/trailers", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Trailer", "X-Sum")
		w.Write(b)
		w.Header().Set("X-Sum", "req="+r.Trailer.Get("X-Req-Sum"))
	})
	local.HandleFunc("/early", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</app.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		io.WriteString(w, "final")
	})
	local.HandleFunc("/hop", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "X-Secret")
		w.Header().Set("X-Secret", "hop only")
		w.Header().Set("Keep-Alive", "timeout=5")
		w.Header().Set("X-Kept", "yes")
		io.WriteString(w, "ok")
	})
	local.HandleFunc("/head", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		if r.Method != "HEAD" {
			io.WriteString(w, "hello")
		}
	})
	local.HandleFunc("/cut", func(w http.ResponseWriter, r *http.Request) {
		c, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		body := "abc"
		if r.URL.Query().Has("long") {
			body = strings.Repeat("x", 256<<10) // past every buffer on the way
		}
		if r.URL.Query().Has("chunked") {
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n", len(body), body)
		} else {
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body)+7, body)
		}
		c.Close()
	})
	e := serveLocal(t, &http.Server{Handler: local}, "frame")
	c := e.Client()
	waiting := e.Client() // waits for 100 Continue before a body
	waiting.Transport.(*http.Transport).ExpectContinueTimeout = time.Minute

	for _, scheme := range []string{"http", "https"} {
		t.Run(scheme, func(t *testing.T) {
			pr, pw := io.Pipe()
			req, _ := http.NewRequest("POST", tunneltest.URL(scheme, "frame", "/trailers"), pr)
			req.Trailer = http.Header{"X-Req-Sum": nil}
			go func() {
				io.WriteString(pw, "chunked body")
				req.Trailer.Set("X-Req-Sum", "42")
				pw.Close()
			}()
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(body) != "chunked body" || resp.Trailer.Get("X-Sum") != "req=42" {
				t.Errorf("trailers: %q %v, trailer %v", body, err, resp.Trailer)
			}

			// Expect: 100-continue: the visitor's body waits for the
			// edge's 100 and then arrives whole.
			var continued atomic.Bool
			trace := &httptrace.ClientTrace{Got100Continue: func() { continued.Store(true) }}
			req, _ = http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace),
				"POST", tunneltest.URL(scheme, "frame", "/trailers"), strings.NewReader("after continue"))
			req.Header.Set("Expect", "100-continue")
			resp, err = waiting.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(body) != "after continue" || !continued.Load() {
				t.Errorf("Expect: 100-continue: %q %v, got 100 %v", body, err, continued.Load())
			}

			// 103 Early Hints reach the visitor ahead of the response,
			// with their own fields only.
			var hints []string
			trace = &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
				hints = append(hints, fmt.Sprintf("%d %s", code, h.Get("Link")))
				return nil
			}}
			req, _ = http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace),
				"GET", tunneltest.URL(scheme, "frame", "/early"), nil)
			resp, err = c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			if len(hints) != 1 || hints[0] != "103 </app.css>; rel=preload" || string(body) != "final" || resp.Header.Get("Link") != "" {
				t.Errorf("early hints: %q, final %d %q with Link %q", hints, resp.StatusCode, body, resp.Header.Get("Link"))
			}

			resp, body2 := get(t, c, tunneltest.URL(scheme, "frame", "/hop"))
			if body2 != "ok" || resp.Header.Get("X-Kept") != "yes" || resp.Header.Get("X-Secret") != "" || resp.Header.Get("Keep-Alive") != "" {
				t.Errorf("hop-by-hop: %q %v", body2, resp.Header)
			}

			resp, err = c.Head(tunneltest.URL(scheme, "frame", "/head"))
			if err != nil || resp.StatusCode != 200 || resp.ContentLength != 5 {
				t.Errorf("HEAD: %v %v", resp, err)
			} else {
				resp.Body.Close()
			}

			// A response the local service cuts short reaches the
			// visitor broken off, or (when nothing of it had left the
			// agent yet) as the agent's coded 502: never as a whole 200.
			for _, path := range []string{"/cut", "/cut?chunked", "/cut?long", "/cut?long&chunked"} {
				resp, err = c.Get(tunneltest.URL(scheme, "frame", path))
				if err == nil {
					body, err = io.ReadAll(resp.Body)
					resp.Body.Close()
				}
				switch {
				case err != nil:
				case resp.StatusCode == http.StatusBadGateway && resp.Header.Get(mux.ErrorHeader) == mux.CodeBadResponse && !strings.Contains(path, "long"):
				default:
					t.Errorf("%s: a response cut short reached the visitor whole: %d %.40q", path, resp.StatusCode, body)
				}
			}
		})
	}
}

// serveLocal serves srv as a local service on a loopback port until the
// test ends, and returns an edge where an agent puts it at name.
func serveLocal(t *testing.T, srv *http.Server, name string) *tunneltest.Edge {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", ln.Addr().String())
	cfg.Subdomain = name
	tunneltest.StartAgent(t, cfg).WaitOnline(t)
	return e
}

// TestRequestHeadOnTheWire reads the request head as the local service
// receives it, bytes and all: one Content-Length (a second one, even
// equal, makes Node's and nginx's parsers refuse a request), no hop-by-hop
// field, the visitor's Host, one X-Forwarded-For.
func TestRequestHeadOnTheWire(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	heads := make(chan string, 4)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			br := bufio.NewReader(c)
			for {
				var head strings.Builder
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						c.Close()
						goto next
					}
					head.WriteString(line)
					if line == "\r\n" {
						break
					}
				}
				req, _ := http.ReadRequest(bufio.NewReader(strings.NewReader(head.String())))
				if req != nil && req.ContentLength > 0 {
					io.CopyN(io.Discard, br, req.ContentLength)
				}
				heads <- head.String()
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}
		next:
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", ln.Addr().String())
	cfg.Subdomain = "wire"
	tunneltest.StartAgent(t, cfg).WaitOnline(t)
	c := h1Client(e) // HTTP/2 has no Connection header to test with
	for _, scheme := range []string{"http", "https"} {
		req, _ := http.NewRequest("POST", tunneltest.URL(scheme, "wire", "/p?q=1"), strings.NewReader("body"))
		req.Header.Set("Connection", "X-Hop")
		req.Header.Set("X-Hop", "gone")
		req.Header.Set("Keep-Alive", "timeout=5")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		head := <-heads
		lines := strings.Split(head, "\r\n")
		count := func(name string) int {
			n := 0
			for _, l := range lines {
				if k, _, ok := strings.Cut(l, ":"); ok && strings.EqualFold(k, name) {
					n++
				}
			}
			return n
		}
		if lines[0] != "POST /p?q=1 HTTP/1.1" || count("Content-Length") != 1 || count("X-Forwarded-For") != 1 ||
			count("Host") != 1 || !strings.Contains(head, "Host: wire."+tunneltest.Domain+"\r\n") ||
			count("X-Hop") != 0 || count("Keep-Alive") != 0 || count("Connection") != 0 || count("Transfer-Encoding") != 0 {
			t.Errorf("%s: the local service got this head:\n%s", scheme, head)
		}
	}
}

// h1Client is e's client held to HTTP/1.1 over TLS as well.
func h1Client(e *tunneltest.Edge) *http.Client {
	c := e.Client()
	c.Transport.(*http.Transport).ForceAttemptHTTP2 = false
	c.Transport.(*http.Transport).TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	return c
}

// untypedBodies are what the local service of TestNoContentTypeInvented
// sends, by the request's X-Case, without a Content-Type: net/http's
// servers would take the first for text/html, the second for text/plain.
var untypedBodies = map[string]string{
	"html": "<html><script>alert(document.domain)</script></html>",
	"json": `{"html":"<html><script>alert(1)</script>"}`,
}

// typedAs is the Content-Type the local service gives the case "typed",
// spelt as no server would spell it, over a body a server would take for
// another.
const typedAs = "application/json;CHARSET=utf-8"

// TestNoContentTypeInvented: a response the local service sent without a
// Content-Type reaches the visitor without one, where net/http's servers
// (the edge's, over HTTP/1.1 and HTTP/2, and the agent's session server)
// would guess one from its body. A plain request, an Upgrade the local
// service declines and OPTIONS * are run. A response with a type keeps it as it was;
// ngstone's own answers (here for a local service that hangs up) carry
// their own on every way.
func TestNoContentTypeInvented(t *testing.T) {
	srv := &http.Server{DisableGeneralOptionsHandler: true, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		body, untyped := untypedBodies[r.Header.Get("X-Case")]
		switch {
		case r.Header.Get("X-Case") == "hangup":
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				c.Close()
			}
			return
		case untyped:
			w.Header()["Content-Type"] = nil // the local service's own server would guess too
		default:
			body = untypedBodies["html"]
			w.Header().Set("Content-Type", typedAs)
		}
		if r.Header.Get("X-Case") != "json" {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		}
		if r.Method != http.MethodHead {
			io.WriteString(w, body)
			http.NewResponseController(w).Flush() // json: of unknown length, chunked
		}
	})}
	e := serveLocal(t, srv, "types")

	visitors := []struct {
		name, scheme string
		c            *http.Client
		h2           bool
	}{{"http/1.1", "http", h1Client(e), false}, {"https/1.1", "https", h1Client(e), false}, {"h2", "https", e.Client(), true}}
	ways := []struct {
		name string
		h1   bool // HTTP/2 has no Upgrade
		make func(method, url string) *http.Request
	}{
		{"plain", false, func(method, url string) *http.Request {
			req, _ := http.NewRequest(method, url, nil)
			return req
		}},
		{"declined upgrade", true, func(method, url string) *http.Request {
			req, _ := http.NewRequest(method, url, nil)
			req.Header.Set("Connection", "Upgrade")
			req.Header.Set("Upgrade", "ngstone-test")
			return req
		}},
		{"OPTIONS *", false, func(method, url string) *http.Request {
			if method == http.MethodHead {
				return nil
			}
			req, _ := http.NewRequest(http.MethodOptions, url, nil)
			req.URL.Opaque = "*"
			return req
		}},
	}
	for _, v := range visitors {
		for _, way := range ways {
			if way.h1 && v.h2 {
				continue
			}
			t.Run(v.name+"/"+way.name, func(t *testing.T) {
				for _, method := range []string{http.MethodGet, http.MethodHead} {
					for _, kind := range []string{"html", "json", "typed", "hangup"} {
						req := way.make(method, tunneltest.URL(v.scheme, "types", "/"))
						if req == nil {
							continue
						}
						req.Header.Set("X-Case", kind)
						seeType(t, v.c, req)
					}
				}
			})
		}
	}
}

// seeType sends req and checks the Content-Type and body of the response
// to TestNoContentTypeInvented's local service.
func seeType(t *testing.T, c *http.Client, req *http.Request) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.Header.Get("X-Case"), err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	kind := req.Header.Get("X-Case")
	what := fmt.Sprintf("%s %s over %s", req.Method, kind, resp.Proto)
	ctype, typed := resp.Header["Content-Type"]
	want, untyped := untypedBodies[kind]
	switch {
	case err != nil:
		t.Errorf("%s: body: %v", what, err)
	case kind == "hangup":
		if resp.Header.Get(mux.ErrorHeader) == "" || !slices.Equal(ctype, []string{"text/plain; charset=utf-8"}) {
			t.Errorf("%s: ngstone's own answer %d, Content-Type %q, %s %q", what, resp.StatusCode, ctype, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader))
		}
		return
	case resp.StatusCode != http.StatusOK || resp.Header.Get(mux.ErrorHeader) != "":
		t.Errorf("%s: %d %s %q, want the local service's 200", what, resp.StatusCode, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader))
	case untyped && typed:
		t.Errorf("%s: the visitor got Content-Type %q, where the local service sent none", what, ctype)
	case !untyped && !slices.Equal(ctype, []string{typedAs}):
		t.Errorf("%s: the visitor got Content-Type %q, want %q as the local service sent it", what, ctype, typedAs)
	}
	if !untyped {
		want = untypedBodies["html"]
	}
	if req.Method == http.MethodHead {
		want = ""
	}
	if string(b) != want {
		t.Errorf("%s: body %q, want %q", what, b, want)
	}
}

// TestVisitorLeavingCancelsLocalRequest: a visitor who leaves while the
// local service works on its request cancels the local request, with a
// body or without, as net/http's server cancels a request whose client
// went away.
func TestVisitorLeavingCancelsLocalRequest(t *testing.T) {
	entered := make(chan struct{}, 1)
	cancelled := make(chan struct{}, 1)
	local := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // the watch starts once the body has ended
		entered <- struct{}{}
		select {
		case <-r.Context().Done():
			cancelled <- struct{}{}
		case <-time.After(20 * time.Second):
		}
	})}
	e := serveLocal(t, local, "leave")
	host := "leave." + tunneltest.Domain
	for name, req := range map[string]string{
		"GET":  "GET /wait HTTP/1.1\r\nHost: " + host + "\r\n\r\n",
		"POST": "POST /wait HTTP/1.1\r\nHost: " + host + "\r\nContent-Length: 5\r\n\r\nhello",
	} {
		t.Run(name, func(t *testing.T) {
			c, err := net.Dial("tcp", e.Addr("http").String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := io.WriteString(c, req); err != nil {
				t.Fatal(err)
			}
			select {
			case <-entered:
			case <-time.After(10 * time.Second):
				t.Fatal("the request never reached the local service")
			}
			c.Close()
			select {
			case <-cancelled:
			case <-time.After(10 * time.Second):
				t.Fatal("the local request was not cancelled after the visitor left")
			}
		})
	}
}

// TestUpgradeWithInspector: with the inspector on (the CLI's default), an
// upgraded connection crosses, and the inspector lists it once it closes:
// its 101, the protocol, the bytes each way and how long it stayed open,
// none of its data kept.
func TestUpgradeWithInspector(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", b.Addr())
	cfg.Subdomain = "ws"
	cfg.InspectAddr = "127.0.0.1:0"
	a := tunneltest.StartAgent(t, cfg)
	a.WaitOnline(t)
	start := time.Now()
	tunneltest.UpgradeRoundTrip(t, e.Addr("http").String(), "ws")
	open := time.Since(start)
	var c agent.Capture
	tunneltest.Eventually(t, 5*time.Second, "the upgraded exchange listed", func() bool {
		l := a.Inspector().List()
		if len(l) == 1 {
			c = l[0]
		}
		return len(l) == 1
	})
	if c.Status != http.StatusSwitchingProtocols || c.Upgrade != "ngstone-test" || c.Code != "" {
		t.Fatalf("capture: status %d upgrade %q code %q, want 101 ngstone-test", c.Status, c.Upgrade, c.Code)
	}
	if c.Request.Size != int64(len("ping\n")) || c.Response.Size != int64(len("echo: ping\n")) ||
		len(c.Request.Body) != 0 || len(c.Response.Body) != 0 || c.Request.Truncated || c.Response.Truncated {
		t.Errorf("bytes each way: request %d %q, response %d %q; want 5 and 11, none kept",
			c.Request.Size, c.Request.Body, c.Response.Size, c.Response.Body)
	}
	if !strings.HasPrefix(c.Response.Head, "HTTP/1.1 101 Switching Protocols\r\n") || !strings.Contains(c.Response.Head, "Upgrade: ngstone-test") {
		t.Errorf("response head: %q", c.Response.Head)
	}
	if c.Duration <= 0 || c.Duration > open+time.Second {
		t.Errorf("duration %s, the connection was open for about %s", c.Duration, open)
	}
}
