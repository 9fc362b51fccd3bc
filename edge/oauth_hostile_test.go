package edge_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/gorilla/websocket"
	"github.com/oauth2-proxy/mockoidc"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// Attacks on the edge's sign-in by a hostile visitor, agent and local
// service, beyond oauth_test.go's.

// oauthApp starts a provider, an edge that signs visitors in with it and
// tunnel name behind sign-in (mod changes its agent's config) to a
// dumpService, whose count of requests it returns.
func oauthApp(t *testing.T, name string, mod func(*agent.Config)) (*mockoidc.MockOIDC, *tunneltest.Edge, *atomic.Int64) {
	t.Helper()
	m := startOIDC(t)
	e := oauthEdge(t, m, nil)
	local, hits := dumpService(t)
	oauthTunnel(t, e, local, name, mod)
	return m, e, hits
}

// dumpService answers with everything it received (head, body read, then
// trailers) and counts the requests that reached it.
func dumpService(t *testing.T) (string, *atomic.Int64) {
	t.Helper()
	var hits atomic.Int64
	s := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		io.Copy(io.Discard, r.Body)
		fmt.Fprintf(w, "reached %s %s email=%s\n", r.Method, r.URL.RequestURI(), r.Header.Get(edge.HeaderAuthEmail))
		r.Header.Write(w)
		fmt.Fprintln(w, "trailers:")
		r.Trailer.Write(w)
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(ln)
	t.Cleanup(func() { s.Close() })
	return ln.Addr().String(), &hits
}

// bareClient is a visitor without a cookie jar that follows no redirect:
// it sends exactly the Cookie fields a test writes; h2 speaks HTTP/2.
func bareClient(t *testing.T, e *tunneltest.Edge, h2 bool) *http.Client {
	t.Helper()
	c := visitor(t, e, false)
	c.Jar = nil
	tr := c.Transport.(*http.Transport)
	tr.ForceAttemptHTTP2 = h2
	return c
}

// do sends method u with the header fields given in pairs (each added, so
// a name twice makes two fields; "Host" sets the request's Host).
func do(t *testing.T, c *http.Client, method, u string, body io.Reader, hdr ...string) (oauthAnswer, int) {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i] == "Host" {
			req.Host = hdr[i+1]
			continue
		}
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return oauthAnswer{resp.StatusCode, resp.Header.Get(mux.ErrorHeader), string(b), resp.Header.Get("Location"), resp.Header}, resp.ProtoMajor
}

// signIn signs a new browser-like visitor in on name as user and returns
// its session cookie's value.
func signIn(t *testing.T, m *mockoidc.MockOIDC, e *tunneltest.Edge, name string, user mockoidc.User) string {
	t.Helper()
	c := visitor(t, e, true)
	m.QueueUser(user)
	if a := oauthDo(t, c, "GET", oauthURL(e, name, "/")); a.status != 200 || !strings.HasPrefix(a.body, "reached GET / ") {
		t.Fatalf("sign-in on %s: %d %q", name, a.status, a.body)
	}
	return sessionCookie(t, c, oauthURL(e, name, "/"))
}

// flow is one sign-in taken a step at a time by c (which follows no
// redirect): the edge's redirect to the provider, the provider's to the
// callback, and the callback's handoff to the tunnel's host.
type flow struct{ start, back, handoff oauthAnswer }

func stepSignIn(t *testing.T, m *mockoidc.MockOIDC, e *tunneltest.Edge, c *http.Client, name, path string, user mockoidc.User) flow {
	t.Helper()
	var f flow
	if f.start = oauthDo(t, c, "GET", oauthURL(e, name, path)); !toProvider(m, f.start) {
		t.Fatalf("start: %d %q", f.start.status, f.start.location)
	}
	m.QueueUser(user)
	if f.back = oauthDo(t, c, "GET", f.start.location); f.back.status != http.StatusFound || !strings.Contains(f.back.location, "/.ngstone/oauth/callback?") {
		t.Fatalf("provider: %d %q", f.back.status, f.back.location)
	}
	if f.handoff = oauthDo(t, c, "GET", f.back.location); f.handoff.status != http.StatusFound || !strings.Contains(f.handoff.location, "/.ngstone/oauth/callback?code=") {
		t.Fatalf("callback: %d %q %q", f.handoff.status, f.handoff.location, f.handoff.body)
	}
	return f
}

func queryParam(t *testing.T, u, k string) string {
	t.Helper()
	pu, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	return pu.Query().Get(k)
}

func alice() *mockoidc.MockUser {
	return &mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true}
}

// TestOAuthHostileCookieSpellings: whatever spelling of the Cookie fields a
// visitor sends, over HTTP/1.1 or HTTP/2, the session the edge reads is a
// cookie it removes before the request crosses: the local service never
// sees the session's value, nor the state cookie. Spellings net/http does
// not read as the session are no session (a sign-in).
func TestOAuthHostileCookieSpellings(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	v := signIn(t, m, e, "app", alice())
	const name = "__Host-ngstone-session"
	for _, c := range []struct {
		what   string
		fields []string // Cookie fields, in order
		in     bool     // the edge reads a session
	}{
		{"alone", []string{name + "=" + v}, true},
		{"no space after ;", []string{"a=1;" + name + "=" + v + ";b=2"}, true},
		{"spaces and tab", []string{" a=1 ;\t" + name + "=" + v + " ; b=2"}, true},
		{"quoted", []string{"a=1; " + name + `="` + v + `"`}, true},
		{"two fields", []string{"a=1", name + "=" + v}, true},
		{"twice, first good", []string{name + "=" + v + "; " + name + "=junk"}, true},
		{"twice, two fields", []string{name + "=" + v, name + "=" + v + "x"}, true},
		{"with the state cookie", []string{"__Host-ngstone-state=STATE-" + v[:8] + "; " + name + "=" + v}, true},
		{"twice, first junk", []string{name + "=junk; " + name + "=" + v}, false},
		{"upper case", []string{"__HOST-ngstone-session=" + v}, false},
		{"lower case", []string{"__host-ngstone-session=" + v}, false},
		{"space before =", []string{name + " =" + v}, true}, // net/http trims a name
		{"tab before =", []string{"a=1; " + name + "\t=" + v}, true},
		{"no prefix", []string{"ngstone-session=" + v}, false},
		{"comma list", []string{"a=1, " + name + "=" + v}, false},
	} {
		for _, h2 := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/h2=%v", c.what, h2), func(t *testing.T) {
				if strings.Contains(c.what, "before =") {
				}
				var hdr []string
				for _, f := range c.fields {
					hdr = append(hdr, "Cookie", f)
				}
				a, proto := do(t, bareClient(t, e, h2), "GET", oauthURL(e, "app", "/"), nil, hdr...)
				if h2 != (proto == 2) {
					t.Fatalf("spoke HTTP/%d", proto)
				}
				switch {
				case c.in && (a.status != 200 || !strings.Contains(a.body, "email=alice@example.com")):
					t.Fatalf("%d %q, want the signed-in visitor let in", a.status, a.body)
				case !c.in && !toProvider(m, a):
					t.Fatalf("%d %q %q, want a sign-in", a.status, a.location, a.body)
				case strings.Contains(a.body, v) || strings.Contains(a.body, "STATE-"):
					t.Fatalf("the edge's cookie crossed:\n%s", a.body)
				}
			})
		}
	}
}

// TestOAuthHostileIdentityFields: a signed-in visitor's own identity
// fields, in '_' spellings or as trailers, never reach the local service.
func TestOAuthHostileIdentityFields(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	v := signIn(t, m, e, "app", alice())
	for _, h2 := range []bool{false, true} {
		req, _ := http.NewRequest("POST", oauthURL(e, "app", "/"), io.NopCloser(strings.NewReader("body")))
		req.Header.Set("Cookie", "__Host-ngstone-session="+v)
		req.Header["Ngstone_Auth_Email"] = []string{"root@evil.test"}
		req.Header["NGSTONE-AUTH-SUBJECT"] = []string{"root@evil.test"}
		req.Trailer = http.Header{"Ngstone-Auth-Email": {"root@evil.test"}, "X-Ok": {"fine"}}
		req.ContentLength = -1
		resp, err := bareClient(t, e, h2).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		body := string(b)
		if resp.StatusCode != 200 || !strings.Contains(body, "email=alice@example.com") || !strings.Contains(body, "X-Ok: fine") {
			t.Fatalf("h2=%v: %d %q, want alice let in with her trailer", h2, resp.StatusCode, body)
		}
		if strings.Contains(body, "evil") {
			t.Fatalf("h2=%v: a visitor's identity field crossed:\n%s", h2, body)
		}
	}
}

// TestOAuthHostileNoSessionNeverCrosses: without a session nothing reaches
// the local service: any method but GET and HEAD is 401 oauth_required
// (whatever it is called), GET and HEAD are sent to sign in, over HTTP/1.1,
// HTTP/2 and plain HTTP, and so is a WebSocket upgrade.
func TestOAuthHostileNoSessionNeverCrosses(t *testing.T) {
	m, e, hits := oauthApp(t, "app", nil)
	forged := []string{edge.HeaderAuthEmail, "root@example.com", "Cookie", "__Host-ngstone-session=junk; __Host-ngstone-state=x"}
	for _, h2 := range []bool{false, true} {
		c := bareClient(t, e, h2)
		for _, method := range []string{"POST", "PUT", "DELETE", "PATCH", "PROPFIND", "get", "OPTIONS", "TRACE", "Get"} {
			// A connection of its own: net/http retries no custom method
			// on a reused one the edge closed.
			a, _ := do(t, bareClient(t, e, h2), method, oauthURL(e, "app", "/x"), strings.NewReader("payload"), forged...)
			if a.status != 401 || a.code != mux.CodeOAuthRequired {
				t.Errorf("h2=%v %s: %d %q, want 401 oauth_required", h2, method, a.status, a.code)
			}
		}
		if a, _ := do(t, c, "GET", oauthURL(e, "app", "/x"), nil, forged...); !toProvider(m, a) {
			t.Errorf("h2=%v GET: %d %q, want a sign-in", h2, a.status, a.location)
		}
		if a, _ := do(t, c, "HEAD", oauthURL(e, "app", "/x"), nil, forged...); a.status == 200 && a.location == "" {
			t.Errorf("h2=%v HEAD: 200 without a Location: the local service answered", h2)
		}
		// A GET with a body is no way in either.
		if a, _ := do(t, c, "GET", oauthURL(e, "app", "/x"), strings.NewReader("payload")); !toProvider(m, a) {
			t.Errorf("h2=%v GET with a body: %d, want a sign-in", h2, a.status)
		}
	}
	// Plain HTTP: to HTTPS first; other methods refused there too.
	plain := "http://app." + tunneltest.Domain + ":" + port(e, "http") + "/x"
	if a, _ := do(t, bareClient(t, e, false), "GET", plain, nil); a.status != http.StatusFound || !strings.HasPrefix(a.location, oauthURL(e, "app", "/x")) {
		t.Errorf("plain GET: %d %q, want a redirect to HTTPS", a.status, a.location)
	}
	if a, _ := do(t, bareClient(t, e, false), "POST", plain, strings.NewReader("x")); a.status != 401 {
		t.Errorf("plain POST: %d, want 401", a.status)
	}
	d := websocket.Dialer{
		TLSClientConfig: &tls.Config{RootCAs: e.Roots},
		NetDialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, e.Addr("https").String())
		},
		HandshakeTimeout: 10 * time.Second,
	}
	ws, resp, err := d.Dial(strings.Replace(oauthURL(e, "app", "/ws"), "https:", "wss:", 1), http.Header{"Cookie": {"__Host-ngstone-session=junk"}})
	if err == nil {
		ws.Close()
		t.Fatal("a WebSocket without a session was upgraded")
	}
	if resp == nil || resp.StatusCode != http.StatusFound {
		t.Errorf("WebSocket without a session: %v %v, want a 302 to sign in", resp, err)
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("%d requests without a session reached the local service", n)
	}
}

// TestOAuthHostileHEAD: a HEAD without a session is sent to sign in with
// a 302, as a GET is, not a 200 that looks like the tunnel's answer.
func TestOAuthHostileHEAD(t *testing.T) {
	m, e, hits := oauthApp(t, "app", nil)
	for _, h2 := range []bool{false, true} {
		if a, _ := do(t, bareClient(t, e, h2), "HEAD", oauthURL(e, "app", "/x"), nil); !toProvider(m, a) {
			t.Errorf("h2=%v HEAD: %d %q, want 302 to the provider", h2, a.status, a.location)
		}
	}
	plain := "http://app." + tunneltest.Domain + ":" + port(e, "http") + "/x"
	if a, _ := do(t, bareClient(t, e, false), "HEAD", plain, nil); a.status != http.StatusFound {
		t.Errorf("plain HEAD: %d %q, want 302 to HTTPS", a.status, a.location)
	}
	if hits.Load() != 0 {
		t.Fatalf("%d requests reached the local service", hits.Load())
	}
}

func port(e *tunneltest.Edge, listener string) string {
	_, p, _ := net.SplitHostPort(e.Addr(listener).String())
	return p
}

// TestOAuthHostilePreflight: --oauth-allow-preflight lets through only an
// OPTIONS with both Origin and Access-Control-Request-Method, and carries
// no identity (neither the visitor's forged one nor a session's); without
// the flag a preflight is 401 like any other method.
func TestOAuthHostilePreflight(t *testing.T) {
	m := startOIDC(t)
	e := oauthEdge(t, m, nil)
	local, hits := dumpService(t)
	oauthTunnel(t, e, local, "pf", func(c *agent.Config) { c.OAuthAllowPreflight = true })
	oauthTunnel(t, e, local, "nopf", nil)
	v := signIn(t, m, e, "pf", alice())
	before := hits.Load()
	c := bareClient(t, e, false)
	const origin, acrm = "Origin", "Access-Control-Request-Method"
	a, _ := do(t, c, "OPTIONS", oauthURL(e, "pf", "/api"), nil, origin, "https://web.test", acrm, "PUT",
		edge.HeaderAuthEmail, "root@evil.test", "Cookie", "__Host-ngstone-session="+v)
	if a.status != 200 || !strings.HasPrefix(a.body, "reached OPTIONS /api email=\n") || strings.Contains(a.body, "evil") || strings.Contains(a.body, v) {
		t.Fatalf("a preflight: %d %q, want it through without identity or cookie", a.status, a.body)
	}
	for _, r := range []struct {
		name, method string
		hdr          []string
	}{
		{"pf", "OPTIONS", []string{origin, "https://web.test"}},
		{"pf", "OPTIONS", []string{acrm, "PUT"}},
		{"pf", "OPTIONS", nil},
		{"pf", "POST", []string{origin, "https://web.test", acrm, "PUT"}},
		{"pf", "DELETE", []string{origin, "https://web.test", acrm, "DELETE"}},
		{"nopf", "OPTIONS", []string{origin, "https://web.test", acrm, "PUT"}},
	} {
		if a, _ := do(t, c, r.method, oauthURL(e, r.name, "/api"), nil, r.hdr...); a.status != 401 || a.code != mux.CodeOAuthRequired {
			t.Errorf("%s %s %v: %d %q, want 401 oauth_required", r.name, r.method, r.hdr, a.status, a.code)
		}
	}
	if a, _ := do(t, c, "GET", oauthURL(e, "pf", "/api"), nil, origin, "https://web.test", acrm, "GET"); !toProvider(m, a) {
		t.Errorf("a GET dressed as a preflight: %d, want a sign-in", a.status)
	}
	if n := hits.Load() - before; n != 1 {
		t.Fatalf("%d requests reached the local service, want the one preflight", n)
	}
}

// TestOAuthHostilePlainTunnel: on a tunnel without --oauth the edge's
// paths and cookie names are the local service's: they cross untouched.
func TestOAuthHostilePlainTunnel(t *testing.T) {
	m := startOIDC(t)
	e := oauthEdge(t, m, nil)
	local, hits := dumpService(t)
	cfg := e.AgentConfig("", local)
	cfg.Subdomain = "plain"
	tunneltest.StartAgent(t, cfg).WaitOnline(t)
	c := bareClient(t, e, false)
	for _, p := range []string{"/.ngstone/oauth/callback?code=x&state=y", "/.ngstone/logout"} {
		for _, method := range []string{"GET", "POST"} {
			a, _ := do(t, c, method, oauthURL(e, "plain", p), nil, "Cookie", "__Host-ngstone-session=mine; __Host-ngstone-state=too")
			if a.status != 200 || !strings.HasPrefix(a.body, "reached "+method+" "+p+" ") || !strings.Contains(a.body, "__Host-ngstone-session=mine; __Host-ngstone-state=too") ||
				len(a.header.Values("Set-Cookie")) != 0 {
				t.Errorf("%s %s: %d %q %q, want it at the local service untouched", method, p, a.status, a.body, a.header.Values("Set-Cookie"))
			}
		}
	}
	if hits.Load() != 4 {
		t.Fatalf("%d requests reached the local service, want 4", hits.Load())
	}
}

// TestOAuthHostileCallbackHost: auth.DOMAIN answers only a GET of the
// callback path; a state that is no state (empty, long, of another kind)
// is 400 oauth_failed; the provider's error is shown escaped; an answer
// without a code is no sign-in.
func TestOAuthHostileCallbackHost(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	c := bareClient(t, e, false)
	cb := oauthURL(e, "auth", "/.ngstone/oauth/callback")
	for _, r := range []struct{ method, path string }{
		{"POST", "/.ngstone/oauth/callback"}, {"HEAD", "/.ngstone/oauth/callback"}, {"PUT", "/.ngstone/oauth/callback"},
		{"GET", "/"}, {"GET", "/.ngstone/logout"}, {"GET", "/.ngstone/oauth/callback/"}, {"GET", "//.ngstone/oauth/callback"},
	} {
		if a, _ := do(t, c, r.method, oauthURL(e, "auth", r.path), nil); a.status != 404 || (r.method != "HEAD" && a.code != mux.CodeTunnelNotFound) {
			t.Errorf("%s auth%s: %d %q, want 404 tunnel_not_found", r.method, r.path, a.status, a.code)
		}
	}
	long := strings.Repeat("A", 200<<10)
	for _, st := range []string{"", long, long[:5000], "%00", strings.Repeat("A", 64)} {
		a, _ := do(t, c, "GET", cb+"?code=x&state="+st, nil)
		if a.status == http.StatusRequestHeaderFieldsTooLarge && len(st) > 64<<10 {
			continue // over the edge's bound on a request's head
		}
		if a.status != 400 || a.code != mux.CodeOAuthFailed {
			t.Errorf("state %.12q (%d bytes): %d %q, want 400 oauth_failed", st, len(st), a.status, a.code)
		}
	}

	// A real state, taken from the redirect to the provider.
	v := visitor(t, e, false)
	f := stepSignIn(t, m, e, v, "app", "/", alice())
	state := queryParam(t, f.start.location, "state")
	xss := url.QueryEscape(`<script>alert(1)</script>`)
	a, _ := do(t, c, "GET", cb+"?error=access_denied&error_description="+xss+"&state="+url.QueryEscape(state), nil)
	if a.status != 403 || a.code != mux.CodeOAuthFailed || strings.Contains(a.body, "<script>") || !strings.Contains(a.body, "&lt;script&gt;") ||
		a.location != "" || len(a.header.Values("Set-Cookie")) > 1 {
		t.Errorf("the provider's error: %d %q %q, want 403 oauth_failed with it escaped", a.status, a.code, a.body)
	}
	// Each sealed value is good only as its own kind.
	session := signIn(t, m, e, "app", alice())
	code := queryParam(t, f.handoff.location, "code")
	for what, st := range map[string]string{"a session": session, "a handoff": code} {
		if a, _ := do(t, c, "GET", cb+"?code=x&state="+url.QueryEscape(st), nil); a.status != 400 || a.code != mux.CodeOAuthFailed {
			t.Errorf("%s as the state: %d %q, want 400 oauth_failed", what, a.status, a.code)
		}
	}
	stateCookie := jarState(t, v, oauthURL(e, "app", "/"))
	for what, h := range map[string]string{"a session": session, "a state": state} {
		a, _ := do(t, c, "GET", oauthURL(e, "app", "/.ngstone/oauth/callback?code="+url.QueryEscape(h)), nil, "Cookie", stateCookie)
		if a.status != 400 || a.code != mux.CodeOAuthFailed {
			t.Errorf("%s as the handoff: %d %q, want 400 oauth_failed", what, a.status, a.code)
		}
	}
	for what, s := range map[string]string{"a state": state, "a handoff": code} {
		if a, _ := do(t, c, "GET", oauthURL(e, "app", "/"), nil, "Cookie", "__Host-ngstone-session="+s); !toProvider(m, a) {
			t.Errorf("%s as the session: %d, want a sign-in", what, a.status)
		}
	}
	// The provider's answer without its code: no handoff, no session.
	f2 := stepStart(t, m, e, visitor(t, e, false), "app")
	a, _ = do(t, c, "GET", cb+"?state="+url.QueryEscape(queryParam(t, f2.location, "state")), nil)
	if a.status < 400 || a.code != mux.CodeOAuthFailed || a.location != "" {
		t.Errorf("an answer without a code: %d %q %q, want oauth_failed", a.status, a.code, a.location)
	}
}

func stepStart(t *testing.T, m *mockoidc.MockOIDC, e *tunneltest.Edge, c *http.Client, name string) oauthAnswer {
	t.Helper()
	a := oauthDo(t, c, "GET", oauthURL(e, name, "/"))
	if !toProvider(m, a) {
		t.Fatalf("start: %d %q", a.status, a.location)
	}
	return a
}

// jarState is the sign-in state cookies c's jar holds for u, as the
// Cookie field a browser sends.
func jarState(t *testing.T, c *http.Client, u string) string {
	t.Helper()
	pu, _ := url.Parse(u)
	var found []string
	for _, k := range c.Jar.Cookies(pu) {
		if strings.HasPrefix(k.Name, "__Host-ngstone-state-") {
			found = append(found, k.Name+"="+k.Value)
		}
	}
	if len(found) == 0 {
		t.Fatalf("no state cookie for %s", u)
	}
	return strings.Join(found, "; ")
}

// TestOAuthSignInsAtOnce: sign-ins begun at once in one browser (tabs
// restored together) each finish, in any order. Past four, those begun
// first give way: a browser holds at most four state cookies of a host,
// and none reaches the local service.
func TestOAuthSignInsAtOnce(t *testing.T) {
	m, e, hits := oauthApp(t, "app", nil)
	c := visitor(t, e, false)
	const tabs, kept = 6, 4
	states := func() int {
		pu, _ := url.Parse(oauthURL(e, "app", "/"))
		n := 0
		for _, k := range c.Jar.Cookies(pu) {
			if strings.HasPrefix(k.Name, "__Host-ngstone-state-") {
				n++
			}
		}
		return n
	}
	var starts []oauthAnswer
	for i := range tabs {
		a := oauthDo(t, c, "GET", oauthURL(e, "app", fmt.Sprintf("/tab%d", i)))
		if !toProvider(m, a) {
			t.Fatalf("tab %d: %d %q", i, a.status, a.location)
		}
		starts = append(starts, a)
	}
	if n := states(); n != kept {
		t.Fatalf("%d sign-ins begun: the browser holds %d state cookies, want %d", tabs, n, kept)
	}
	for _, i := range []int{2, 5, 3, 4, 0, 1} {
		m.QueueUser(alice())
		back := oauthDo(t, c, "GET", starts[i].location)
		handoff := oauthDo(t, c, "GET", back.location)
		if handoff.status != http.StatusFound {
			t.Fatalf("tab %d's callback: %d %q", i, handoff.status, handoff.body)
		}
		a := oauthDo(t, c, "GET", handoff.location)
		switch {
		case i >= tabs-kept && (a.status != http.StatusSeeOther || a.location != fmt.Sprintf("/tab%d", i)):
			t.Errorf("tab %d, among the last %d begun: %d %q %q, want 303 to /tab%d", i, kept, a.status, a.location, a.body, i)
		case i < tabs-kept && (a.status != 400 || a.code != mux.CodeOAuthFailed):
			t.Errorf("tab %d, begun before the last %d: %d %q, want 400 oauth_failed", i, kept, a.status, a.code)
		}
	}
	if n := states(); n != 0 {
		t.Errorf("%d state cookies left once every sign-in kept finished", n)
	}
	a := oauthDo(t, c, "GET", oauthURL(e, "app", "/after"), "Cookie", "__Host-ngstone-state-forged=1; mine=kept")
	if a.status != 200 || !strings.Contains(a.body, "mine=kept") || strings.Contains(a.body, "ngstone-") || hits.Load() != 1 {
		t.Errorf("signed in, with a state cookie: %d %q (%d requests reached the service), want 200 and only the visitor's cookie", a.status, a.body, hits.Load())
	}
}

// TestOAuthHostileHandoffElsewhere: a handoff taken, with its browser's
// state cookie forged alongside, to another tunnel (by subdomain or an
// own hostname, of another agent) is refused by its host alone.
func TestOAuthHostileHandoffElsewhere(t *testing.T) {
	m := startOIDC(t)
	e := oauthEdge(t, m, func(c *edge.Config) {
		c.TokenPolicies = []edge.TokenPolicy{{Token: "t", Hostnames: []string{"*.example.test"}}}
	})
	local, hits := dumpService(t)
	oauthTunnel(t, e, local, "app", func(c *agent.Config) { c.Token = "t" })
	oauthTunnel(t, e, local, "", func(c *agent.Config) { c.Token, c.Hostname = "t", "a.example.test" })
	oauthTunnel(t, e, local, "", func(c *agent.Config) { c.Token, c.Hostname = "t", "b.example.test" })
	own := func(host, path string) string { return "https://" + host + ":" + port(e, "https") + path }
	for _, r := range []struct{ from, to string }{
		{oauthURL(e, "app", "/"), own("b.example.test", "/")},
		{own("a.example.test", "/"), own("b.example.test", "/")},
		{own("a.example.test", "/"), oauthURL(e, "app", "/")},
	} {
		eve := visitor(t, e, false)
		start := oauthDo(t, eve, "GET", r.from)
		if !toProvider(m, start) {
			t.Fatalf("start on %s: %d %q", r.from, start.status, start.body)
		}
		m.QueueUser(alice())
		back := oauthDo(t, eve, "GET", start.location)
		handoff := oauthDo(t, eve, "GET", back.location)
		if handoff.status != http.StatusFound {
			t.Fatalf("callback for %s: %d %q", r.from, handoff.status, handoff.body)
		}
		pu, _ := url.Parse(handoff.location)
		to, _ := url.Parse(r.to)
		pu.Host = to.Host
		st := jarState(t, eve, r.from)
		a, _ := do(t, bareClient(t, e, false), "GET", pu.String(), nil, "Cookie", st)
		if a.status != 400 || a.code != mux.CodeOAuthFailed || len(a.header.Values("Set-Cookie")) > 1 {
			t.Fatalf("%s's handoff on %s: %d %q %q, want 400 oauth_failed", r.from, r.to, a.status, a.code, a.header.Values("Set-Cookie"))
		}
		// On its own host, with the same forged cookie, it is good.
		a, _ = do(t, bareClient(t, e, false), "GET", handoff.location, nil, "Cookie", st)
		if a.status != http.StatusSeeOther {
			t.Fatalf("%s's handoff on its host: %d %q", r.from, a.status, a.body)
		}
	}
	if hits.Load() != 0 {
		t.Fatalf("%d requests reached a local service", hits.Load())
	}
}

// TestOAuthHostileConcurrentReplay: the provider's answer and the handoff
// replayed at once, many times: exactly one of each goes through.
func TestOAuthHostileConcurrentReplay(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	eve := visitor(t, e, false)
	start := stepStart(t, m, e, eve, "app")
	m.QueueUser(alice())
	back := oauthDo(t, eve, "GET", start.location)
	race := func(u string, hdr ...string) map[int]int {
		const n = 8
		var mu sync.Mutex
		var wg sync.WaitGroup
		got := map[int]int{}
		for range n {
			c := bareClient(t, e, false)
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, _ := http.NewRequest("GET", u, nil)
				for i := 0; i+1 < len(hdr); i += 2 {
					req.Header.Set(hdr[i], hdr[i+1])
				}
				resp, err := c.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mu.Lock()
				got[resp.StatusCode]++
				mu.Unlock()
			}()
		}
		wg.Wait()
		return got
	}
	// Only the one that went through asked the provider: the others are 400.
	if got := race(back.location); got[http.StatusFound] != 1 || got[400] != 7 {
		t.Fatalf("the provider's answer 8 times at once: %v, want one 302 and seven 400", got)
	}
	// The winner's handoff is not known here: sign in again step by step.
	f := stepSignIn(t, m, e, eve, "app", "/", alice())
	handoff := f.handoff.location
	st := jarState(t, eve, oauthURL(e, "app", "/"))
	if got := race(handoff, "Cookie", st); got[http.StatusSeeOther] != 1 || got[400] != 7 {
		t.Fatalf("the handoff 8 times at once: %v, want one 303 and seven 400", got)
	}
}

// TestOAuthHostileAgentBinds: a hand-made bind naming a provider the edge
// does not offer, too many or malformed allow entries, OAuth on a TCP or
// TLS tunnel, or the callback host, is refused; the session goes on.
func TestOAuthHostileAgentBinds(t *testing.T) {
	m := startOIDC(t)
	e := oauthEdge(t, m, func(c *edge.Config) { c.TCPPorts = tunneltest.FreePorts(t, 1) })
	raw, _ := e.DialRaw(t, hello(""))
	many := func(n int, s string) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = s
		}
		return out
	}
	for what, b := range map[string]*mux.Bind{
		"an unknown provider":      {Subdomain: "x", OAuth: &mux.OAuth{Provider: "google"}},
		"no provider":              {Subdomain: "x", OAuth: &mux.OAuth{}},
		"a provider in upper case": {Subdomain: "x", OAuth: &mux.OAuth{Provider: "CORP"}},
		"a provider with a space":  {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp "}},
		"10000 domains":            {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowDomains: many(10000, "x")}},
		"1025 entries": {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowDomains: many(1000, "x"),
			AllowEmails: many(20, "a@x"), AllowClaims: many(5, "g=x")}},
		"an email without @":   {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowEmails: []string{"alice"}}},
		"an email with a CRLF": {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowEmails: []string{"a@x\r\nb@y"}}},
		"an empty domain":      {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowDomains: []string{""}}},
		"a claim without =":    {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowClaims: []string{"groups"}}},
		"a claim without name": {Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp", AllowClaims: []string{"=dev"}}},
		"a tcp tunnel":         {Proto: mux.ProtoTCP, OAuth: &mux.OAuth{Provider: "corp"}},
		"a tls tunnel":         {Proto: mux.ProtoTLS, Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp"}},
	} {
		be, ok := raw.Bind(t, b).(*mux.BindError)
		if !ok || be.Code != mux.CodeBadRequest {
			t.Errorf("%s: %+v, want %s", what, be, mux.CodeBadRequest)
		}
	}
	for what, b := range map[string]*mux.Bind{
		"the callback host by name":     {Subdomain: "auth", OAuth: &mux.OAuth{Provider: "corp"}},
		"the callback host, upper case": {Subdomain: "AUTH"},
		"the callback host as hostname": {Hostname: "auth." + tunneltest.Domain},
		"the callback host, dotted":     {Hostname: "Auth." + tunneltest.Domain + "."},
	} {
		if _, ok := raw.Bind(t, b).(*mux.BindError); !ok {
			t.Errorf("%s: bound", what)
		}
	}
	if ok, isOK := raw.Bind(t, &mux.Bind{Subdomain: "fine", OAuth: &mux.OAuth{Provider: "corp", AllowDomains: many(mux.MaxOAuthRules, "x")}}).(*mux.BindOK); !isOK {
		t.Fatalf("a bind of %d entries after the refusals: %+v", mux.MaxOAuthRules, ok)
	}
	// An edge with no provider refuses every OAuth bind.
	plain := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	raw2, _ := plain.DialRaw(t, hello(""))
	if be, ok := raw2.Bind(t, &mux.Bind{Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp"}}).(*mux.BindError); !ok || be.Code != mux.CodeBadRequest {
		t.Errorf("oauth on an edge without providers: %+v", be)
	}
	// Nor does one without HTTPS, whose visitors could keep no session.
	noTLS := oauthEdge(t, m, func(c *edge.Config) { c.HTTPSAddr = "" })
	raw3, _ := noTLS.DialRaw(t, hello(""))
	if be, ok := raw3.Bind(t, &mux.Bind{Subdomain: "x", OAuth: &mux.OAuth{Provider: "corp"}}).(*mux.BindError); !ok || be.Code != mux.CodeBadRequest || !strings.Contains(be.Message, "HTTPS") {
		t.Errorf("oauth on an edge without HTTPS: %+v", be)
	}
}

// TestOAuthHostileProviderSwap: the same name bound again with another of
// the edge's providers does not take the first provider's sessions.
func TestOAuthHostileProviderSwap(t *testing.T) {
	m := startOIDC(t)
	m2 := startOIDC(t)
	e := oauthEdge(t, m, func(c *edge.Config) {
		p := c.OAuthProviders[0]
		p.Name, p.Issuer, p.ClientID, p.ClientSecret = "other", m2.Issuer(), m2.ClientID, m2.ClientSecret
		c.OAuthProviders = append(c.OAuthProviders, p)
	})
	local, _ := dumpService(t)
	cfg := e.AgentConfig("", local)
	cfg.Subdomain, cfg.OAuth = "app", "corp"
	first := tunneltest.StartAgent(t, cfg)
	first.WaitOnline(t)
	v := signIn(t, m, e, "app", alice())
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}
	cfg.OAuth = "other"
	tunneltest.StartAgent(t, cfg).WaitOnline(t)
	c := bareClient(t, e, false)
	// The agent's new bind may race the old one's release: wait for it.
	tunneltest.Eventually(t, 10*time.Second, "the sign-in goes to the other provider", func() bool {
		a, _ := do(t, c, "GET", oauthURL(e, "app", "/"), nil, "Cookie", "__Host-ngstone-session="+v)
		if a.status == 200 {
			t.Fatalf("corp's session let in on the tunnel bound with other:\n%s", a.body)
		}
		return toProvider(m2, a)
	})
}

// TestOAuthHostileLongDeepLink: a visitor who opens a deep link with a
// long query (an app's own state, ~3 KB) can still sign in.
func TestOAuthHostileLongDeepLink(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	m.QueueUser(alice())
	path := "/deep?q=" + strings.Repeat("x", 3000)
	a := oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "app", path))
	if a.status != 200 || !strings.Contains(a.body, "email=alice@example.com") {
		t.Fatalf("sign-in from a deep link: %d %q %.200q", a.status, a.code, a.body)
	}
}

// TestOAuthHostileHostPort: a visitor's Host with a port that is no port
// does not make the edge name another place as the callback.
func TestOAuthHostileHostPort(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	p := port(e, "https")
	// The Host's port when it is one (an edge behind a port map), else none.
	want := []string{"https://auth." + tunneltest.Domain + ":" + p + "/.ngstone/oauth/callback", "https://auth." + tunneltest.Domain + "/.ngstone/oauth/callback"}
	for _, host := range []string{"app." + tunneltest.Domain + ":" + p + ".evil.test", "app." + tunneltest.Domain + ":" + p + ";x"} {
		a, _ := do(t, bareClient(t, e, false), "GET", oauthURL(e, "app", "/"), nil, "Host", host)
		if !toProvider(m, a) {
			t.Fatalf("Host %s: %d %q", host, a.status, a.body)
		}
		if got := queryParam(t, a.location, "redirect_uri"); !slices.Contains(want, got) {
			t.Errorf("Host %s: redirect_uri %q, want one of %q", host, got, want)
		}
	}
}

// rawUser is a provider's user whose ID token has exactly the email claims
// given (mockoidc's own drops email_verified when false).
type rawUser struct {
	sub    string
	claims map[string]any
}

func (u rawUser) ID() string { return u.sub }
func (u rawUser) Userinfo([]string) ([]byte, error) {
	return json.Marshal(map[string]any{"sub": u.sub})
}
func (u rawUser) Claims(_ []string, base *mockoidc.IDTokenClaims) (jwt.Claims, error) {
	return rawClaims{base, u.claims}, nil
}

type rawClaims struct {
	*mockoidc.IDTokenClaims
	extra map[string]any
}

func (c rawClaims) MarshalJSON() ([]byte, error) {
	b, err := json.Marshal(c.IDTokenClaims)
	if err != nil {
		return nil, err
	}
	all := map[string]any{}
	if err := json.Unmarshal(b, &all); err != nil {
		return nil, err
	}
	for k, v := range c.extra {
		all[k] = v
	}
	return json.Marshal(all)
}

// TestOAuthHostileUnverifiedEmail: an address the provider does not say
// it verified is no address for the allow list, nor for the local service.
func TestOAuthHostileUnverifiedEmail(t *testing.T) {
	m, e, _ := oauthApp(t, "app", func(c *agent.Config) { c.OAuthAllowEmail = []string{"alice@example.com"} })
	try := func(t *testing.T, claims map[string]any) oauthAnswer {
		m.QueueUser(rawUser{"m-1", claims})
		return oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "app", "/"))
	}
	t.Run("verified", func(t *testing.T) {
		if a := try(t, map[string]any{"email": "alice@example.com", "email_verified": true}); a.status != 200 || !strings.Contains(a.body, "email=alice@example.com") {
			t.Fatalf("%d %q, want alice in", a.status, a.body)
		}
	})
	t.Run("false", func(t *testing.T) {
		if a := try(t, map[string]any{"email": "alice@example.com", "email_verified": false}); a.status != 403 || a.code != mux.CodeOAuthDenied {
			t.Fatalf("%d %q, want 403 oauth_denied", a.status, a.body)
		}
	})
	t.Run("StringFalse", func(t *testing.T) {
		if a := try(t, map[string]any{"email": "alice@example.com", "email_verified": "false"}); a.status != 403 || a.code != mux.CodeOAuthDenied {
			t.Fatalf("%d %q, want 403 oauth_denied", a.status, a.body)
		}
	})
	t.Run("absent", func(t *testing.T) {
		if a := try(t, map[string]any{"email": "alice@example.com"}); a.status != 403 || a.code != mux.CodeOAuthDenied {
			t.Fatalf("%d %q, want 403 oauth_denied", a.status, a.body)
		}
	})
}

// TestOAuthStatesWithoutSignInTakeNoRoom: a tunnel's redirect hands out a
// state to anyone; brought back to the callback without a sign-in behind
// it (no code, a code the provider refuses), it takes no room among the
// nonces an edge remembers, so that states alone cannot fill them and
// lock every visitor out of signing in.
func TestOAuthStatesWithoutSignInTakeNoRoom(t *testing.T) {
	m, e, _ := oauthApp(t, "app", nil)
	eve := bareClient(t, e, false)
	for range 3 {
		start := oauthDo(t, eve, "GET", oauthURL(e, "app", "/"))
		u, err := url.Parse(start.location)
		if err != nil || start.status != http.StatusFound {
			t.Fatalf("sign-in start: %d %q %v", start.status, start.location, err)
		}
		st := u.Query().Get("state")
		cb := oauthURL(e, "auth", "/.ngstone/oauth/callback")
		for _, q := range []string{"?state=" + url.QueryEscape(st), "?code=forged&state=" + url.QueryEscape(st)} {
			if a := oauthDo(t, eve, "GET", cb+q); a.status != http.StatusBadGateway {
				t.Fatalf("callback %s: %d, want 502 (the provider confirmed nothing)", q, a.status)
			}
		}
		// The same state again is refused by the provider, not as used:
		// nothing was marked.
		if a := oauthDo(t, eve, "GET", cb+"?code=forged&state="+url.QueryEscape(st)); strings.Contains(a.body, "used already") {
			t.Fatalf("a state without a sign-in was marked used: %d %q", a.status, a.body)
		}
	}
	if n := edge.UsedNonces(e.Edge); n != 0 {
		t.Fatalf("%d nonces remembered for states without a sign-in, want 0", n)
	}
	// A sign-in the provider confirmed is remembered.
	stepSignIn(t, m, e, bareClient(t, e, false), "app", "/", alice())
	if n := edge.UsedNonces(e.Edge); n != 1 {
		t.Fatalf("%d nonces remembered after a confirmed sign-in, want 1 (its state)", n)
	}
}
