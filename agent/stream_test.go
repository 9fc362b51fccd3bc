package agent

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"
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

// TestOwnPathMatchesServer: the agent's own path relays what it takes as
// the session's server and reverse proxy relay it, and what it does not
// take reaches the server as it came. Each request goes to an agent as it
// runs and to one that hands every stream to its server (after reading
// its head, as serveStream hands one over): what the local service saw
// and what came back (informational responses, status, fields but Date,
// body, trailers) are the same.
func TestOwnPathMatchesServer(t *testing.T) {
	local := echoLocal(t)
	agent := relayAgent(t, local)
	server := relayAgentWith(t, local, Config{}, nil, func(a *Agent) { a.serverOnly = true })
	const host = "Host: app.ngstone.test\r\n"
	for _, tc := range []struct {
		name, raw string
		own       bool // the agent's own path takes it
		status    int
	}{
		{"GET", "GET /echo?a=1&b=%20 HTTP/1.1\r\n" + host + "User-Agent: ua\r\nX-Forwarded-For: 192.0.2.1\r\n" +
			"X-Forwarded-Host: app.ngstone.test\r\nX-Forwarded-Proto: https\r\nForwarded: for=evil\r\nX-Real-Ip: 192.0.2.9\r\n" +
			"Accept: text/html\r\nAccept: */*\r\nX-Obs: caf\xe9\r\n\r\n", true, 200},
		{"no User-Agent", "GET /echo HTTP/1.1\r\n" + host + "\r\n", true, 200},
		{"Host with a port", "GET /echo HTTP/1.1\r\nHost: app.ngstone.test:8080\r\n\r\n", true, 200},
		{"HEAD", "HEAD /echo HTTP/1.1\r\n" + host + "\r\n", true, 200},
		{"POST with a length", "POST /echo HTTP/1.1\r\n" + host + "Content-Length: 5\r\n\r\nhello", true, 200},
		{"POST without a body", "POST /echo HTTP/1.1\r\n" + host + "Content-Length: 0\r\n\r\n", true, 200},
		{"POST chunked with trailers", "POST /echo HTTP/1.1\r\n" + host + "Transfer-Encoding: chunked\r\n" +
			"Trailer: X-Sum, X-Forwarded-For\r\nTe: trailers\r\n\r\n5\r\nhello\r\n0\r\nX-Sum: 5\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n", true, 200},
		{"an informational response", "GET /103 HTTP/1.1\r\n" + host + "\r\n", true, 200},
		{"204", "DELETE /204 HTTP/1.1\r\n" + host + "\r\n", true, 204},
		{"304", "GET /304 HTTP/1.1\r\n" + host + "If-None-Match: \"v1\"\r\n\r\n", true, 304},
		{"response trailers", "GET /trailers HTTP/1.1\r\n" + host + "\r\n", true, 200},
		{"hop-by-hop response fields", "GET /hop HTTP/1.1\r\n" + host + "\r\n", true, 200},
		{"streamed response", "GET /stream HTTP/1.1\r\n" + host + "\r\n", true, 200},
		{"a response without a type", "GET /untyped HTTP/1.1\r\n" + host + "\r\n", true, 200},

		{"Expect", "POST /echo HTTP/1.1\r\n" + host + "Expect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", false, 200},
		{"a query the proxy rewrites", "GET /echo?a=1;b=2&c=%zz HTTP/1.1\r\n" + host + "\r\n", false, 200},
		{"hop-by-hop request fields", "GET /echo HTTP/1.1\r\n" + host + "Connection: X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\n\r\n", false, 200},
		{"Te other than trailers", "GET /echo HTTP/1.1\r\n" + host + "Te: gzip\r\n\r\n", false, 200},
		{"HTTP/1.0", "GET /echo HTTP/1.0\r\n" + host + "\r\n", false, 200},
		{"HTTP/1.0 without a type", "GET /untyped HTTP/1.0\r\n" + host + "\r\n", false, 200},
		{"Expect without a type", "POST /untyped HTTP/1.1\r\n" + host + "Expect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", false, 200},
		{"absolute target", "GET http://app.ngstone.test/echo HTTP/1.1\r\n" + host + "\r\n", false, 200},
		{"no Host", "GET /echo HTTP/1.1\r\n\r\n", false, 400},
		{"two Hosts", "GET /echo HTTP/1.1\r\n" + host + "Host: evil.internal\r\n\r\n", false, 400},
		{"a malformed Host", "GET /echo HTTP/1.1\r\nHost: a b\r\n\r\n", false, 400},
		{"a field name with a space", "GET /echo HTTP/1.1\r\n" + host + "Bad Name: 1\r\n\r\n", false, 400},
		{"not HTTP", "SSH-2.0-OpenSSH\r\n\r\n", false, 400},
		{"a head too large", "GET /echo HTTP/1.1\r\n" + host + "X-Big: " + strings.Repeat("a", headKeep) + "\r\n\r\n", false, 431},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := agent.ownPath.Load()
			got := exchangeRaw(t, agent, tc.raw)
			if took := agent.ownPath.Load() != before; took != tc.own {
				t.Errorf("the agent's own path took it: %v, want %v", took, tc.own)
			}
			want := exchangeRaw(t, server, tc.raw)
			if server.ownPath.Load() != 0 {
				t.Fatal("the agent serving every stream with its server took one on its own path")
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("own path:\n%+v\nserver:\n%+v", got, want)
			}
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

// TestHandoffReplaysWhatWasRead: a stream handed to the server reads first
// the bytes read of it, however the reads were cut, then the stream.
func TestHandoffReplaysWhatWasRead(t *testing.T) {
	local := echoLocal(t)
	a := relayAgent(t, local)
	// A request head in pieces, so that it is read in several reads.
	x := open(t, a)
	defer x.c.Close()
	x.c.SetDeadline(time.Now().Add(10 * time.Second))
	parts := []string{"POST /echo HTTP/1.1\r\nHost: app", ".ngstone.test\r\nExpect: 100-", "continue\r\nContent-Length: 11\r\n\r\n", "hello", " world"}
	go func() {
		for _, p := range parts {
			io.WriteString(x.c, p)
			time.Sleep(2 * time.Millisecond)
		}
	}()
	br := bufio.NewReader(x.c)
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode == http.StatusContinue {
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		var seen struct{ Body, Method string }
		if err := json.Unmarshal(b, &seen); err != nil || seen.Body != "hello world" || seen.Method != "POST" {
			t.Fatalf("the local service saw %s (%v), want the POST and its body", b, err)
		}
		return
	}
}
