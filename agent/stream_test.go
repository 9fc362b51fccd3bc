package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// echoLocal is a local service that answers with what it received (method,
// target, Host, fields, body, trailers) and, by path, with informational
// responses, no body, trailers, hop-by-hop fields, a streamed body or no
// Content-Type.
func echoLocal(t *testing.T) string {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen, _ := json.Marshal(map[string]any{"method": r.Method, "uri": r.RequestURI, "host": r.Host,
			"header": r.Header, "body": string(b), "trailer": r.Trailer, "length": r.ContentLength})
		h := w.Header()
		h.Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/103":
			h.Set("Link", "</app.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			h.Del("Link")
		case "/204":
			w.WriteHeader(http.StatusNoContent)
			return
		case "/304":
			h.Set("Etag", `"v1"`)
			w.WriteHeader(http.StatusNotModified)
			return
		case "/trailers":
			h.Set("Trailer", "X-Sum")
			w.Write(seen)
			h.Set("X-Sum", "42")
			h.Set(http.TrailerPrefix+"X-Late", "late")
			return
		case "/hop":
			h.Set("Connection", "X-Drop")
			h.Set("X-Drop", "1")
			h.Set("Keep-Alive", "timeout=5")
		case "/untyped":
			h["Content-Type"] = nil // the local service's own server would guess one
		case "/stream":
			w.Write(seen[:1])
			w.(http.Flusher).Flush()
			w.Write(seen[1:])
			return
		}
		w.Write(seen)
	}))
	t.Cleanup(s.Close)
	return s.URL
}

// rawExchange is what came back on a stream for one raw request.
type rawExchange struct {
	Infos   []string // informational responses: status and fields
	Status  int
	Header  http.Header // without Date, which only says when
	Body    string
	Trailer http.Header
	Err     string // the response did not come, or its body did not end
}

// exchangeRaw sends raw on a new stream to r, as the edge would, and reads
// what comes back until the final response's end.
func exchangeRaw(t *testing.T, r *relayTester, raw string) rawExchange {
	t.Helper()
	x := open(t, r)
	defer waitDone(t, x)
	defer x.c.Close()
	x.c.SetDeadline(time.Now().Add(10 * time.Second))
	go io.WriteString(x.c, raw) // a head too large is refused before it is all read
	method, _, _ := strings.Cut(raw, " ")
	var got rawExchange
	for {
		resp, err := http.ReadResponse(x.br, &http.Request{Method: method})
		if err != nil {
			got.Err = err.Error()
			return got
		}
		resp.Header.Del("Date")
		if resp.StatusCode < 200 {
			// For an Expect, net/http's server sends its own 100 when
			// the body is first read, and the local service's may come
			// before or after it: how many arrive is a race, on either
			// path, so one repeated is counted once.
			info := fmt.Sprint(resp.StatusCode, resp.Header)
			if n := len(got.Infos); resp.StatusCode != http.StatusContinue || n == 0 || got.Infos[n-1] != info {
				got.Infos = append(got.Infos, info)
			}
			continue
		}
		b, err := io.ReadAll(resp.Body)
		got.Status, got.Header, got.Body, got.Trailer = resp.StatusCode, resp.Header, string(b), resp.Trailer
		if err != nil {
			got.Err = "broken off" // its text names the connection's ports
		}
		return got
	}
}

// TestStreamServer: every request a stream carries is relayed by the
// session's server and reverse proxy, the malformed ones refused by the
// server with its own status, and a response without a type goes on
// without one.
func TestStreamServer(t *testing.T) {
	local := echoLocal(t)
	agent := relayAgent(t, local)
	const host = "Host: app.ngstone.test\r\n"
	for _, tc := range []struct {
		name, raw string
		status    int
	}{
		{"GET", "GET /echo?a=1&b=%20 HTTP/1.1\r\n" + host + "User-Agent: ua\r\nX-Forwarded-For: 192.0.2.1\r\n" +
			"X-Forwarded-Host: app.ngstone.test\r\nX-Forwarded-Proto: https\r\nForwarded: for=evil\r\nX-Real-Ip: 192.0.2.9\r\n" +
			"Accept: text/html\r\nAccept: */*\r\nX-Obs: caf\xe9\r\n\r\n", 200},
		{"no User-Agent", "GET /echo HTTP/1.1\r\n" + host + "\r\n", 200},
		{"Host with a port", "GET /echo HTTP/1.1\r\nHost: app.ngstone.test:8080\r\n\r\n", 200},
		{"HEAD", "HEAD /echo HTTP/1.1\r\n" + host + "\r\n", 200},
		{"POST with a length", "POST /echo HTTP/1.1\r\n" + host + "Content-Length: 5\r\n\r\nhello", 200},
		{"POST without a body", "POST /echo HTTP/1.1\r\n" + host + "Content-Length: 0\r\n\r\n", 200},
		{"POST chunked with trailers", "POST /echo HTTP/1.1\r\n" + host + "Transfer-Encoding: chunked\r\n" +
			"Trailer: X-Sum, X-Forwarded-For\r\nTe: trailers\r\n\r\n5\r\nhello\r\n0\r\nX-Sum: 5\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n", 200},
		{"an informational response", "GET /103 HTTP/1.1\r\n" + host + "\r\n", 200},
		{"204", "DELETE /204 HTTP/1.1\r\n" + host + "\r\n", 204},
		{"304", "GET /304 HTTP/1.1\r\n" + host + "If-None-Match: \"v1\"\r\n\r\n", 304},
		{"response trailers", "GET /trailers HTTP/1.1\r\n" + host + "\r\n", 200},
		{"hop-by-hop response fields", "GET /hop HTTP/1.1\r\n" + host + "\r\n", 200},
		{"streamed response", "GET /stream HTTP/1.1\r\n" + host + "\r\n", 200},
		{"a response without a type", "GET /untyped HTTP/1.1\r\n" + host + "\r\n", 200},
		{"Expect", "POST /echo HTTP/1.1\r\n" + host + "Expect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", 200},
		{"a query the proxy rewrites", "GET /echo?a=1;b=2&c=%zz HTTP/1.1\r\n" + host + "\r\n", 200},
		{"hop-by-hop request fields", "GET /echo HTTP/1.1\r\n" + host + "Connection: X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\n\r\n", 200},
		{"Te other than trailers", "GET /echo HTTP/1.1\r\n" + host + "Te: gzip\r\n\r\n", 200},
		{"HTTP/1.0", "GET /echo HTTP/1.0\r\n" + host + "\r\n", 200},
		{"HTTP/1.0 without a type", "GET /untyped HTTP/1.0\r\n" + host + "\r\n", 200},
		{"Expect without a type", "POST /untyped HTTP/1.1\r\n" + host + "Expect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", 200},
		{"absolute target", "GET http://app.ngstone.test/echo HTTP/1.1\r\n" + host + "\r\n", 200},
		{"no Host", "GET /echo HTTP/1.1\r\n\r\n", 400},
		{"two Hosts", "GET /echo HTTP/1.1\r\n" + host + "Host: evil.internal\r\n\r\n", 400},
		{"a malformed Host", "GET /echo HTTP/1.1\r\nHost: a b\r\n\r\n", 400},
		{"a field name with a space", "GET /echo HTTP/1.1\r\n" + host + "Bad Name: 1\r\n\r\n", 400},
		{"not HTTP", "SSH-2.0-OpenSSH\r\n\r\n", 400},
		{"a head too large", "GET /echo HTTP/1.1\r\n" + host + "X-Big: " + strings.Repeat("a", mux.MaxRequestHead+16<<10) + "\r\n\r\n", 431},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := exchangeRaw(t, agent, tc.raw)
			if ct, ok := got.Header["Content-Type"]; ok && strings.Contains(tc.raw, " /untyped ") {
				t.Errorf("Content-Type %q, where the local service sent none", ct)
			}
			// A refused head is answered before it is all read: the
			// connection may then be reset under the answer's body.
			if got.Status != tc.status || got.Err != "" && tc.status < 400 {
				t.Errorf("status %d (%s), want %d", got.Status, got.Err, tc.status)
			}
		})
	}
}

// TestStreamCarriesExchangesInTurn: one stream carries exchanges one after
// another, each its own answer, the second written before the first's
// answer is read (as the edge's pool may once the first's body is sent).
func TestStreamCarriesExchangesInTurn(t *testing.T) {
	local := echoLocal(t)
	a := relayAgent(t, local)
	x := open(t, a)
	x.c.SetDeadline(time.Now().Add(10 * time.Second))
	const host = "Host: app.ngstone.test\r\n"
	if _, err := io.WriteString(x.c, "POST /echo HTTP/1.1\r\n"+host+"Content-Length: 5\r\n\r\nfirst"+
		"POST /echo HTTP/1.1\r\n"+host+"Content-Length: 6\r\n\r\nsecond"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"first", "second"} {
		resp, err := http.ReadResponse(x.br, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		var seen struct{ Body string }
		if err := json.Unmarshal(b, &seen); err != nil || seen.Body != want {
			t.Fatalf("answer %s (%v), want the echo of %q", b, err, want)
		}
	}
}

// TestUnreadBodyKeepsStream: a request whose body is answered unread (the
// agent's own 401, before the local service) leaves its stream serving the
// next request: the body is read to its end first, within net/http's
// bound, and the server does not break on it (golang/go#68560).
func TestUnreadBodyKeepsStream(t *testing.T) {
	local := echoLocal(t)
	cfg := Config{}
	cfg.Tunnel.BasicAuth = []string{"alice:correct horse"}
	a := relayAgentWith(t, local, cfg, nil)
	x := open(t, a)
	x.c.SetDeadline(time.Now().Add(10 * time.Second))
	const head = "POST /echo HTTP/1.1\r\nHost: app.ngstone.test\r\nContent-Length: 7\r\n"
	for _, tc := range []struct {
		auth   string
		status int
	}{{"", http.StatusUnauthorized}, {"Authorization: Basic YWxpY2U6Y29ycmVjdCBob3JzZQ==\r\n", http.StatusOK}} {
		if _, err := io.WriteString(x.c, head+tc.auth+"\r\npayload"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(x.br, nil)
		if err != nil {
			t.Fatalf("the request after an unread body: %v", err)
		}
		io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != tc.status || resp.Close {
			t.Fatalf("status %d (close %v), want %d on a stream kept open", resp.StatusCode, resp.Close, tc.status)
		}
	}
}
