package edge

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"testing"
)

// TestInformKeepsVisitorHeader: a 1xx passed on to the visitor carries its
// own fields only, without hop-by-hop ones, and the fields already set for
// the final response survive it.
func TestInformKeepsVisitorHeader(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Final", "kept")
		x := &exchange{visitor: w}
		h := http.Header{"Link": {"</a.css>; rel=preload"}, "Connection": {"close"}}
		if err := x.inform(http.StatusEarlyHints, h); err != nil {
			t.Error(err)
		}
		io.WriteString(w, "final")
	}))
	defer srv.Close()
	c := srv.Client()
	defer c.CloseIdleConnections()

	var hints []textproto.MIMEHeader
	trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
		if code == http.StatusEarlyHints {
			hints = append(hints, h)
		}
		return nil
	}}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), "GET", srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "final" {
		t.Fatalf("body %q, %v", body, err)
	}
	if len(hints) != 1 {
		t.Fatalf("got %d early hints, want 1", len(hints))
	}
	if hints[0].Get("Link") != "</a.css>; rel=preload" || hints[0].Get("X-Final") != "" || hints[0].Get("Connection") != "" {
		t.Errorf("the 103 carried %v, want its Link only", hints[0])
	}
	if resp.Header.Get("X-Final") != "kept" || resp.Header.Get("Link") != "" {
		t.Errorf("the final response carried %v, want X-Final and no Link", resp.Header)
	}
}
