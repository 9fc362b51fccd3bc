package agent_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestHeaderRules: through a real edge, the local service sees the fields
// --request-header-add sets (replacing the visitor's of that name) and not
// those --request-header-remove names; the visitor sees the fields
// --response-header-add sets and not those --response-header-remove
// names; what the edge sets about the visitor (X-Forwarded-For) stays the
// edge's, over HTTP/1.1 and HTTP/2.
func TestHeaderRules(t *testing.T) {
	visits := rulesVisits(t, "rules", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Server", "local/1.0")
		w.Header().Set("X-Powered-By", "php")
		w.Header().Set("X-Kept", "kept")
		w.Header().Set("X-Version", "local's")
		json.NewEncoder(w).Encode(r.Header)
	}, func(ac *agent.Config) {
		ac.RequestHeaderAdd = []string{"X-Team: blue", "x-role: a", "X-Role:b", "X-Auth: from-the-agent"}
		ac.RequestHeaderRemove = []string{"X-Secret", "cookie"}
		ac.ResponseHeaderAdd = []string{"Strict-Transport-Security: max-age=63072000", "X-Version: 2"}
		ac.ResponseHeaderRemove = []string{"server", "X-Powered-By"}
	})
	for _, c := range visits {
		req, _ := http.NewRequest("GET", c.url, nil)
		req.Header.Set("X-Secret", "s3cret")
		req.Header.Set("Cookie", "session=1")
		req.Header.Set("X-Auth", "forged by the visitor")
		req.Header.Set("X-Forwarded-For", "6.6.6.6")
		req.Header.Set("X-Visitor", "kept")
		var got http.Header
		resp := c.doJSON(t, req, &got)
		for k, want := range map[string][]string{
			"X-Team": {"blue"}, "X-Role": {"a", "b"}, "X-Auth": {"from-the-agent"}, "X-Visitor": {"kept"},
			"X-Secret": nil, "Cookie": nil, "X-Forwarded-For": {"127.0.0.1"},
		} {
			if !slices.Equal(got[k], want) {
				t.Errorf("%s: the local service saw %s %q, want %q", c.name, k, got[k], want)
			}
		}
		for k, want := range map[string][]string{
			"Strict-Transport-Security": {"max-age=63072000"}, "X-Version": {"2"}, "X-Kept": {"kept"},
			"Server": nil, "X-Powered-By": nil,
		} {
			if !slices.Equal(resp.Header[k], want) {
				t.Errorf("%s: the visitor saw %s %q, want %q", c.name, k, resp.Header[k], want)
			}
		}
	}
}

// TestHeaderRulesRefused: a rule on a field the edge sets about the
// visitor, on the edge's own fields or on the message's framing is refused
// before the agent connects, with a sentence naming the rule; so is a rule
// that is not a header.
func TestHeaderRulesRefused(t *testing.T) {
	for _, c := range []struct {
		set     func(*agent.Config)
		mention string
	}{
		{func(c *agent.Config) { c.RequestHeaderAdd = []string{"X-Forwarded-For: 1.2.3.4"} }, "X-Forwarded-For"},
		{func(c *agent.Config) { c.RequestHeaderAdd = []string{"x-forwarded-proto: http"} }, "X-Forwarded-Proto"},
		{func(c *agent.Config) { c.RequestHeaderRemove = []string{"X-Forwarded-For"} }, "X-Forwarded-For"},
		{func(c *agent.Config) { c.RequestHeaderAdd = []string{"Forwarded: for=1.2.3.4"} }, "Forwarded"},
		{func(c *agent.Config) { c.RequestHeaderAdd = []string{"X-Real-IP: 1.2.3.4"} }, "X-Real-Ip"},
		{func(c *agent.Config) { c.ResponseHeaderAdd = []string{"Ngstone-Error: tunnel_offline"} }, "Ngstone-Error"},
		{func(c *agent.Config) { c.RequestHeaderRemove = []string{"Host"} }, "Host"},
		{func(c *agent.Config) { c.ResponseHeaderAdd = []string{"Content-Length: 5"} }, "Content-Length"},
		{func(c *agent.Config) { c.ResponseHeaderRemove = []string{"Transfer-Encoding"} }, "Transfer-Encoding"},
		{func(c *agent.Config) { c.RequestHeaderRemove = []string{"content_length"} }, "framing"},
		{func(c *agent.Config) { c.ResponseHeaderAdd = []string{"Transfer_Encoding: gzip"} }, "framing"},
		{func(c *agent.Config) { c.RequestHeaderAdd = []string{"no colon"} }, "Name: value"},
		{func(c *agent.Config) { c.RequestHeaderAdd = []string{"Bad Name: v"} }, "not a header field name"},
		{func(c *agent.Config) { c.ResponseHeaderAdd = []string{"X-A: line\r\nX-B: injected"} }, "bytes a header may not"},
	} {
		cfg := agent.DefaultConfig()
		cfg.Edge, cfg.Local = "127.0.0.1:1", "127.0.0.1:2"
		c.set(&cfg)
		_, err := agent.New(cfg, tunneltest.Logger())
		if err == nil || !strings.Contains(err.Error(), c.mention) {
			t.Errorf("%+v: %v, want refused mentioning %q", cfg.RequestHeaderAdd, err, c.mention)
		}
	}
}

// TestHeaderRulesCoverTrailers: a field a header rule sets or removes does
// not cross as a trailer either, through a real edge over HTTP/1.1 and
// HTTP/2: a visitor's chunked POST declaring X-Team, Cookie and
// X-Auth-User as trailers delivers none of them to the local service
// (where the rules set X-Team and X-Auth-User and remove Cookie), and the
// local service's trailers of the response rules' fields (declared, or
// sent undeclared) do not reach the visitor. Other trailers cross.
func TestHeaderRulesCoverTrailers(t *testing.T) {
	visits := rulesVisits(t, "trailers", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		h := w.Header()
		h.Set("Trailer", "Server, X-Version, X-Kept")
		json.NewEncoder(w).Encode(map[string]http.Header{"header": r.Header, "trailer": r.Trailer})
		h.Set("Server", "local/1.0")
		h.Set("X-Version", "local's")
		h.Set("X-Kept", "kept")
		h.Set(http.TrailerPrefix+"X-Powered-By", "php")
	}, func(ac *agent.Config) {
		ac.RequestHeaderAdd = []string{"X-Team: blue", "X-Auth-User: from-the-agent"}
		ac.RequestHeaderRemove = []string{"Cookie"}
		ac.ResponseHeaderAdd = []string{"X-Version: 2"}
		ac.ResponseHeaderRemove = []string{"Server", "X-Powered-By"}
	})
	for _, c := range visits {
		body := io.MultiReader(strings.NewReader("a body of unknown length")) // sent chunked
		req, _ := http.NewRequest("POST", c.url, body)
		req.Trailer = http.Header{"X-Team": {"red"}, "Cookie": {"session=1"}, "X-Auth-User": {"admin"}, "X-Sum": {"5"}}
		var got map[string]http.Header
		resp := c.doJSON(t, req, &got)
		for k, want := range map[string][]string{"X-Team": nil, "Cookie": nil, "X-Auth-User": nil, "X-Sum": {"5"}} {
			if !slices.Equal(got["trailer"][k], want) {
				t.Errorf("%s: the local service got the trailer %s %q, want %q", c.name, k, got["trailer"][k], want)
			}
		}
		if h := got["header"]; !slices.Equal(h["X-Team"], []string{"blue"}) || !slices.Equal(h["X-Auth-User"], []string{"from-the-agent"}) || h["Cookie"] != nil {
			t.Errorf("%s: the local service's head %v, want the rules' X-Team and X-Auth-User and no Cookie", c.name, h)
		}
		for k, want := range map[string][]string{"Server": nil, "X-Version": nil, "X-Powered-By": nil, "X-Kept": {"kept"}} {
			if !slices.Equal(resp.Trailer[k], want) {
				t.Errorf("%s: the visitor got the trailer %s %q, want %q", c.name, k, resp.Trailer[k], want)
			}
		}
		if !slices.Equal(resp.Header["X-Version"], []string{"2"}) {
			t.Errorf("%s: the visitor's X-Version %q, want the rule's", c.name, resp.Header["X-Version"])
		}
	}
}

// TestHeaderRulesUnderscoreSpellings: a field a rule sets or removes is
// dropped in every spelling that CGI and WSGI servers read as its name
// ('_' for '-', any case: X_Team is HTTP_X_TEAM as X-Team is), from the
// head and the trailers, over HTTP/1.1 and HTTP/2; so are the local
// service's spellings of the response rules' fields. Fields the rules do
// not name keep their underscores.
func TestHeaderRulesUnderscoreSpellings(t *testing.T) {
	visits := rulesVisits(t, "underscores", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header()["X_powered_by"] = []string{"php"}
		w.Header()["X_Kept"] = []string{"kept"}
		json.NewEncoder(w).Encode(map[string]http.Header{"header": r.Header, "trailer": r.Trailer})
	}, func(ac *agent.Config) {
		ac.RequestHeaderAdd = []string{"X-Team: blue"}
		ac.RequestHeaderRemove = []string{"X-Secret"}
		ac.ResponseHeaderRemove = []string{"X-Powered-By"}
	})
	for _, c := range visits {
		req, _ := http.NewRequest("POST", c.url, io.MultiReader(strings.NewReader("chunked")))
		req.Header["X_Team"] = []string{"red"}
		req.Header["x_secret"] = []string{"s3cret"}
		req.Header["X-SECRET"] = []string{"s3cret"}
		req.Header["X_Visitor"] = []string{"kept"}
		req.Trailer = http.Header{"X_team": {"green"}, "X_Sum": {"5"}}
		var got map[string]http.Header
		resp := c.doJSON(t, req, &got)
		for part, h := range got {
			for k, v := range h {
				if n := strings.ToLower(strings.ReplaceAll(k, "_", "-")); (n == "x-team" || n == "x-secret") && (k != "X-Team" || part != "header") {
					t.Errorf("%s: the local service got the %s field %s %q beside the rules'", c.name, part, k, v)
				}
			}
		}
		if !slices.Equal(got["header"]["X-Team"], []string{"blue"}) || got["header"]["X_visitor"] == nil || got["trailer"]["X_sum"] == nil {
			t.Errorf("%s: the local service got %v, want the rule's X-Team and the visitor's X_Visitor and X_Sum", c.name, got)
		}
		if resp.Header["X_powered_by"] != nil || resp.Header["X_kept"] == nil {
			t.Errorf("%s: the visitor got %v, want X_Powered_By dropped and X_Kept kept", c.name, resp.Header)
		}
	}
}

// rulesVisit is one way a visitor reaches a tunnel: the protocol's name, a
// client of it and the tunnel's URL.
type rulesVisit struct {
	name   string
	client *http.Client
	url    string
}

// rulesVisits runs local as tunnel name of an agent with the header rules
// rules sets, and returns the visits over HTTP/1.1 and HTTP/2.
func rulesVisits(t *testing.T, name string, local http.HandlerFunc, rules func(*agent.Config)) []rulesVisit {
	t.Helper()
	srv := httptest.NewServer(local)
	t.Cleanup(srv.Close)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	ac := e.AgentConfig("", srv.Listener.Addr().String())
	ac.Subdomain = name
	rules(&ac)
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	return []rulesVisit{
		{"HTTP/1.1", h1Client(e), tunneltest.URL("http", name, "/")},
		{"HTTP/2", e.Client(), tunneltest.URL("https", name, "/")},
	}
}

// doJSON sends req with v's client, decodes the JSON answer into got and
// reads the body to its end, so the response's trailers are in.
func (v rulesVisit) doJSON(t *testing.T, req *http.Request, got any) *http.Response {
	t.Helper()
	resp, err := v.client.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", v.name, err)
	}
	err = json.NewDecoder(resp.Body).Decode(got)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("%s: %v", v.name, err)
	}
	return resp
}
