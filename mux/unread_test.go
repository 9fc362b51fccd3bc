package mux

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestCloseIfUnread: a response says Connection: close exactly when more
// than KeptUnread of its request's body is unread, or an unknown rest, as
// its head goes; never for no body or one read to its end.
func TestCloseIfUnread(t *testing.T) {
	for _, tc := range []struct {
		name      string
		size      int64 // -1: unknown (chunked)
		body, pre int   // the body's bytes, and those read first
		toEOF     bool  // read once more after them, for the end
		close     bool
	}{
		{name: "unread, at the bound", size: KeptUnread, body: KeptUnread},
		{name: "unread, past the bound", size: KeptUnread + 1, body: KeptUnread + 1, close: true},
		{name: "read down to the bound", size: 3 * KeptUnread, body: 3 * KeptUnread, pre: 2 * KeptUnread},
		{name: "read, not to the bound", size: 3 * KeptUnread, body: 3 * KeptUnread, pre: 2*KeptUnread - 1, close: true},
		{name: "read to its end", size: 3 * KeptUnread, body: 3 * KeptUnread, pre: 3 * KeptUnread, toEOF: true},
		{name: "unknown length, unread", size: -1, body: 10, close: true},
		{name: "unknown length, read to its end", size: -1, body: 10, pre: 10, toEOF: true},
	} {
		b := &CountedBody{ReadCloser: io.NopCloser(strings.NewReader(strings.Repeat("b", tc.body))), Size: tc.size}
		if _, err := io.CopyN(io.Discard, b, int64(tc.pre)); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if tc.toEOF {
			if n, err := b.Read(make([]byte, 1)); n != 0 || err != io.EOF {
				t.Fatalf("%s: read %d, %v past the end", tc.name, n, err)
			}
		}
		h := http.Header{}
		CloseIfUnread(h, b)
		if got := h.Get("Connection") == "close"; got != tc.close || b.EOF() != tc.toEOF {
			t.Errorf("%s: close %v (EOF %v), want %v", tc.name, got, b.EOF(), tc.close)
		}
	}
	h := http.Header{}
	CloseIfUnread(h, nil)
	if len(h) != 0 {
		t.Errorf("no body: %v, want no field", h)
	}
}
