package agent

import (
	"encoding/json"
	"slices"
	"testing"
)

// TestHeaderRulesTrailers: the header rules keep their fields out of the
// trailers: the request trailers the local service gets, and the response
// trailers, declared or not, the edge gets.
func TestHeaderRulesTrailers(t *testing.T) {
	local := echoLocal(t)
	cfg := Config{}
	cfg.RequestHeaderAdd = []string{"X-Team: blue"}
	cfg.RequestHeaderRemove = []string{"Cookie"}
	cfg.ResponseHeaderAdd = []string{"X-Sum: 1"}
	cfg.ResponseHeaderRemove = []string{"X-Late"}
	const host = "Host: app.ngstone.test\r\n"
	a := relayAgentWith(t, local, cfg, nil)
	post := exchangeRaw(t, a, "POST /echo HTTP/1.1\r\n"+host+"Transfer-Encoding: chunked\r\nTrailer: X-Team, Cookie, X-Kept\r\n\r\n"+
		"5\r\nhello\r\n0\r\nX-Team: red\r\nCookie: session=1\r\nX-Kept: kept\r\n\r\n")
	var seen struct{ Trailer map[string][]string }
	if err := json.Unmarshal([]byte(post.Body), &seen); err != nil {
		t.Fatalf("%v (%+v)", err, post)
	}
	if want := map[string][]string{"X-Kept": {"kept"}}; len(seen.Trailer) != 1 || !slices.Equal(seen.Trailer["X-Kept"], want["X-Kept"]) {
		t.Errorf("the local service got the trailers %v, want %v", seen.Trailer, want)
	}
	got := exchangeRaw(t, a, "GET /trailers HTTP/1.1\r\n"+host+"\r\n")
	if len(got.Trailer) != 0 || got.Header.Get("X-Sum") != "1" {
		t.Errorf("the edge got the trailers %v and X-Sum %q, want none and the rule's", got.Trailer, got.Header.Get("X-Sum"))
	}
}
