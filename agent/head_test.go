package agent

import (
	"bufio"
	"bytes"
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
