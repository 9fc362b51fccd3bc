package edge

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The edge's own work per request for a tunnel's checks, without the
// request's path: BENCHMARKS.md keeps the figures.

// BenchmarkOAuthSignedIn: a signed-in visitor's request through the gate
// (the cookie opened and checked, the allow list, the edge's cookies
// dropped); the request's clone, which the gate needs afresh each time,
// included.
func BenchmarkOAuthSignedIn(b *testing.B) {
	cfg := DefaultConfig()
	cfg.Domain, cfg.OAuthKey = "ngstone.test", bytes.Repeat([]byte{7}, 32)
	cfg.OAuthProviders = []OAuthProvider{{Name: "corp", Kind: OAuthOIDC, Issuer: "https://sso.example.com", ClientID: "c", ClientSecret: "s"}}
	e, err := New(cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	rule, err := e.oauth.rule(&mux.OAuth{Provider: "corp", AllowDomains: []string{"example.com"}, AllowEmails: []string{"bob@example.org"}})
	if err != nil {
		b.Fatal(err)
	}
	now := time.Now().Unix()
	v, err := e.oauth.seal.seal(sealSession, oauthSession{Host: "app.ngstone.test", Provider: "corp",
		identity: identity{Email: "alice@example.com", Subject: "248289761001"}, Issued: now, Seen: now})
	if err != nil {
		b.Fatal(err)
	}
	r := httptest.NewRequest("GET", "https://app.ngstone.test/api/items?page=2", nil)
	r.Header.Set("Cookie", "theme=dark; "+sessionCookie+"="+v)
	rt := route{hostname: "app.ngstone.test"}
	w := httptest.NewRecorder()
	b.ReportAllocs()
	for b.Loop() {
		if out := e.signedIn(w, r.Clone(r.Context()), rt, rule); out == nil {
			b.Fatalf("refused: %d", w.Code)
		}
	}
}

// BenchmarkVerifyWebhook: a GitHub delivery of 1 KiB verified, its body
// read whole and passed on.
func BenchmarkVerifyWebhook(b *testing.B) {
	cfg := DefaultConfig()
	cfg.Domain = "ngstone.test"
	e, err := New(cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	c, _ := parseWebhook(&mux.Webhook{Provider: "github", Secret: "It's a Secret to Everybody"})
	body := bytes.Repeat([]byte("x"), 1<<10)
	m := hmac.New(sha256.New, c.secret)
	m.Write(body)
	sig := "sha256=" + hex.EncodeToString(m.Sum(nil))
	rt := route{hostname: "hooks.ngstone.test"}
	w := httptest.NewRecorder()
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest("POST", "https://hooks.ngstone.test/payload", bytes.NewReader(body))
		r.Header.Set("X-Hub-Signature-256", sig)
		if !e.verifyWebhook(w, r, rt, c) {
			b.Fatal("refused")
		}
		io.Copy(io.Discard, r.Body)
	}
}
