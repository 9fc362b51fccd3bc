package config_test

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/edge"
)

// TestEdgeOAuthProviders: the providers --oauth-provider names are read
// from the file's oauth-providers: section (secrets from their files, the
// kind from the name or the issuer); a provider without a section, a
// misspelt key, a missing secret or reserved-names without auth are
// errors naming what to fix.
func TestEdgeOAuthProviders(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "s")
	if err := os.WriteFile(secret, []byte("  s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	section := `oauth-providers:
  google:
    client-id: g-id
    client-secret-file: ` + secret + `
  github:
    client-id: gh-id
    client-secret-file: ` + secret + `
  corp:
    issuer: https://sso.example.com
    client-id: c-id
    client-secret-file: ` + secret + `
    scopes: [openid, email, groups]
`
	file := writeFile(t, "domain: d.example\noauth-provider: [google, github, corp]\noauth-session-duration: 8h\n"+section)
	c, err := loadEdge(t, "--config", file, "--oauth-idle-timeout", "30m")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load()
	if err != nil {
		t.Fatal(err)
	}
	want := []edge.OAuthProvider{
		{Name: "google", Kind: edge.OAuthGoogle, ClientID: "g-id", ClientSecret: "s3cret"},
		{Name: "github", Kind: edge.OAuthGitHub, ClientID: "gh-id", ClientSecret: "s3cret"},
		{Name: "corp", Kind: edge.OAuthOIDC, Issuer: "https://sso.example.com", ClientID: "c-id", ClientSecret: "s3cret", Scopes: []string{"openid", "email", "groups"}},
	}
	if !reflect.DeepEqual(cfg.OAuthProviders, want) {
		t.Fatalf("providers:\n%+v\nwant\n%+v", cfg.OAuthProviders, want)
	}
	if cfg.OAuthSessionDuration != 8*time.Hour || cfg.OAuthIdleTimeout != 30*time.Minute {
		t.Fatalf("durations %s %s", cfg.OAuthSessionDuration, cfg.OAuthIdleTimeout)
	}

	for name, tc := range map[string]struct{ file, want string }{
		"no section":       {"domain: d.example\noauth-provider: [okta]\n" + section, "no oauth-providers.okta section"},
		"misspelt key":     {"domain: d.example\noauth-provider: [corp]\noauth-providers:\n  corp:\n    issuer: https://x\n    client_id: a\n", "client_id"},
		"no secret":        {"domain: d.example\noauth-provider: [corp]\noauth-providers:\n  corp:\n    issuer: https://x\n    client-id: a\n", "client_id and client_secret_file are required"},
		"oidc, no issuer":  {"domain: d.example\noauth-provider: [corp]\noauth-providers:\n  corp:\n    kind: oidc\n    client-id: a\n    client-secret-file: " + secret + "\n", "needs its issuer"},
		"auth not kept":    {"domain: d.example\nreserved-names: [www]\noauth-provider: [google]\n" + section, `keep "auth" in reserved-names`},
		"unreadable":       {"domain: d.example\noauth-provider: [corp]\noauth-providers:\n  corp:\n    issuer: https://x\n    client-id: a\n    client-secret-file: /nonexistent/s\n", "client-secret-file"},
		"section, no flag": {"domain: d.example\n" + section + "  bad:\n    nonsense: 1\n", ""},
	} {
		t.Run(name, func(t *testing.T) {
			c, err := loadEdge(t, "--config", writeFile(t, tc.file))
			if err == nil {
				_, _, err = c.Load()
			}
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
}

// TestTunnelsOAuth: a tunnels: entry's oauth keys (ngrok's _ spelling
// too) reach its tunnel; an allow list without a provider, and oauth on a
// TCP tunnel, are errors.
func TestTunnelsOAuth(t *testing.T) {
	file := writeFile(t, `edge: e.example:4443
tunnels:
  web:
    addr: 3000
    oauth: google
    oauth_allow_domain: [example.com]
    oauth-allow-email: [bob@example.org]
    oauth-allow-claim: [groups=dev]
    oauth-allow-preflight: true
`)
	cfg, err := loadTunnels(t, file, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	tu := cfg.Tunnels[0]
	if tu.OAuth != "google" || !reflect.DeepEqual(tu.OAuthAllowDomain, []string{"example.com"}) || !reflect.DeepEqual(tu.OAuthAllowEmail, []string{"bob@example.org"}) ||
		!reflect.DeepEqual(tu.OAuthAllowClaim, []string{"groups=dev"}) || !tu.OAuthAllowPreflight {
		t.Fatalf("tunnel: %+v", tu)
	}
	for name, tc := range map[string]struct{ entry, want string }{
		"list without provider": {"    addr: 3000\n    oauth-allow-email: [a@example.com]\n", "give --oauth PROVIDER too"},
		"tcp":                   {"    addr: 22\n    proto: tcp\n    oauth: google\n", "oauth is HTTP's"},
		"bad claim":             {"    addr: 3000\n    oauth: corp\n    oauth-allow-claim: [groups]\n", "NAME=VALUE"},
		"bad email":             {"    addr: 3000\n    oauth: corp\n    oauth-allow-email: [alice]\n", "name@domain"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := loadTunnels(t, writeFile(t, "edge: e.example:4443\ntunnels:\n  x:\n"+tc.entry), nil, true)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
}
