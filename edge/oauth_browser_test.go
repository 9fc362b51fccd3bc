package edge_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/gorilla/websocket"
	"github.com/oauth2-proxy/mockoidc"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestOAuthInBrowser signs visitors in with a real headless Chromium, on
// an edge and agents of the CLI's defaults and an OIDC provider in the
// test process: the local service sees the email the provider gave, a
// WebSocket after sign-in carries it too, sign-out ends the session, an
// address outside the allow list gets the 403 oauth_denied page saying
// who is signed in, and an own hostname signs in through the handoff.
func TestOAuthInBrowser(t *testing.T) {
	chromium := tunneltest.Tool(t, "chromium")
	m := startOIDC(t)
	e := oauthEdge(t, m, func(c *edge.Config) {
		c.TokenPolicies = []edge.TokenPolicy{{Token: "t", Hostnames: []string{"*.example.test"}}}
	})
	up := websocket.Upgrader{}
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		email := r.Header.Get(edge.HeaderAuthEmail)
		if r.URL.Path != "/ws" {
			fmt.Fprintf(w, "email=%s cookie=%s", email, r.Header.Get("Cookie"))
			return
		}
		c, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		_, msg, _ := c.ReadMessage()
		c.WriteMessage(websocket.TextMessage, []byte(string(msg)+" from "+email))
	}))
	t.Cleanup(local.Close)
	addr := local.Listener.Addr().String()
	oauthTunnel(t, e, addr, "app", func(c *agent.Config) { c.Token, c.OAuthAllowEmail = "t", []string{"alice@example.com"} })
	oauthTunnel(t, e, addr, "", func(c *agent.Config) {
		c.Token, c.Hostname, c.OAuthAllowDomain = "t", "own.example.test", []string{"example.com"}
	})

	ctx := tunneltest.Browser(t, chromium, chromedp.Flag("ignore-certificate-errors", true),
		chromedp.Flag("host-resolver-rules", "MAP *.test 127.0.0.1"))
	body := func(u string) string {
		t.Helper()
		if err := chromedp.Do(ctx, chromedp.Navigate(u)); err != nil {
			t.Fatalf("open %s: %v", u, err)
		}
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(s)
	}
	_, port, _ := net.SplitHostPort(e.Addr("https").String())
	own := "https://own.example.test:" + port

	m.QueueUser(&mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true})
	if got := body(oauthURL(e, "app", "/hello")); got != "email=alice@example.com cookie=" {
		t.Fatalf("after sign-in the page is %q", got)
	}
	echo, err := chromedp.Run(ctx, chromedp.Evaluate[string](`new Promise((ok, fail) => {
		const ws = new WebSocket("wss://" + location.host + "/ws");
		ws.onopen = () => ws.send("hi");
		ws.onmessage = m => ok(m.data);
		ws.onerror = () => fail("the WebSocket failed");
		setTimeout(() => fail("no answer"), 10000);
	})`, chromedp.EvalAwaitPromise))
	if err != nil || echo != "hi from alice@example.com" {
		t.Fatalf("WebSocket after sign-in: %q %v", echo, err)
	}
	// Sign-out is the logout page's button: a form of the tunnel's own.
	if got := body(oauthURL(e, "app", "/.ngstone/logout")); !strings.Contains(got, "Sign out of app.") {
		t.Fatalf("logout page: %q", got)
	}
	if err := chromedp.Do(ctx, chromedp.Click(chromedp.ID("signout")), chromedp.WaitVisible(chromedp.ID("link"))); err != nil {
		t.Fatalf("sign out: %v", err)
	}
	if got, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`)); err != nil || !strings.Contains(got, "signed out") {
		t.Fatalf("after the sign-out button: %q %v", got, err)
	}

	m.QueueUser(&mockoidc.MockUser{Subject: "b-1", Email: "bob@example.com", EmailVerified: true})
	got := body(oauthURL(e, "app", "/hello"))
	if !strings.Contains(got, "Not allowed") || !strings.Contains(got, "Signed in as bob@example.com") || !strings.Contains(got, "oauth_denied") {
		t.Fatalf("bob's page: %q", got)
	}
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(90))
	if err == nil {
		os.WriteFile(filepath.Join(tunneltest.ArtifactDir(t), "oauth-denied.png"), shot, 0o644)
	}

	// An own hostname, outside the edge's domain: bob (example.com) is in,
	// with the cookie handed to that host.
	m.QueueUser(&mockoidc.MockUser{Subject: "b-1", Email: "bob@example.com", EmailVerified: true})
	if got := body(own + "/"); got != "email=bob@example.com cookie=" {
		t.Fatalf("own hostname after sign-in: %q", got)
	}
	if got := body(own + "/again"); got != "email=bob@example.com cookie=" {
		t.Fatalf("own hostname signed in: %q", got)
	}
}
