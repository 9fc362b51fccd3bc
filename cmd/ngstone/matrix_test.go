package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	testpb "google.golang.org/grpc/interop/grpc_testing"
)

// TestDefaultPath runs what crosses a tunnel through the built binary as
// users start it: `ngstone http PORT` with its embedded edge, and `ngstone
// edge` with `ngstone http PORT --edge`, each with the inspector on (the
// default) and off. Tests of the library's zero values missed that every
// WebSocket failed through the CLI's defaults (the inspector's capture
// broke 101 responses); this matrix is the CLI's defaults.
//
// With the inspector on, the agents listen on --inspect-addr 127.0.0.1:0:
// the default's range (4040-4049) is shared by every agent on the machine,
// and an agent that finds it full runs without an inspector. A case that
// needs a flag beyond the setup's own says so in its name and runs on an
// agent of its own; every other case shares the setup's one agent.
func TestDefaultPath(t *testing.T) {
	t.Parallel()
	for _, embedded := range []bool{true, false} {
		name := "embedded"
		if !embedded {
			name = "separate-edge"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for _, inspect := range []bool{true, false} {
				name := "inspect-on"
				if !inspect {
					name = "inspect-off"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					runMatrix(t, newMatrixSetup(t, embedded, inspect))
				})
			}
		})
	}
}

func runMatrix(t *testing.T, s *matrixSetup) {
	local := newMatrixLocal(t)
	x := s.run(t, s.agent(t, local.port))
	x.local = local
	for _, c := range matrixCases {
		t.Run(c.name, func(t *testing.T) { c.run(t, x) })
	}

	g := newGRPCLocal(t)
	gx := s.run(t, s.agent(t, g.port, "--upstream-protocol", "http2"))
	t.Run("grpc_upstream-protocol_http2", func(t *testing.T) {
		cc := gx.grpcConn(t)
		t.Run("unary", func(t *testing.T) { grpcUnary(t, cc) })
		t.Run("bidi-stream", func(t *testing.T) { grpcBidi(t, cc) })
	})

	ax := s.run(t, s.agent(t, local.port, "--basic-auth", "user:password1234"))
	t.Run("basic-auth_user-password1234", func(t *testing.T) {
		t.Run("without-credentials", func(t *testing.T) {
			resp, _ := ax.get(t, ax.h1, ax.tu.https("/hello"), nil)
			wantAgentError(t, resp, http.StatusUnauthorized, "basic_auth_required")
		})
		t.Run("with-credentials", func(t *testing.T) {
			resp, body := ax.get(t, ax.h1, ax.tu.https("/hello"), func(r *http.Request) { r.SetBasicAuth("user", "password1234") })
			if resp.StatusCode != 200 || string(body) != helloBody {
				t.Fatalf("with credentials: %d %q", resp.StatusCode, body)
			}
		})
	})

	slow := newSlowLocal(t)
	sx := s.run(t, s.agent(t, slow, "--upstream-timeout", "300ms"))
	t.Run("slow-local-service_upstream-timeout_300ms", func(t *testing.T) {
		resp, _ := sx.get(t, sx.h1, sx.tu.https("/"), nil)
		wantAgentError(t, resp, http.StatusGatewayTimeout, "upstream_timeout")
	})

	// Last: it stops the local service of the setup's shared agent.
	t.Run("dead-local-service", func(t *testing.T) {
		local.srv.Close()
		resp, _ := x.get(t, x.h1, x.tu.https("/hello"), nil)
		wantAgentError(t, resp, http.StatusBadGateway, "upstream_unreachable")
	})
	s.checkInspectorOff(t)
}

// matrixCases run on the setup's agent, started with its defaults.
var matrixCases = []struct {
	name string
	run  func(*testing.T, *matrixRun)
}{
	{"get-plain-http", func(t *testing.T, x *matrixRun) { x.getHello(t, x.h1, x.tu.http("/hello"), 1) }},
	{"get-http1", func(t *testing.T, x *matrixRun) { x.getHello(t, x.h1, x.tu.https("/hello"), 1) }},
	{"get-http2", func(t *testing.T, x *matrixRun) { x.getHello(t, x.h2, x.tu.https("/hello"), 2) }},
	{"head-http1", func(t *testing.T, x *matrixRun) { x.head(t, x.h1) }},
	{"head-http2", func(t *testing.T, x *matrixRun) { x.head(t, x.h2) }},
	{"expect-100-continue-http1", func(t *testing.T, x *matrixRun) { x.expectContinue(t, x.h1) }},
	{"expect-100-continue-http2", func(t *testing.T, x *matrixRun) { x.expectContinue(t, x.h2) }},
	{"upload-16MiB-chunked-http1", func(t *testing.T, x *matrixRun) { x.upload(t) }},
	{"download-64MiB-http1", func(t *testing.T, x *matrixRun) { x.download(t, x.h1) }},
	{"download-64MiB-http2", func(t *testing.T, x *matrixRun) { x.download(t, x.h2) }},
	{"sse-http1", func(t *testing.T, x *matrixRun) { x.sse(t, x.h1) }},
	{"sse-http2", func(t *testing.T, x *matrixRun) { x.sse(t, x.h2) }},
	{"websocket-ws", func(t *testing.T, x *matrixRun) { x.websocket(t, "ws", x.tu.httpPort) }},
	{"websocket-wss", func(t *testing.T, x *matrixRun) { x.websocket(t, "wss", x.tu.httpsPort) }},
	{"upgrade-foo-http", func(t *testing.T, x *matrixRun) { x.upgradeFoo(t, x.tu.http("/foo")) }},
	{"upgrade-foo-https", func(t *testing.T, x *matrixRun) { x.upgradeFoo(t, x.tu.https("/foo")) }},
	{"trailers-http1", func(t *testing.T, x *matrixRun) { x.trailers(t, x.h1, 1) }},
	{"trailers-http2", func(t *testing.T, x *matrixRun) { x.trailers(t, x.h2, 2) }},
}

// matrixSetup is one way of running ngstone: which edge, and whether the
// inspector is on.
type matrixSetup struct {
	embedded, inspect bool
	env               []string // the agents' environment
	edge              []string // the agents' flags that name the edge
	caFile            string
	agents            []*proc
}

func newMatrixSetup(t *testing.T, embedded, inspect bool) *matrixSetup {
	s := &matrixSetup{embedded: embedded, inspect: inspect}
	if embedded {
		// One user's cache: the setup's embedded edges share their CA.
		cache := t.TempDir()
		s.env = []string{"XDG_CACHE_HOME=" + cache, "HOME=" + cache}
		s.caFile = filepath.Join(cache, "ngstone", "ca.pem")
		return s
	}
	data := t.TempDir()
	ports := startLocalhostEdge(t, data)
	s.caFile = filepath.Join(data, "ca.pem")
	s.edge = []string{"--edge", "localhost:" + ports[2], "--ca-file", s.caFile}
	return s
}

// agent starts `ngstone http local` with the setup's flags and extra, and
// returns its tunnel once it prints its two Forwarding lines.
func (s *matrixSetup) agent(t *testing.T, local string, extra ...string) matrixTunnel {
	t.Helper()
	args := append([]string{"http", local}, s.edge...)
	if s.inspect {
		args = append(args, "--inspect-addr", "127.0.0.1:0")
	} else {
		args = append(args, "--inspect=false")
	}
	args = append(args, extra...)
	p := startProc(t, s.env, args...)
	s.agents = append(s.agents, p)
	var tu matrixTunnel
	for range 2 {
		m := p.waitLine(t, forwarding)
		if m[4] != "http://localhost:"+local {
			t.Fatalf("Forwarding line %q: want -> http://localhost:%s", m[0], local)
		}
		tu.host = m[2] + ".localhost"
		if m[1] == "https" {
			tu.httpsPort = m[3]
		} else {
			tu.httpPort = m[3]
		}
	}
	if tu.httpsPort == "" || tu.httpPort == "" {
		t.Fatalf("want an https and an http Forwarding line, got %+v", tu)
	}
	if s.inspect {
		// stderr is read apart from stdout: the line logged before the
		// Forwarding lines may arrive after them.
		waitFor(t, 5*time.Second, "the agent to log its inspector", func() bool {
			return strings.Contains(p.stderrText(), `"msg":"inspector"`)
		})
	}
	return tu
}

// checkInspectorOff: no agent of an inspect-off setup started one.
func (s *matrixSetup) checkInspectorOff(t *testing.T) {
	if s.inspect {
		return
	}
	for _, p := range s.agents {
		if e := p.stderrText(); strings.Contains(e, `"msg":"inspector"`) {
			t.Errorf("--inspect=false started an inspector:\n%s", e)
		}
	}
}

// run returns what the cases need for tu: clients that trust the
// setup's CA (which an embedded edge creates as it starts).
func (s *matrixSetup) run(t *testing.T, tu matrixTunnel) *matrixRun {
	t.Helper()
	pem, err := os.ReadFile(s.caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatalf("no certificate in %s", s.caFile)
	}
	return &matrixRun{tu: tu, roots: roots, h1: matrixClient(t, roots, false), h2: matrixClient(t, roots, true)}
}

// matrixTunnel is where a tunnel's visitors reach it.
type matrixTunnel struct {
	host                string // NAME.localhost
	httpsPort, httpPort string
}

func (tu matrixTunnel) https(path string) string {
	return "https://" + tu.host + ":" + tu.httpsPort + path
}

func (tu matrixTunnel) http(path string) string {
	return "http://" + tu.host + ":" + tu.httpPort + path
}

// matrixRun is one tunnel of a setup, its local service and its visitors'
// clients.
type matrixRun struct {
	tu     matrixTunnel
	local  *matrixLocal // the setup's shared one; nil for a case's own agent
	roots  *x509.CertPool
	h1, h2 *http.Client
}

// matrixClient is a visitor speaking HTTP/1.1 only, or HTTP/2 only over
// TLS, to 127.0.0.1 whatever the host. It has no Timeout (with one, a 101
// response's body cannot be written to): each request has a deadline.
func matrixClient(t *testing.T, roots *x509.CertPool, h2 bool) *http.Client {
	var p http.Protocols
	p.SetHTTP1(!h2)
	p.SetHTTP2(h2)
	tr := &http.Transport{
		TLSClientConfig:       &tls.Config{RootCAs: roots},
		DialContext:           dialLoopback,
		Protocols:             &p,
		ExpectContinueTimeout: 10 * time.Second, // far longer than a 100 Continue takes
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func dialLoopback(ctx context.Context, network, addr string) (net.Conn, error) {
	_, port, _ := net.SplitHostPort(addr)
	d := net.Dialer{Timeout: 5 * time.Second}
	return d.DialContext(ctx, network, net.JoinHostPort("127.0.0.1", port))
}

// caseTimeout bounds each exchange of a case.
const caseTimeout = 30 * time.Second

func caseContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), caseTimeout)
	t.Cleanup(cancel)
	return ctx
}

// get sends a GET (edit changes it first) and reads the whole response.
func (x *matrixRun) get(t *testing.T, c *http.Client, url string, edit func(*http.Request)) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(caseContext(t), "GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(req)
	}
	return do(t, c, req)
}

func do(t *testing.T, c *http.Client, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: body: %v", req.Method, req.URL, err)
	}
	return resp, body
}

// wantOK fails unless resp is a 200, telling the agent's or edge's error
// code if it is one of theirs.
func wantOK(t *testing.T, resp *http.Response, body []byte) {
	t.Helper()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s %s: %s (Ngstone-Error %q) %.200q", resp.Request.Method, resp.Request.URL, resp.Status, resp.Header.Get("Ngstone-Error"), body)
	}
}

func wantAgentError(t *testing.T, resp *http.Response, status int, code string) {
	t.Helper()
	if resp.StatusCode != status || resp.Header.Get("Ngstone-Error") != code {
		t.Fatalf("%s: %s with Ngstone-Error %q, want %d %s", resp.Request.URL, resp.Status, resp.Header.Get("Ngstone-Error"), status, code)
	}
}

const helloBody = "hello through the tunnel"

func (x *matrixRun) getHello(t *testing.T, c *http.Client, url string, major int) {
	resp, body := x.get(t, c, url, nil)
	wantOK(t, resp, body)
	if resp.ProtoMajor != major || string(body) != helloBody {
		t.Fatalf("GET %s: %s %q, want HTTP/%d %q", url, resp.Proto, body, major, helloBody)
	}
}

func (x *matrixRun) head(t *testing.T, c *http.Client) {
	req, _ := http.NewRequestWithContext(caseContext(t), "HEAD", x.tu.https("/hello"), nil)
	resp, body := do(t, c, req)
	wantOK(t, resp, body)
	if len(body) != 0 || resp.ContentLength != int64(len(helloBody)) {
		t.Fatalf("HEAD: %d bytes of body, Content-Length %d; want none and %d", len(body), resp.ContentLength, len(helloBody))
	}
}

// expectContinue sends a body only after 100 Continue: the transport waits
// up to its ExpectContinueTimeout (10 s) for it, so a body read before
// the 100 arrived is a 100 that never came.
func (x *matrixRun) expectContinue(t *testing.T, c *http.Client) {
	var got100 atomic.Bool
	ctx := httptrace.WithClientTrace(caseContext(t), &httptrace.ClientTrace{Got100Continue: func() { got100.Store(true) }})
	data := seeded(3, 1<<20)
	body := &firstRead{r: bytes.NewReader(data), seen: got100.Load}
	req, _ := http.NewRequestWithContext(ctx, "POST", x.tu.https("/sum"), body)
	req.ContentLength = int64(len(data))
	req.Header.Set("Expect", "100-continue")
	resp, got := do(t, c, req)
	wantOK(t, resp, got)
	if !body.read || !body.after {
		t.Fatalf("body read %v, after a 100 Continue %v; want both", body.read, body.after)
	}
	wantSum(t, got, sha256.Sum256(data), len(data))
}

// firstRead records whether seen was true when r was first read.
type firstRead struct {
	r           io.Reader
	seen        func() bool
	read, after bool
}

func (f *firstRead) Read(p []byte) (int, error) {
	if !f.read {
		f.read, f.after = true, f.seen()
	}
	return f.r.Read(p)
}

// wantSum checks the local service's "SHA256 LENGTH" answer.
func wantSum(t *testing.T, got []byte, sum [sha256.Size]byte, n int) {
	t.Helper()
	if want := fmt.Sprintf("%x %d", sum, n); string(got) != want {
		t.Fatalf("the local service got %q, want %q", got, want)
	}
}

const (
	uploadSize   = 16 << 20
	downloadSize = 64 << 20
)

func (x *matrixRun) upload(t *testing.T) {
	h := sha256.New()
	body := io.TeeReader(io.LimitReader(rand.NewChaCha8(seed(4)), uploadSize), h)
	req, _ := http.NewRequestWithContext(caseContext(t), "POST", x.tu.https("/sum"), body)
	req.ContentLength = -1 // chunked
	resp, got := do(t, x.h1, req)
	wantOK(t, resp, got)
	wantSum(t, got, [sha256.Size]byte(h.Sum(nil)), uploadSize)
}

func (x *matrixRun) download(t *testing.T, c *http.Client) {
	req, _ := http.NewRequestWithContext(caseContext(t), "GET", x.tu.https("/download"), nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /download: %s (Ngstone-Error %q)", resp.Status, resp.Header.Get("Ngstone-Error"))
	}
	h := sha256.New()
	n, err := io.Copy(h, resp.Body)
	if err != nil || n != downloadSize {
		t.Fatalf("downloaded %d bytes (%v), want %d", n, err, downloadSize)
	}
	select {
	case sent := <-x.local.sent:
		if got := [sha256.Size]byte(h.Sum(nil)); got != sent {
			t.Fatalf("downloaded SHA-256 %x, the local service sent %x", got, sent)
		}
	case <-time.After(caseTimeout):
		t.Fatal("the local service never finished the download")
	}
}

// sseEvents is how many events a stream carries; sseBound is how soon
// the first must reach the visitor after the local service wrote it
// (issue 32).
const (
	sseEvents = 5
	sseBound  = 100 * time.Millisecond
)

// sse has the local service write each event only once the visitor has
// the response's head (and, after that, the previous event), and measures
// from that write to the event's arrival.
func (x *matrixRun) sse(t *testing.T, c *http.Client) {
	req, _ := http.NewRequestWithContext(caseContext(t), "GET", x.tu.https("/sse"), nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /sse: %s (Ngstone-Error %q)", resp.Status, resp.Header.Get("Ngstone-Error"))
	}
	br := bufio.NewReader(resp.Body)
	var lat []time.Duration
	timeout := time.After(caseTimeout)
	for i := range sseEvents {
		select {
		case x.local.sseNext <- struct{}{}:
		case <-timeout:
			t.Fatalf("the local service never asked for event %d", i)
		}
		ev, err := readEvent(br)
		arrived := time.Now()
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if want := fmt.Sprintf("data: event %d", i); ev != want {
			t.Fatalf("event %d: %q, want %q", i, ev, want)
		}
		select {
		case wrote := <-x.local.sseWrote:
			lat = append(lat, arrived.Sub(wrote))
		case <-timeout:
			t.Fatalf("the local service never said it wrote event %d", i)
		}
	}
	t.Logf("%s: write to arrival of each event: %v", resp.Proto, lat)
	if lat[0] > sseBound {
		t.Fatalf("the first event took %v from the local service's write to the visitor, want at most %v", lat[0], sseBound)
	}
}

// readEvent reads one event's lines, up to the blank line that ends it.
func readEvent(br *bufio.Reader) (string, error) {
	var lines []string
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			return "", err
		}
		l = strings.TrimSuffix(l, "\n")
		if l == "" {
			return strings.Join(lines, "\n"), nil
		}
		lines = append(lines, l)
	}
}

func (x *matrixRun) websocket(t *testing.T, scheme, port string) {
	d := websocket.Dialer{NetDialContext: dialLoopback, TLSClientConfig: &tls.Config{RootCAs: x.roots}, HandshakeTimeout: 10 * time.Second}
	u := scheme + "://" + x.tu.host + ":" + port + "/ws"
	c, resp, err := d.DialContext(caseContext(t), u, nil)
	if err != nil {
		if resp != nil {
			t.Fatalf("dial %s: %v: %s (Ngstone-Error %q)", u, err, resp.Status, resp.Header.Get("Ngstone-Error"))
		}
		t.Fatalf("dial %s: %v", u, err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(caseTimeout))
	for i, n := range []int{1, 64 << 10, 4 << 20} {
		msg := seeded(uint64(10+i), n)
		if err := c.WriteMessage(websocket.BinaryMessage, msg); err != nil {
			t.Fatalf("write %d bytes: %v", n, err)
		}
		typ, got, err := c.ReadMessage()
		if err != nil || typ != websocket.BinaryMessage || !bytes.Equal(got, msg) {
			t.Fatalf("echo of %d bytes: type %d, %d bytes, equal %v, %v", n, typ, len(got), bytes.Equal(got, msg), err)
		}
	}

	// The local service answers the ping as it reads it, before it reads
	// and echoes the next message: the pong comes first.
	pong := make(chan string, 1)
	c.SetPongHandler(func(s string) error { pong <- s; return nil })
	if err := c.WriteControl(websocket.PingMessage, []byte("are you there"), time.Now().Add(caseTimeout)); err != nil {
		t.Fatal(err)
	}
	if err := c.WriteMessage(websocket.TextMessage, []byte("after the ping")); err != nil {
		t.Fatal(err)
	}
	if _, got, err := c.ReadMessage(); err != nil || string(got) != "after the ping" {
		t.Fatalf("echo after the ping: %q %v", got, err)
	}
	select {
	case p := <-pong:
		if p != "are you there" {
			t.Fatalf("pong %q", p)
		}
	default:
		t.Fatal("no pong before the echo of the message after the ping")
	}

	if err := c.WriteMessage(websocket.TextMessage, []byte(wsClosePlease)); err != nil {
		t.Fatal(err)
	}
	_, _, err = c.ReadMessage()
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code != wsCloseCode || ce.Text != wsCloseText {
		t.Fatalf("after asking the local service to close: %v, want close %d %q", err, wsCloseCode, wsCloseText)
	}
}

// The local service's WebSocket closes with wsCloseCode when sent
// wsClosePlease.
const (
	wsClosePlease = "close please"
	wsCloseCode   = 4001
	wsCloseText   = "closing as asked"
)

// upgradeFoo switches a connection to the protocol "foo": the local
// service speaks first, then echoes a binary blob.
func (x *matrixRun) upgradeFoo(t *testing.T, url string) {
	req, _ := http.NewRequestWithContext(caseContext(t), "GET", url, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "foo")
	resp, err := x.h1.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("Upgrade") != "foo" {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		t.Fatalf("Upgrade: foo: %s (Upgrade %q, Ngstone-Error %q) %q", resp.Status, resp.Header.Get("Upgrade"), resp.Header.Get("Ngstone-Error"), b)
	}
	rw, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		t.Fatalf("101 body %T is not writable", resp.Body)
	}
	stop := time.AfterFunc(caseTimeout, func() { rw.Close() })
	defer stop.Stop()
	greeting := make([]byte, len(fooGreeting))
	if _, err := io.ReadFull(rw, greeting); err != nil || string(greeting) != fooGreeting {
		t.Fatalf("the local service's first bytes: %q %v", greeting, err)
	}
	blob := seeded(5, fooBlob)
	if _, err := rw.Write(blob); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, fooBlob)
	if _, err := io.ReadFull(rw, got); err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("echo of %d raw bytes: equal %v, %v", fooBlob, bytes.Equal(got, blob), err)
	}
}

const (
	fooGreeting = "foo: the local service speaks first\n"
	fooBlob     = 64 << 10
)

func (x *matrixRun) trailers(t *testing.T, c *http.Client, major int) {
	resp, body := x.get(t, c, x.tu.https("/trailer"), nil)
	wantOK(t, resp, body)
	want := trailerSum()
	if resp.ProtoMajor != major || string(body) != trailerBody || resp.Trailer.Get("X-Checksum") != want {
		t.Fatalf("%s %q, trailers %v; want HTTP/%d %q and X-Checksum %s", resp.Proto, body, resp.Trailer, major, trailerBody, want)
	}
}

const trailerBody = "a body with a trailer after it"

func trailerSum() string {
	sum := sha256.Sum256([]byte(trailerBody))
	return hex.EncodeToString(sum[:])
}

// matrixLocal is the local service of a setup's agent.
type matrixLocal struct {
	srv      *httptest.Server
	port     string
	sseNext  chan struct{}          // the visitor is ready for the next event
	sseWrote chan time.Time         // when each event was written
	sent     chan [sha256.Size]byte // the SHA-256 of each download, as written
	upgrader websocket.Upgrader
}

func newMatrixLocal(t *testing.T) *matrixLocal {
	l := &matrixLocal{sseNext: make(chan struct{}), sseWrote: make(chan time.Time, sseEvents), sent: make(chan [sha256.Size]byte, 1)}
	mux := http.NewServeMux()
	mux.HandleFunc("/hello", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(helloBody)))
		io.WriteString(w, helloBody)
	})
	mux.HandleFunc("/sum", func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		fmt.Fprintf(w, "%x %d", h.Sum(nil), n)
	})
	mux.HandleFunc("/download", l.download)
	mux.HandleFunc("/sse", l.sse)
	mux.HandleFunc("/ws", l.websocket)
	mux.HandleFunc("/foo", fooHandler)
	mux.HandleFunc("/trailer", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		io.WriteString(w, trailerBody)
		http.NewResponseController(w).Flush()
		w.Header().Set("X-Checksum", trailerSum())
	})
	l.srv, l.port = backend(t, mux.ServeHTTP)
	return l
}

func (l *matrixLocal) download(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Length", strconv.Itoa(downloadSize))
	h := sha256.New()
	io.Copy(io.MultiWriter(w, h), io.LimitReader(rand.NewChaCha8(seed(6)), downloadSize))
	select {
	case l.sent <- [sha256.Size]byte(h.Sum(nil)):
	default: // nobody took the last one: its case failed
	}
}

func (l *matrixLocal) sse(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	rc.Flush()
	for i := range sseEvents {
		select {
		case <-l.sseNext:
		case <-r.Context().Done():
			return
		}
		at := time.Now()
		fmt.Fprintf(w, "data: event %d\n\n", i)
		rc.Flush()
		l.sseWrote <- at
	}
	<-r.Context().Done() // the stream stays open: no event arrives by its end
}

func (l *matrixLocal) websocket(w http.ResponseWriter, r *http.Request) {
	c, err := l.upgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(caseTimeout))
	for {
		typ, msg, err := c.ReadMessage()
		if err != nil {
			return
		}
		if typ == websocket.TextMessage && string(msg) == wsClosePlease {
			c.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(wsCloseCode, wsCloseText), time.Now().Add(caseTimeout))
			for { // until the visitor's close answers ours
				if _, _, err := c.ReadMessage(); err != nil {
					return
				}
			}
		}
		if err := c.WriteMessage(typ, msg); err != nil {
			return
		}
	}
}

// fooHandler answers Upgrade: foo itself on the hijacked connection: a
// greeting, then the echo of fooBlob bytes.
func fooHandler(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Upgrade") != "foo" {
		http.Error(w, "want Upgrade: foo", http.StatusBadRequest)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(caseTimeout))
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: foo\r\n\r\n" + fooGreeting)
	if brw.Flush() != nil {
		return
	}
	blob := make([]byte, fooBlob)
	if _, err := io.ReadFull(brw, blob); err != nil {
		return
	}
	conn.Write(blob)
	io.Copy(io.Discard, brw) // until the visitor closes
}

// newSlowLocal is a local service that never answers; its port.
func newSlowLocal(t *testing.T) string {
	release := make(chan struct{})
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	t.Cleanup(func() { close(release) }) // before the server's Close waits for handlers
	return port
}

// grpcEcho is a local gRPC service: unary calls and a bidirectional stream
// echoed.
type grpcEcho struct {
	testpb.UnimplementedTestServiceServer
}

func (grpcEcho) UnaryCall(_ context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	return &testpb.SimpleResponse{Payload: &testpb.Payload{Body: append([]byte("echo:"), req.GetPayload().GetBody()...)}}, nil
}

func (grpcEcho) FullDuplexCall(stream testpb.TestService_FullDuplexCallServer) error {
	for {
		req, err := stream.Recv()
		if err != nil {
			return nil // io.EOF: the client is done
		}
		if err := stream.Send(&testpb.StreamingOutputCallResponse{Payload: req.GetPayload()}); err != nil {
			return err
		}
	}
}

type grpcLocal struct{ port string }

// newGRPCLocal serves grpcEcho over h2c (plaintext HTTP/2) on a loopback
// port.
func newGRPCLocal(t *testing.T) grpcLocal {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	testpb.RegisterTestServiceServer(s, grpcEcho{})
	go s.Serve(ln)
	t.Cleanup(s.Stop)
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return grpcLocal{port: port}
}

// grpcConn dials the edge's HTTPS listener for the tunnel's host: its
// authority (and, without the port, the TLS server name) is HOST:PORT, as
// a client given the tunnel's address would send.
func (x *matrixRun) grpcConn(t *testing.T) testpb.TestServiceClient {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///127.0.0.1:"+x.tu.httpsPort,
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: x.roots})),
		grpc.WithAuthority(x.tu.host+":"+x.tu.httpsPort))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return testpb.NewTestServiceClient(cc)
}

func grpcUnary(t *testing.T, c testpb.TestServiceClient) {
	resp, err := c.UnaryCall(caseContext(t), &testpb.SimpleRequest{Payload: &testpb.Payload{Body: []byte("hi")}})
	if err != nil || string(resp.GetPayload().GetBody()) != "echo:hi" {
		t.Fatalf("unary call: %v %v", resp, err)
	}
}

// grpcBidi has each message answered before it sends the next.
func grpcBidi(t *testing.T, c testpb.TestServiceClient) {
	s, err := c.FullDuplexCall(caseContext(t))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		body := []byte(strings.Repeat(strconv.Itoa(i), 1000*i+1))
		if err := s.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: body}}); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		m, err := s.Recv()
		if err != nil || !bytes.Equal(m.GetPayload().GetBody(), body) {
			t.Fatalf("answer %d: %d bytes, %v", i, len(m.GetPayload().GetBody()), err)
		}
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Fatalf("end of the stream: %v, want io.EOF", err)
	}
}

// seeded returns n bytes that are the same for the same seed.
func seeded(s uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8(seed(s)).Read(b)
	return b
}

func seed(s uint64) (k [32]byte) {
	k[0] = byte(s)
	return k
}
