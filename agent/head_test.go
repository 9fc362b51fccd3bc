package agent

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"slices"
	"testing"
)

// FuzzRelayHead checks the relay's framing of a message against net/http's,
// which the edge applies to the same bytes: where both accept a head, they
// agree on how its body ends; and a chunked body the relay passes on
// whole is passed on unchanged and is one net/http reads to its end.
func FuzzRelayHead(f *testing.F) {
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"), false)
	f.Add([]byte("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nT: v\r\n\r\n"), false)
	f.Add([]byte("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"), false)
	f.Add([]byte("HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"), false)
	f.Add([]byte("HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"), false)
	f.Add([]byte("POST /x HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), true)
	f.Add([]byte("GET / HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"), true)
	f.Add([]byte("PUT / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc"), true)
	f.Fuzz(func(t *testing.T, data []byte, request bool) {
		br := bufio.NewReaderSize(bytes.NewReader(data), 4<<10)
		raw, err := readHead(br, nil, 64<<10)
		if err != nil {
			return
		}
		rest := data[len(data)-br.Buffered():]
		var h head
		var goChunked, goClose, bodyless bool
		var goLength int64
		if request {
			h, err = parseRequest(raw)
			if err != nil {
				return
			}
			req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(data)))
			if err != nil {
				return
			}
			goChunked = slices.Equal(req.TransferEncoding, []string{"chunked"})
			goLength = req.ContentLength
			if !h.chunked && h.length < 0 {
				h.length = 0 // a request without framing has no body
			}
		} else {
			h, err = parseResponse(raw)
			if err != nil {
				return
			}
			resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(data)), nil)
			if err != nil {
				return
			}
			goChunked = slices.Equal(resp.TransferEncoding, []string{"chunked"})
			goLength, goClose = resp.ContentLength, resp.Close
			bodyless = h.bodyless(&head{})
			if !bodyless && h.status != 101 {
				closes := h.close || (!h.chunked && h.length < 0)
				if closes != goClose {
					t.Fatalf("close: relay %v, net/http %v", closes, goClose)
				}
			}
		}
		if bodyless || h.status == 101 {
			return
		}
		if h.chunked != goChunked {
			t.Fatalf("chunked: relay %v, net/http %v", h.chunked, goChunked)
		}
		if !h.chunked && h.length >= 0 && h.length != goLength {
			t.Fatalf("length: relay %d, net/http %d", h.length, goLength)
		}
		if !h.chunked {
			return
		}
		var sink bytes.Buffer
		o := outBuf{w: &sink, buf: make([]byte, 0, 64)}
		if err := o.copyChunked(br); err != nil {
			return
		}
		o.flush()
		if !bytes.HasPrefix(rest, sink.Bytes()) {
			t.Fatalf("relayed %q, not a prefix of %q", sink.Bytes(), rest)
		}
		if _, err := io.Copy(io.Discard, httputil.NewChunkedReader(bytes.NewReader(sink.Bytes()))); err != nil {
			t.Fatalf("relayed a chunked body net/http cannot read: %q: %v", sink.Bytes(), err)
		}
	})
}

// FuzzSetHost: replacing the Host field of a head the relay accepts gives
// a head with the same framing, which net/http reads with the new Host and
// the same other fields.
func FuzzSetHost(f *testing.F) {
	f.Add([]byte("GET /x HTTP/1.1\r\nHost: app.ngstone.test\r\nX-Forwarded-Host: app.ngstone.test\r\n\r\n"), "rewrite")
	f.Add([]byte("POST / HTTP/1.1\r\nhost: a\r\nContent-Length: 3\r\nHost-Extra: b\r\n\r\n"), "localhost:3000")
	f.Add([]byte("GET / HTTP/1.1\nHost:a\nTransfer-Encoding: chunked\n\n"), "[::1]:8080")
	f.Add([]byte("GET / HTTP/1.0\r\nX: y\r\n\r\n"), "example.internal")
	f.Fuzz(func(t *testing.T, raw []byte, host string) {
		if !validHostHeader(host) {
			return
		}
		in, err := parseRequest(raw)
		if err != nil {
			return
		}
		out := setHost(nil, raw, host)
		got, err := parseRequest(out)
		if err != nil {
			t.Fatalf("setHost(%q, %q) = %q, which does not parse: %v", raw, host, out, err)
		}
		if got.length != in.length || got.chunked != in.chunked || got.close != in.close || got.upgrade != in.upgrade || got.head != in.head || got.replay != in.replay {
			t.Fatalf("setHost(%q, %q) = %q changed the framing: %+v, was %+v", raw, host, out, got, in)
		}
		before, err1 := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		after, err2 := http.ReadRequest(bufio.NewReader(bytes.NewReader(out)))
		if err1 != nil || before.Host == "" {
			return // net/http refuses it, or it has no Host to replace
		}
		if err2 != nil {
			t.Fatalf("net/http reads %q but not %q: %v", raw, out, err2)
		}
		if after.Host != host {
			t.Fatalf("setHost(%q, %q): net/http reads Host %q", raw, host, after.Host)
		}
		before.Header.Del("Host")
		after.Header.Del("Host")
		if fmt.Sprint(before.Header) != fmt.Sprint(after.Header) || before.RequestURI != after.RequestURI || before.Method != after.Method {
			t.Fatalf("setHost(%q, %q) changed more than Host: %v %v", raw, host, before.Header, after.Header)
		}
	})
}
