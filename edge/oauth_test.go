package edge_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/oauth2-proxy/mockoidc"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// startOIDC runs an OIDC provider in the test process.
func startOIDC(t *testing.T) *mockoidc.MockOIDC {
	t.Helper()
	m, err := mockoidc.Run()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Shutdown() })
	return m
}

// oauthEdge starts an edge, with the CLI's defaults, that offers m as
// the provider "corp".
func oauthEdge(t *testing.T, m *mockoidc.MockOIDC, mod func(*edge.Config)) *tunneltest.Edge {
	t.Helper()
	cfg := tunneltest.EdgeConfig(t)
	cfg.OAuthProviders = []edge.OAuthProvider{{Name: "corp", Kind: edge.OAuthOIDC, Issuer: m.Issuer(),
		ClientID: m.ClientID, ClientSecret: m.ClientSecret, Scopes: []string{"openid", "email", "groups"}}}
	if mod != nil {
		mod(&cfg)
	}
	return tunneltest.StartEdge(t, cfg)
}

// whoService answers with what the edge told it of the visitor.
func whoService(t *testing.T) string {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "email=%s subject=%s cookie=%s path=%s", r.Header.Get(edge.HeaderAuthEmail),
			r.Header.Get(edge.HeaderAuthSubject), strings.Join(r.Header.Values("Cookie"), "|"), r.URL.RequestURI())
	}))
	t.Cleanup(s.Close)
	return s.Listener.Addr().String()
}

// oauthTunnel binds name on e with --oauth corp and the settings mod makes.
func oauthTunnel(t *testing.T, e *tunneltest.Edge, local, name string, mod func(*agent.Config)) agent.Status {
	t.Helper()
	cfg := e.AgentConfig("", local)
	cfg.Subdomain, cfg.OAuth = name, "corp"
	if mod != nil {
		mod(&cfg)
	}
	return tunneltest.StartAgent(t, cfg).WaitOnline(t)
}

// visitor is a browser-like client: a cookie jar, every *.test name
// dialled on loopback at the port its URL gives, the edge's CA trusted.
func visitor(t *testing.T, e *tunneltest.Edge, follow bool) *http.Client {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	d := &net.Dialer{Timeout: 5 * time.Second}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, port, _ := net.SplitHostPort(addr)
			if strings.HasSuffix(host, ".test") {
				addr = net.JoinHostPort("127.0.0.1", port)
			}
			return d.DialContext(ctx, network, addr)
		},
		TLSClientConfig: &tls.Config{RootCAs: e.Roots},
	}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr, Jar: jar, Timeout: 20 * time.Second}
	if !follow {
		c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	}
	return c
}

// oauthURL is https://NAME.DOMAIN:PORT/path on e's HTTPS listener.
func oauthURL(e *tunneltest.Edge, name, path string) string {
	_, port, _ := net.SplitHostPort(e.Addr("https").String())
	return fmt.Sprintf("https://%s.%s:%s%s", name, tunneltest.Domain, port, path)
}

type oauthAnswer struct {
	status   int
	code     string
	body     string
	location string
	header   http.Header
}

func oauthDo(t *testing.T, c *http.Client, method, u string, hdr ...string) oauthAnswer {
	t.Helper()
	req, err := http.NewRequest(method, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return oauthAnswer{resp.StatusCode, resp.Header.Get(mux.ErrorHeader), string(b), resp.Header.Get("Location"), resp.Header}
}

// sessionCookie is the value of the edge's session cookie c holds for u.
func sessionCookie(t *testing.T, c *http.Client, u string) string {
	t.Helper()
	pu, _ := url.Parse(u)
	for _, k := range c.Jar.Cookies(pu) {
		if k.Name == "__Host-ngstone-session" {
			return k.Value
		}
	}
	t.Fatalf("no session cookie for %s", u)
	return ""
}

// toProvider reports whether a is the edge sending a visitor to sign in.
func toProvider(m *mockoidc.MockOIDC, a oauthAnswer) bool {
	return a.status == http.StatusFound && strings.HasPrefix(a.location, m.Issuer())
}

// TestOAuthSignIn: a tunnel bound with --oauth lets in only visitors who
// signed in with the edge's provider and are on its allow list, and the
// local service learns who they are from the edge alone. Each attack on
// the sign-in (forged or replayed state, a handoff or a cookie taken to
// another tunnel, a tampered cookie, a redirect off the host) is refused.
func TestOAuthSignIn(t *testing.T) {
	m := startOIDC(t)
	e := oauthEdge(t, m, nil)
	local := whoService(t)
	app := oauthTunnel(t, e, local, "app", func(c *agent.Config) { c.OAuthAllowDomain = []string{"example.com"} })
	oauthTunnel(t, e, local, "grp", func(c *agent.Config) { c.OAuthAllowClaim = []string{"groups=dev"} })
	oauthTunnel(t, e, local, "open", nil)
	plain := e.AgentConfig("", local)
	plain.Subdomain = "plain"
	tunneltest.StartAgent(t, plain).WaitOnline(t)

	alice := visitor(t, e, true)
	t.Run("allowed", func(t *testing.T) {
		m.QueueUser(&mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true})
		a := oauthDo(t, alice, "GET", oauthURL(e, "app", "/hello?x=1"), edge.HeaderAuthEmail, "root@example.com")
		want := "email=alice@example.com subject=a-1 cookie= path=/hello?x=1"
		if a.status != 200 || a.body != want {
			t.Fatalf("%d %q, want 200 %q", a.status, a.body, want)
		}
		// Signed in, the visitor's own identity fields still never cross,
		// nor do the edge's cookies; the visitor's others do.
		a = oauthDo(t, alice, "GET", oauthURL(e, "app", "/again"), "Cookie", "theme=dark", edge.HeaderAuthEmail, "root@example.com", edge.HeaderAuthSubject, "0")
		if want := "email=alice@example.com subject=a-1 cookie=theme=dark path=/again"; a.body != want {
			t.Fatalf("%q, want %q", a.body, want)
		}
	})
	t.Run("VisitorIdentityFieldsOnPlainTunnel", func(t *testing.T) {
		a := oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "plain", "/"), edge.HeaderAuthEmail, "root@example.com")
		if a.status != 200 || !strings.HasPrefix(a.body, "email= subject= ") {
			t.Fatalf("%d %q: a visitor's Ngstone-Auth-* crossed", a.status, a.body)
		}
	})
	t.Run("NotGETWithoutSession", func(t *testing.T) {
		a := oauthDo(t, visitor(t, e, false), "POST", oauthURL(e, "app", "/api"))
		if a.status != 401 || a.code != mux.CodeOAuthRequired || !strings.HasPrefix(a.header.Get("WWW-Authenticate"), "Ngstone-Sign-In ") {
			t.Fatalf("%d %q %q, want 401 oauth_required without a password prompt", a.status, a.code, a.header.Get("WWW-Authenticate"))
		}
	})
	t.Run("denied", func(t *testing.T) {
		m.QueueUser(&mockoidc.MockUser{Subject: "b-1", Email: "bob@other.test", EmailVerified: true})
		a := oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "app", "/"))
		if a.status != 403 || a.code != mux.CodeOAuthDenied || !strings.Contains(a.body, "bob@other.test") || !strings.Contains(a.body, "/.ngstone/logout") {
			t.Fatalf("%d %q %q, want 403 oauth_denied naming bob and how to sign out", a.status, a.code, a.body)
		}
		// The agent's inspector lists the refusal, and who it was.
		tunneltest.Eventually(t, 5*time.Second, "the inspector to list bob's refusal", func() bool {
			for _, c := range tunneltest.Captures(t, app.InspectURL) {
				if c.Refused == "signed in as bob@other.test" && c.Status == 403 && c.Code == mux.CodeOAuthDenied {
					return true
				}
			}
			return false
		})
	})
	t.Run("claim", func(t *testing.T) {
		m.QueueUser(&mockoidc.MockUser{Subject: "c-1", Email: "carol@other.test", EmailVerified: true, Groups: []string{"ops", "dev"}})
		if a := oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "grp", "/")); a.status != 200 || !strings.HasPrefix(a.body, "email=carol@other.test") {
			t.Fatalf("%d %q, want carol in by groups=dev", a.status, a.body)
		}
		m.QueueUser(&mockoidc.MockUser{Subject: "d-1", Email: "dave@example.com", EmailVerified: true, Groups: []string{"ops"}})
		if a := oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "grp", "/")); a.status != 403 {
			t.Fatalf("%d, want dave (groups ops) refused", a.status)
		}
	})

	noFollow := visitor(t, e, false)
	appCookie := sessionCookie(t, alice, oauthURL(e, "app", "/"))
	withCookie := func(name, v string) oauthAnswer {
		return oauthDo(t, noFollow, "GET", oauthURL(e, name, "/"), "Cookie", "__Host-ngstone-session="+v)
	}
	t.Run("CookieOfAnotherTunnel", func(t *testing.T) {
		if a := withCookie("app", appCookie); a.status != 200 {
			t.Fatalf("the cookie on its own host: %d", a.status)
		}
		if a := withCookie("open", appCookie); !toProvider(m, a) {
			t.Fatalf("app's cookie on open: %d %q, want a sign-in", a.status, a.location)
		}
	})
	t.Run("TamperedCookie", func(t *testing.T) {
		for _, i := range []int{0, len(appCookie) / 2, len(appCookie) - 1} {
			b := []byte(appCookie)
			b[i] ^= 1
			if a := withCookie("app", string(b)); !toProvider(m, a) {
				t.Fatalf("byte %d changed: %d, want a sign-in", i, a.status)
			}
		}
	})
	t.Run("ForgedState", func(t *testing.T) {
		for _, st := range []string{"", "AAAA", appCookie} {
			a := oauthDo(t, noFollow, "GET", oauthURL(e, "auth", "/.ngstone/oauth/callback?code=x&state="+url.QueryEscape(st)))
			if a.status != 400 || a.code != mux.CodeOAuthFailed {
				t.Fatalf("state %.10q: %d %q, want 400 oauth_failed", st, a.status, a.code)
			}
		}
	})

	// One sign-in taken step by step: the provider's oauthAnswer and the
	// handoff each work once, for this browser and this host only.
	eve := visitor(t, e, false)
	start := oauthDo(t, eve, "GET", oauthURL(e, "app", "//evil.test/x"))
	if !toProvider(m, start) {
		t.Fatalf("start: %d %q", start.status, start.location)
	}
	m.QueueUser(&mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true})
	back := oauthDo(t, eve, "GET", start.location)
	if back.status != http.StatusFound || !strings.HasPrefix(back.location, oauthURL(e, "auth", "/.ngstone/oauth/callback?")) {
		t.Fatalf("provider: %d %q", back.status, back.location)
	}
	handoff := oauthDo(t, eve, "GET", back.location)
	if handoff.status != http.StatusFound || !strings.HasPrefix(handoff.location, oauthURL(e, "app", "/.ngstone/oauth/callback?code=")) {
		t.Fatalf("callback: %d %q", handoff.status, handoff.location)
	}
	t.Run("ReplayedState", func(t *testing.T) {
		if a := oauthDo(t, eve, "GET", back.location); a.status != 400 || a.code != mux.CodeOAuthFailed {
			t.Fatalf("the provider's oauthAnswer again: %d %q, want 400 oauth_failed", a.status, a.code)
		}
	})
	t.Run("HandoffToAnotherTunnel", func(t *testing.T) {
		other := strings.Replace(handoff.location, "://app.", "://open.", 1)
		if a := oauthDo(t, eve, "GET", other); a.status != 400 || a.code != mux.CodeOAuthFailed {
			t.Fatalf("app's handoff on open: %d %q", a.status, a.code)
		}
	})
	t.Run("HandoffInAnotherBrowser", func(t *testing.T) {
		if a := oauthDo(t, visitor(t, e, false), "GET", handoff.location); a.status != 400 || a.code != mux.CodeOAuthFailed {
			t.Fatalf("a handoff without the state cookie: %d %q", a.status, a.code)
		}
	})
	t.Run("RedirectStaysOnHost", func(t *testing.T) {
		a := oauthDo(t, eve, "GET", handoff.location)
		if a.status != http.StatusSeeOther || a.location != "/" {
			t.Fatalf("handoff: %d %q, want 303 to / (the visitor asked for //evil.test/x)", a.status, a.location)
		}
		if a := oauthDo(t, eve, "GET", handoff.location); a.status != 400 {
			t.Fatalf("the handoff again: %d, want 400", a.status)
		}
		if a := oauthDo(t, eve, "GET", oauthURL(e, "app", "/in")); a.status != 200 || !strings.HasPrefix(a.body, "email=alice@example.com") {
			t.Fatalf("signed in: %d %q", a.status, a.body)
		}
	})
	t.Run("logout", func(t *testing.T) {
		logout := oauthURL(e, "app", "/.ngstone/logout")
		signedIn := func() bool {
			for _, k := range alice.Jar.Cookies(&url.URL{Scheme: "https", Host: "app." + tunneltest.Domain}) {
				if k.Name == "__Host-ngstone-session" {
					return true
				}
			}
			return false
		}
		// A GET (a link, an image of any page) only shows the button;
		// a POST from another site, another tunnel of the edge
		// included, signs no one out.
		if a := oauthDo(t, alice, "GET", logout); a.status != 200 || !strings.Contains(a.body, `<form method="post" action="/.ngstone/logout">`) || !signedIn() {
			t.Fatalf("GET logout: %d %q, signed in %v; want the page with its button, still signed in", a.status, a.body, signedIn())
		}
		u, _ := url.Parse(logout)
		for _, hdr := range [][]string{
			{"Origin", "https://evil.example"},
			{"Origin", "https://other." + tunneltest.Domain + ":" + u.Port()},
			{"Origin", "null"},
			{"Sec-Fetch-Site", "same-site"},
			{"Sec-Fetch-Site", "cross-site", "Origin", u.Scheme + "://" + u.Host},
		} {
			if a := oauthDo(t, alice, "POST", logout, hdr...); a.status != 400 || a.code != mux.CodeBadRequest || !signedIn() {
				t.Fatalf("POST logout with %v: %d %q, signed in %v; want 400 bad_request, still signed in", hdr, a.status, a.code, signedIn())
			}
		}
		a := oauthDo(t, alice, "POST", logout, "Origin", u.Scheme+"://"+u.Host, "Sec-Fetch-Site", "same-origin")
		if a.status != 200 || !strings.Contains(a.body, "signed out") {
			t.Fatalf("logout: %d %q", a.status, a.body)
		}
		if signedIn() {
			t.Fatal("the session cookie outlived the logout")
		}
		alice.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
		if a := oauthDo(t, alice, "GET", oauthURL(e, "app", "/")); !toProvider(m, a) {
			t.Fatalf("after logout: %d, want a sign-in", a.status)
		}
	})

	// The same host on an edge with another key (a rotated one): the
	// cookie is no session there. Sessions there end after 2 s.
	e2 := oauthEdge(t, m, func(c *edge.Config) { c.OAuthSessionDuration = 2 * time.Second })
	oauthTunnel(t, e2, local, "app", nil)
	t.Run("KeyRotated", func(t *testing.T) {
		a := oauthDo(t, visitor(t, e2, false), "GET", oauthURL(e2, "app", "/"), "Cookie", "__Host-ngstone-session="+appCookie)
		if !toProvider(m, a) {
			t.Fatalf("a cookie of the old key: %d %q, want a sign-in", a.status, a.location)
		}
	})
	t.Run("lifetime", func(t *testing.T) {
		c := visitor(t, e2, true)
		if a := oauthDo(t, c, "GET", oauthURL(e2, "app", "/")); a.status != 200 {
			t.Fatalf("sign-in: %d", a.status)
		}
		v := sessionCookie(t, c, oauthURL(e2, "app", "/"))
		nf := visitor(t, e2, false)
		tunneltest.Eventually(t, 10*time.Second, "the session ends", func() bool {
			return toProvider(m, oauthDo(t, nf, "GET", oauthURL(e2, "app", "/"), "Cookie", "__Host-ngstone-session="+v))
		})
	})
	e3 := oauthEdge(t, m, func(c *edge.Config) { c.OAuthIdleTimeout = 2 * time.Second })
	oauthTunnel(t, e3, local, "app", nil)
	t.Run("IdleTimeout", func(t *testing.T) {
		c := visitor(t, e3, true)
		if a := oauthDo(t, c, "GET", oauthURL(e3, "app", "/")); a.status != 200 {
			t.Fatalf("sign-in: %d", a.status)
		}
		v := sessionCookie(t, c, oauthURL(e3, "app", "/"))
		nf := visitor(t, e3, false) // keeps no refreshed cookie: the session idles
		tunneltest.Eventually(t, 10*time.Second, "the idle session ends", func() bool {
			return toProvider(m, oauthDo(t, nf, "GET", oauthURL(e3, "app", "/"), "Cookie", "__Host-ngstone-session="+v))
		})
	})
}

// fakeGitHub answers as GitHub's documented OAuth app endpoints and REST
// API do, for one user whose emails are given: the authorize page sends
// the browser straight back, the token endpoint checks the client's
// secret and the PKCE verifier.
func fakeGitHub(t *testing.T, emails string) *httptest.Server {
	t.Helper()
	var challenge string
	routes := http.NewServeMux()
	routes.HandleFunc("GET /login/oauth/authorize", func(w http.ResponseWriter, r *http.Request) {
		challenge = r.FormValue("code_challenge")
		u, _ := url.Parse(r.FormValue("redirect_uri"))
		u.RawQuery = url.Values{"code": {"gh-code"}, "state": {r.FormValue("state")}}.Encode()
		http.Redirect(w, r, u.String(), http.StatusFound)
	})
	routes.HandleFunc("POST /login/oauth/access_token", func(w http.ResponseWriter, r *http.Request) {
		id, secret, ok := r.BasicAuth()
		if !ok {
			id, secret = r.FormValue("client_id"), r.FormValue("client_secret")
		}
		sum := sha256.Sum256([]byte(r.FormValue("code_verifier")))
		if id != "gh-id" || secret != "gh-secret" || r.FormValue("code") != "gh-code" || base64.RawURLEncoding.EncodeToString(sum[:]) != challenge {
			http.Error(w, `{"error":"bad_verification_code"}`, http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"access_token":"gho_token","token_type":"bearer","scope":"read:user,user:email"}`)
	})
	api := func(body string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer gho_token" {
				http.Error(w, `{"message":"Requires authentication"}`, http.StatusUnauthorized)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, body)
		}
	}
	routes.HandleFunc("GET /user", api(`{"login":"octocat","id":583231}`))
	routes.HandleFunc("GET /user/emails", api(emails))
	s := httptest.NewServer(routes)
	t.Cleanup(s.Close)
	return s
}

// TestOAuthGitHub: a github provider (at a GitHub Enterprise's addresses)
// signs visitors in by GitHub's OAuth flow with PKCE; the address the
// local service gets, and the allow list matches, is the primary one
// GitHub verified, never another.
func TestOAuthGitHub(t *testing.T) {
	for _, tc := range []struct {
		name, emails, want string
		status             int
	}{
		{"verified", `[{"email":"octo@other.test","primary":false,"verified":true},{"email":"octocat@example.com","primary":true,"verified":true}]`, "octocat@example.com", 200},
		{"unverified", `[{"email":"octocat@example.com","primary":true,"verified":false}]`, "", 403},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gh := fakeGitHub(t, tc.emails)
			cfg := tunneltest.EdgeConfig(t)
			cfg.OAuthProviders = []edge.OAuthProvider{{Name: "github", Kind: edge.OAuthGitHub, ClientID: "gh-id", ClientSecret: "gh-secret",
				AuthURL: gh.URL + "/login/oauth/authorize", TokenURL: gh.URL + "/login/oauth/access_token", APIURL: gh.URL}}
			e := tunneltest.StartEdge(t, cfg)
			ac := e.AgentConfig("", whoService(t))
			ac.Subdomain, ac.OAuth, ac.OAuthAllowDomain = "gh", "github", []string{"example.com"}
			tunneltest.StartAgent(t, ac).WaitOnline(t)
			a := oauthDo(t, visitor(t, e, true), "GET", oauthURL(e, "gh", "/"))
			if a.status != tc.status || tc.status == 200 && !strings.HasPrefix(a.body, "email="+tc.want+" subject=583231 ") {
				t.Fatalf("%d %q, want %d for %q", a.status, a.body, tc.status, tc.want)
			}
		})
	}
}

// TestOAuthIssuerDown: an issuer that cannot be reached neither stops the
// edge from starting nor holds visitors: each gets 502 oauth_failed at
// once (a failed discovery is kept a few seconds), and the local service
// is never reached.
func TestOAuthIssuerDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	issuer := "http://" + ln.Addr().String() + "/oidc"
	ln.Close() // refused from now on
	cfg := tunneltest.EdgeConfig(t)
	cfg.OAuthProviders = []edge.OAuthProvider{{Name: "corp", Kind: edge.OAuthOIDC, Issuer: issuer, ClientID: "c", ClientSecret: "s"}}
	e := tunneltest.StartEdge(t, cfg)
	oauthTunnel(t, e, whoService(t), "app", nil)
	for range 3 {
		if a := oauthDo(t, visitor(t, e, false), "GET", oauthURL(e, "app", "/")); a.status != http.StatusBadGateway || a.code != mux.CodeOAuthFailed {
			t.Fatalf("%d %q %q, want 502 oauth_failed", a.status, a.code, a.body)
		}
	}
}
