package agent

import (
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ngstone/ngstone/mux"
)

// TestBasicAuth: with --basic-auth, a request without one of the pairs
// gets 401 basic_auth_required (with WWW-Authenticate) from the agent and
// never reaches the local service; one with a pair goes through.
func TestBasicAuth(t *testing.T) {
	var hits atomic.Int32
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		io.WriteString(w, "secret page")
	})
	a := relayAgentWith(t, s.URL, Config{Tunnel: Tunnel{BasicAuth: []string{"alice:correct horse", "bob:pass,word:1"}}}, slog.New(slog.DiscardHandler))
	for _, tc := range []struct {
		name, user, pass, body string
		set                    bool
		want                   int
	}{
		{name: "no credentials", want: 401},
		{name: "wrong password", user: "alice", pass: "battery staple", set: true, want: 401},
		{name: "unknown user", user: "mallory", pass: "correct horse", set: true, want: 401},
		{name: "wrong password, with a body", user: "alice", pass: "x", set: true, body: "payload", want: 401},
		{name: "first pair", user: "alice", pass: "correct horse", set: true, want: 200},
		{name: "second pair, colon and comma in the password", user: "bob", pass: "pass,word:1", set: true, want: 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := hits.Load()
			var body io.Reader
			method := "GET"
			if tc.body != "" {
				method, body = "POST", strings.NewReader(tc.body)
			}
			req, _ := http.NewRequest(method, "http://app.ngstone.test/", body)
			if tc.set {
				req.SetBasicAuth(tc.user, tc.pass)
			}
			resp, got, err := relayOnce(t, a, req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d %q, want %d", resp.StatusCode, got, tc.want)
			}
			reached := hits.Load() != before
			if tc.want == 401 {
				if reached {
					t.Fatal("the local service saw a request without valid credentials")
				}
				wantVisitorError(t, resp, got, mux.CodeBasicAuthRequired)
				if h := resp.Header.Get("WWW-Authenticate"); !strings.HasPrefix(h, "Basic ") {
					t.Fatalf("WWW-Authenticate %q, want a Basic challenge", h)
				}
			} else if !reached || got != "secret page" {
				t.Fatalf("valid credentials: reached %v, body %q", reached, got)
			}
		})
	}
}
