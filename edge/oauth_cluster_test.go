package edge_test

import (
	"strings"
	"testing"
	"time"

	"github.com/oauth2-proxy/mockoidc"

	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestClusterOAuth: in a cluster, a visitor of edge b signs in for a
// tunnel whose agent is on edge a: b serves the callback, a (the owner)
// checks the session on the forwarded requests, and the cookie is good on
// either edge, whose keys both come from the cluster key.
func TestClusterOAuth(t *testing.T) {
	m := startOIDC(t)
	providers := func(c *edge.Config) {
		c.OAuthProviders = []edge.OAuthProvider{{Name: "corp", Kind: edge.OAuthOIDC, Issuer: m.Issuer(),
			ClientID: m.ClientID, ClientSecret: m.ClientSecret}}
	}
	c := newTestCluster(t)
	a, b := c.start("a", nil, providers), c.start("b", nil, providers)
	ac := a.AgentConfigShortTimeouts("", whoService(t))
	ac.Subdomain, ac.InstanceID, ac.OAuth, ac.OAuthAllowDomain = "app", instX, "corp", []string{"example.com"}
	st := tunneltest.StartAgent(t, ac).WaitOnline(t)
	tunneltest.Eventually(t, 5*time.Second, "b to learn the route", func() bool {
		r, ok := b.store.Lookup("app." + tunneltest.Domain)
		return ok && r.Generation == st.Generation
	})

	m.QueueUser(&mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true})
	viaB := visitor(t, b.Edge, true)
	if got := oauthDo(t, viaB, "GET", oauthURL(b.Edge, "app", "/x")); got.status != 200 || !strings.HasPrefix(got.body, "email=alice@example.com subject=a-1 cookie= ") {
		t.Fatalf("sign-in through b: %d %q", got.status, got.body)
	}
	v := sessionCookie(t, viaB, oauthURL(b.Edge, "app", "/"))
	viaA := visitor(t, a.Edge, false)
	if got := oauthDo(t, viaA, "GET", oauthURL(a.Edge, "app", "/y"), "Cookie", "__Host-ngstone-session="+v); got.status != 200 || !strings.HasPrefix(got.body, "email=alice@example.com") {
		t.Fatalf("b's cookie on a: %d %q", got.status, got.body)
	}
	m.QueueUser(&mockoidc.MockUser{Subject: "b-1", Email: "bob@other.test", EmailVerified: true})
	if got := oauthDo(t, visitor(t, b.Edge, true), "GET", oauthURL(b.Edge, "app", "/")); got.status != 403 || got.code != "oauth_denied" {
		t.Fatalf("bob through b: %d %q", got.status, got.code)
	}
}
