package edge

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/ngstone/ngstone/mux"
)

// TestSpareFor: the agent's spare stream is for a body that a new stream's
// first window would hold back, or that may be as long: not for a request
// without a body, nor one whose body fits that window.
func TestSpareFor(t *testing.T) {
	body := func(n int64) *http.Request {
		r, _ := http.NewRequest(http.MethodPost, "http://app.example.net/", io.NopCloser(strings.NewReader("x")))
		r.ContentLength = n
		return r
	}
	get, _ := http.NewRequest(http.MethodGet, "http://app.example.net/", nil)
	for _, tc := range []struct {
		name string
		req  *http.Request
		want bool
	}{
		{"no body", get, false},
		{"no body, NoBody", body(0), false},
		{"fits the first window", body(mux.InitialWindow), false},
		{"over the first window", body(mux.InitialWindow + 1), true},
		{"unknown length", body(-1), true},
	} {
		if tc.name == "no body, NoBody" {
			tc.req.Body = http.NoBody
		}
		if got := spareFor(tc.req); got != tc.want {
			t.Errorf("%s: spareFor = %v, want %v", tc.name, got, tc.want)
		}
	}
}
