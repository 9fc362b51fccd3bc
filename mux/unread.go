package mux

import (
	"io"
	"net/http"
	"sync/atomic"
)

// A server that answers before reading a request's body cannot take the
// next request on that connection until the rest of the body is read:
// net/http's server reads up to 256 KiB of it after the response, and
// closes the connection when more is left, after a head that said nothing
// of it. The client, which took the connection for kept open, sends its
// next request down it and gets no answer. So both the edge (to HTTP/1.1
// visitors) and the agent (to the edge, on its streams) say
// "Connection: close" in the head of a response that leaves more of the
// body than KeptUnread unread, or an unknown rest.

// KeptUnread is the most of a request body left unread when its response
// starts that still lets its connection carry the next request.
const KeptUnread = 64 << 10

// CountedBody counts what is read of a request body. Size is its length,
// -1 if unknown.
type CountedBody struct {
	io.ReadCloser
	Size int64
	read atomic.Int64
	eof  atomic.Bool
}

func (b *CountedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.read.Add(int64(n))
	if err == io.EOF {
		b.eof.Store(true)
	}
	return n, err
}

// EOF reports whether the body was read to its end.
func (b *CountedBody) EOF() bool { return b.eof.Load() }

// LeavesUnread reports whether more than KeptUnread of the body is still
// unread, or an unknown rest.
func (b *CountedBody) LeavesUnread() bool {
	if b.eof.Load() {
		return false
	}
	return b.Size < 0 || b.Size-b.read.Load() > KeptUnread
}

// CloseIfUnread marks the response whose header is h to end its
// connection when b (nil: no body) leaves an unread rest (LeavesUnread).
// It is called as the final response's head is written.
func CloseIfUnread(h http.Header, b *CountedBody) {
	if b != nil && b.LeavesUnread() {
		h.Set("Connection", "close")
	}
}
