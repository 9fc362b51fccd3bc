package edge_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// What crosses the edge is one rule on every path. The tests here send
// each kind of request a hostile or sloppy visitor sends, by hand, over
// HTTP/1.1 (plain and TLS) and HTTP/2, to an edge holding the agent and to
// another edge of the cluster that forwards it there; a local service
// records the raw bytes it receives. Both paths must give the same: the
// same answer to the visitor, the same bytes to the local service.

// recorder is a local service that keeps each whole request's raw bytes
// (head, body, trailers), by the X-Case field it carries, and answers "ok"
// without a Content-Type.
// A request whose body breaks off is not kept: a relay streams the head
// before it knows whether the body is good.
type recorder struct {
	ln   net.Listener
	mu   sync.Mutex
	seen map[string][]string
	wg   sync.WaitGroup
}

func startRecorder(t *testing.T) *recorder {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &recorder{ln: ln, seen: map[string][]string{}}
	t.Cleanup(func() { ln.Close(); r.wg.Wait() })
	r.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.wg.Go(func() { r.serve(c) })
		}
	})
	return r
}

func (r *recorder) serve(c net.Conn) {
	defer c.Close()
	var raw bytes.Buffer
	br := bufio.NewReader(io.TeeReader(c, &raw))
	for {
		raw.Reset()
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return // not a whole request: a body broken off on the way
		}
		got := raw.Bytes()[:raw.Len()-br.Buffered()]
		r.mu.Lock()
		r.seen[req.Header.Get("X-Case")] = append(r.seen[req.Header.Get("X-Case")], string(got))
		r.mu.Unlock()
		if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
			return
		}
	}
}

// take returns and forgets what the local service received for a case.
func (r *recorder) take(name string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.seen[name]
	delete(r.seen, name)
	return s
}

// answer is what a visitor got: the status, code and Content-Type values
// (%q of them) of the final response, "reset" for a stream or connection
// broken off, and whether anything followed the response on its
// connection.
type answer struct {
	status int
	code   string
	ctype  string
	extra  bool
}

func (a answer) String() string {
	return fmt.Sprintf("%d %s type=%s extra=%v", a.status, a.code, a.ctype, a.extra)
}

// Content-Types an answer may carry: none (the recorder's "ok"), or that
// of ngstone's own answers.
var (
	untyped   = fmt.Sprintf("%q", []string(nil))
	plainText = fmt.Sprintf("%q", []string{"text/plain; charset=utf-8"})
)

// crossCase is one kind of request: raw for HTTP/1.1 (with %s for the
// case name), fields, body and trailers for HTTP/2 (nil: not over HTTP/2).
type crossCase struct {
	name   string
	h1     string
	h2     [][2]string
	h2Body string
	h2Tail [][2]string
	// want is the answer; see, when set, checks each request the local
	// service received (none is expected when want is not 200).
	want answer
	see  func(t *testing.T, proto, raw string)
}

const tunnelHost = "app." + tunneltest.Domain

func h2Req(name string, extra ...[2]string) [][2]string {
	f := [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", tunnelHost}, {":path", "/"}, {"x-case", name}}
	return append(f, extra...)
}

// lacks fails if raw carries any of the fields, by name, in its head or
// trailers.
func lacks(t *testing.T, raw string, names ...string) {
	t.Helper()
	for l := range strings.Lines(raw) {
		k, _, _ := strings.Cut(l, ":")
		for _, n := range names {
			if strings.EqualFold(strings.TrimSpace(k), n) {
				t.Errorf("the local service received %q", strings.TrimSpace(l))
			}
		}
	}
}

// field returns the values of a field in raw's head.
func field(raw, name string) []string {
	var out []string
	for l := range strings.Lines(raw) {
		if l == "\r\n" {
			break
		}
		k, v, ok := strings.Cut(l, ":")
		if ok && strings.EqualFold(k, name) {
			out = append(out, strings.TrimSpace(v))
		}
	}
	return out
}

func crossCases() []crossCase {
	ok := answer{status: 200}
	return []crossCase{
		{name: "plain", h1: "GET / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\n\r\n", h2: h2Req("plain"), want: ok,
			see: func(t *testing.T, proto, raw string) {
				if !strings.HasPrefix(raw, "GET / HTTP/1.1\r\n") || !slices.Equal(field(raw, "Host"), []string{tunnelHost}) ||
					!slices.Equal(field(raw, "X-Forwarded-For"), []string{"127.0.0.1"}) || !slices.Equal(field(raw, "X-Forwarded-Host"), []string{tunnelHost}) {
					t.Errorf("the local service received %q", raw)
				}
			}},
		{name: "spoofed forwarding fields",
			h1: "GET / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\nForwarded: for=203.0.113.9\r\nX-Real-Ip: 203.0.113.9\r\n" +
				"X_forwarded_for: 203.0.113.9\r\nX-Forwarded-For: 203.0.113.9\r\nX-Forwarded-Port: 1\r\nNgstone-Generation: 9\r\n\r\n",
			h2: h2Req("spoofed forwarding fields", [2]string{"forwarded", "for=203.0.113.9"}, [2]string{"x-real-ip", "203.0.113.9"},
				[2]string{"x_forwarded_for", "203.0.113.9"}, [2]string{"x-forwarded-for", "203.0.113.9"}, [2]string{"ngstone-generation", "9"}),
			want: ok,
			see: func(t *testing.T, proto, raw string) {
				lacks(t, raw, "Forwarded", "X-Real-Ip", "X_forwarded_for", "X-Forwarded-Port", "Ngstone-Generation")
				if xff := field(raw, "X-Forwarded-For"); !slices.Equal(xff, []string{"127.0.0.1"}) {
					t.Errorf("X-Forwarded-For %q, want the visitor's address alone", xff)
				}
			}},
		{name: "hop-by-hop", h1: "GET / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\nConnection: X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: Basic eA==\r\n\r\n",
			want: ok,
			see: func(t *testing.T, proto, raw string) {
				lacks(t, raw, "Connection", "X-Hop", "Keep-Alive", "Proxy-Authorization")
				if te := field(raw, "Te"); !slices.Equal(te, []string{"trailers"}) {
					t.Errorf("TE %q, want trailers kept", te)
				}
			}},
		{name: "host beside authority", h2: h2Req("host beside authority", [2]string{"host", "evil.internal"}), want: answer{status: 400, code: mux.CodeBadRequest},
			see: func(t *testing.T, proto, raw string) {
				if h := field(raw, "Host"); !slices.Equal(h, []string{tunnelHost}) {
					t.Errorf("Host %q, want the tunnel's alone", h)
				}
			}},
		{name: "host equal to authority", h2: h2Req("host equal to authority", [2]string{"host", tunnelHost}), want: ok,
			see: func(t *testing.T, proto, raw string) {
				if h := field(raw, "Host"); !slices.Equal(h, []string{tunnelHost}) {
					t.Errorf("Host %q, want one", h)
				}
			}},
		{name: "trailers",
			h1: "POST / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\nTrailer: X-Sum\r\nTransfer-Encoding: chunked\r\n\r\n" +
				"4\r\nbody\r\n0\r\nX-Sum: 42\r\nHost: evil.internal\r\nContent-Length: 99\r\nX-Forwarded-For: 203.0.113.9\r\nX-Extra: undeclared\r\n\r\n",
			h2:     append(h2Req("trailers", [2]string{"trailer", "x-sum"})[:0:0], append([][2]string{{":method", "POST"}}, h2Req("trailers", [2]string{"trailer", "x-sum"})[1:]...)...),
			h2Body: "body",
			// net/http's HTTP/2 server refuses a Host or
			// Content-Length trailer itself (a stream error).
			h2Tail: [][2]string{{"x-sum", "42"}, {"x-forwarded-for", "203.0.113.9"}, {"x-extra", "undeclared"}},
			want:   ok,
			see: func(t *testing.T, proto, raw string) {
				_, tail, _ := strings.Cut(raw, "\r\n0\r\n")
				if !strings.Contains(tail, "X-Sum: 42\r\n") || strings.Contains(tail, "evil") || strings.Contains(tail, "203.0.113.9") ||
					strings.Contains(tail, "undeclared") || strings.Contains(tail, "99") {
					t.Errorf("trailers the local service received: %q (in %q)", tail, raw)
				}
			}},
		{name: "connect", h1: "CONNECT " + tunnelHost + ":443 HTTP/1.1\r\nHost: " + tunnelHost + ":443\r\nX-Case: %s\r\n\r\n",
			h2:   [][2]string{{":method", "CONNECT"}, {":authority", tunnelHost + ":443"}, {"x-case", "connect"}},
			want: answer{status: 405, code: mux.CodeMethodNotAllowed}},
		{name: "absolute form", h1: "GET http://" + tunnelHost + "/abs?x=1 HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\n\r\n", want: ok,
			see: func(t *testing.T, proto, raw string) {
				if !strings.HasPrefix(raw, "GET /abs?x=1 HTTP/1.1\r\n") {
					t.Errorf("request line %q", strings.SplitN(raw, "\r\n", 2)[0])
				}
			}},
		{name: "space in path", h2: append(h2Req("space in path")[:3:3], [2]string{":path", "/a b"}, [2]string{"x-case", "space in path"}),
			want: answer{status: 400, code: mux.CodeBadRequest}},
		{name: "method not a token", h2: append([][2]string{{":method", "GET /secret"}}, h2Req("method not a token")[1:]...),
			want: answer{status: 400, code: mux.CodeBadRequest}},
		{name: "control byte in path", h1: "GET /a\x7fb HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\n\r\n", want: answer{status: 400, code: mux.CodeBadRequest}},
		{name: "headers too large", h1: "GET / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\nX-Big: " + strings.Repeat("x", 70<<10) + "\r\n\r\n",
			want: answer{status: 431, code: mux.CodeHeadersTooLarge}},
		{name: "malformed chunked body", h1: "POST / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nbody\r\n0\r\n\r\n",
			want: answer{status: 400, code: mux.CodeBadRequest}},
		{name: "another domain", h1: "GET / HTTP/1.1\r\nHost: app.example.org\r\nX-Case: %s\r\n\r\n",
			h2:   [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", "app.example.org"}, {":path", "/"}, {"x-case", "another domain"}},
			want: answer{status: 404, code: mux.CodeTunnelNotFound}},
		{name: "host not the TLS name", h1: "GET / HTTP/1.1\r\nHost: other." + tunneltest.Domain + "\r\nX-Case: %s\r\n\r\n",
			h2:   [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", "other." + tunneltest.Domain}, {":path", "/"}, {"x-case", "host not the TLS name"}},
			want: answer{status: 421, code: mux.CodeMisdirected}},
		{name: "no SNI", h1: "GET / HTTP/1.1\r\nHost: " + tunnelHost + "\r\nX-Case: %s\r\n\r\n", h2: h2Req("no SNI"),
			want: answer{status: 421, code: mux.CodeMisdirected}},
	}
}

// TestOneRuleOnEveryPath runs each case over plain HTTP/1.1, HTTP/1.1 over
// TLS and HTTP/2, through the edge that holds the agent and through
// another edge of its cluster, and checks that both paths agree. Towards
// the visitor, the recorder's untyped answer stays untyped on both (the
// owner's server and the first edge's would each guess text/plain for
// it), and ngstone's own answers keep their type.
func TestOneRuleOnEveryPath(t *testing.T) {
	rec := startRecorder(t)
	c := newTestCluster(t)
	owner, other := c.start("a", nil, nil), c.start("b", nil, nil)
	ag := startClusterAgent(t, owner, "", rec.ln.Addr().String(), "app", instX)
	st := ag.WaitOnline(t)
	tunneltest.Eventually(t, 5*time.Second, "b to learn the route", func() bool {
		r, ok := other.store.Lookup(tunnelHost)
		return ok && r.Generation == st.Generation
	})
	for _, tc := range crossCases() {
		for _, proto := range []string{"http/1.1", "https/1.1", "h2"} {
			if proto == "h2" && tc.h2 == nil || proto != "h2" && tc.h1 == "" {
				continue
			}
			t.Run(tc.name+"/"+proto, func(t *testing.T) {
				var got [2]answer
				var seen [2][]string
				for i, e := range []*clusterEdge{owner, other} {
					got[i] = visitRaw(t, e, proto, tc)
					seen[i] = rec.take(tc.name)
				}
				want := tc.want
				switch {
				case proto == "http/1.1" && tc.name == "host not the TLS name":
					want = answer{status: 404, code: mux.CodeTunnelNotFound} // no TLS name to disagree with
				case proto == "http/1.1" && tc.name == "no SNI":
					want = answer{status: 200}
				}
				want.ctype = plainText
				if want.status == 200 {
					want.ctype = untyped
				}
				for i, path := range []string{"own session", "forwarded"} {
					if got[i] != want {
						t.Errorf("%s: the visitor got %s, want %s", path, got[i], want)
					}
					if want.status != 200 && len(seen[i]) > 0 {
						t.Errorf("%s: a refused request reached the local service: %q", path, seen[i])
					}
					if want.status == 200 && len(seen[i]) != 1 {
						t.Errorf("%s: the local service received %d requests, want 1", path, len(seen[i]))
					}
					for _, raw := range seen[i] {
						if tc.see != nil {
							tc.see(t, proto, raw)
						}
					}
				}
				if !slices.Equal(seen[0], seen[1]) {
					t.Errorf("the local service received different bytes through the two paths:\nown session: %q\nforwarded:   %q", seen[0], seen[1])
				}
			})
		}
	}
}

// visitRaw sends tc to e over proto and returns what the visitor got.
func visitRaw(t *testing.T, e *clusterEdge, proto string, tc crossCase) answer {
	t.Helper()
	addr := e.Addr("http").String()
	if proto != "http/1.1" {
		addr = e.Addr("https").String()
	}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	sni := tunnelHost
	switch tc.name {
	case "another domain":
		sni = "app.example.org"
	case "no SNI":
		sni = ""
	}
	switch proto {
	case "h2":
		tlsc := tls.Client(c, &tls.Config{RootCAs: e.Roots, ServerName: sni, NextProtos: []string{"h2"}, InsecureSkipVerify: sni != tunnelHost})
		if sni == "" {
			tlsc = tls.Client(c, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
		}
		return visitH2(t, tlsc, tc)
	case "https/1.1":
		tlsc := tls.Client(c, &tls.Config{RootCAs: e.Roots, ServerName: sni, NextProtos: []string{"http/1.1"}, InsecureSkipVerify: sni != tunnelHost})
		if sni == "" {
			tlsc = tls.Client(c, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"http/1.1"}})
		}
		return visitH1(t, tlsc, tc)
	}
	return visitH1(t, c, tc)
}

// visitH1 writes tc's raw request and reads the response, and then whether
// anything more comes on the connection.
func visitH1(t *testing.T, c net.Conn, tc crossCase) answer {
	t.Helper()
	if _, err := fmt.Fprintf(c, tc.h1, tc.name); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return answer{status: -1, code: "reset"}
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	a := answer{status: resp.StatusCode, code: resp.Header.Get(mux.ErrorHeader), ctype: fmt.Sprintf("%q", resp.Header["Content-Type"])}
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, _ := br.Read(make([]byte, 1)); n > 0 {
		a.extra = true
	}
	return a
}

// visitH2 sends tc's fields (and body and trailers) on one HTTP/2 stream,
// encoded by hand, and reads the response.
func visitH2(t *testing.T, c *tls.Conn, tc crossCase) answer {
	t.Helper()
	if err := c.Handshake(); err != nil || c.ConnectionState().NegotiatedProtocol != "h2" {
		t.Fatalf("h2 handshake: %v (%q)", err, c.ConnectionState().NegotiatedProtocol)
	}
	io.WriteString(c, http2.ClientPreface)
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.WriteSettings()
	block := func(fields [][2]string) []byte {
		var b bytes.Buffer
		enc := hpack.NewEncoder(&b)
		for _, f := range fields {
			enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		return b.Bytes()
	}
	last := tc.h2Body == "" && tc.h2Tail == nil
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block(tc.h2), EndStream: last, EndHeaders: true})
	if tc.h2Body != "" {
		fr.WriteData(1, tc.h2Tail == nil, []byte(tc.h2Body))
	}
	if tc.h2Tail != nil {
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block(tc.h2Tail), EndStream: true, EndHeaders: true})
	}
	var a answer
	var ctype []string
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			if a.status == 0 {
				a = answer{status: -1, code: "reset"}
			}
			return a
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.MetaHeadersFrame:
			if a.status == 0 {
				fmt.Sscan(f.PseudoValue("status"), &a.status)
				ctype = nil
				for _, hf := range f.RegularFields() {
					switch hf.Name {
					case strings.ToLower(mux.ErrorHeader):
						a.code = hf.Value
					case "content-type":
						ctype = append(ctype, hf.Value)
					}
				}
				a.ctype = fmt.Sprintf("%q", ctype)
				if a.status < 200 {
					a.status = 0
				}
			}
			if f.StreamEnded() {
				return a
			}
		case *http2.DataFrame:
			if f.Length > 0 {
				fr.WriteWindowUpdate(0, f.Length)
				fr.WriteWindowUpdate(1, f.Length)
			}
			if f.StreamEnded() {
				return a
			}
		case *http2.RSTStreamFrame:
			if a.status == 0 {
				return answer{status: -1, code: "reset"}
			}
			return a
		case *http2.GoAwayFrame:
			if a.status == 0 {
				return answer{status: -1, code: "reset"}
			}
			return a
		}
	}
}
