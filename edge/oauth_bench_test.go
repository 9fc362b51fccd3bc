package edge

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The edge's own work per request for a tunnel's checks, without the
// request's path: BENCHMARKS.md keeps the figures; and the sign-in's
// bound on the nonces it remembers.

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

// TestNoncesNeverForgottenInForce: the set of used nonces, full of nonces
// in force, refuses a new one rather than forget one, which could then
// be used again; once some expire, they make room.
func TestNoncesNeverForgottenInForce(t *testing.T) {
	o := &oauth{used: map[string]int64{}}
	const now = 1_000_000
	for i := range usedNonces {
		exp := int64(now + 600)
		if i < 10 {
			exp = now + 60 // handoffs: expire first
		}
		if fresh, full := o.use(fmt.Sprint(i), exp, now); !fresh || full {
			t.Fatalf("nonce %d of %d: fresh %v, full %v", i, usedNonces, fresh, full)
		}
	}
	if fresh, full := o.use("one more", now+600, now+1); fresh || !full {
		t.Fatalf("a new nonce with every one in force: fresh %v, full %v; want refused, full", fresh, full)
	}
	for _, n := range []string{"0", "9", fmt.Sprint(usedNonces - 1)} {
		if fresh, _ := o.use(n, now+600, now+1); fresh {
			t.Fatalf("nonce %s, in force, was forgotten and taken again", n)
		}
	}
	// The ten handoffs have expired: room for ten, and no more.
	for i := range 10 {
		if fresh, full := o.use(fmt.Sprint("late ", i), now+700, now+61); !fresh || full {
			t.Fatalf("late nonce %d after ten expired: fresh %v, full %v", i, fresh, full)
		}
	}
	if fresh, full := o.use("late 10", now+700, now+61); fresh || !full {
		t.Fatalf("an eleventh late nonce: fresh %v, full %v; want refused, full", fresh, full)
	}
}
