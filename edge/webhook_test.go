package edge_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/slack-go/slack"
	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

const webhookSecret = "whsec_0123456789abcdef"

func hmacHex(parts ...string) string {
	m := hmac.New(sha256.New, []byte(webhookSecret))
	for _, p := range parts {
		io.WriteString(m, p)
	}
	return hex.EncodeToString(m.Sum(nil))
}

// Signers, each as its provider's docs give it: the headers of a body
// signed at ts.
var signers = map[string]func(body string, ts time.Time) http.Header{
	"github": func(body string, _ time.Time) http.Header {
		return http.Header{"X-Hub-Signature-256": {"sha256=" + hmacHex(body)}}
	},
	"stripe": func(body string, ts time.Time) http.Header {
		// Stripe's own SDK makes the field.
		p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: webhookSecret, Timestamp: ts})
		return http.Header{"Stripe-Signature": {p.Header}}
	},
	"slack": func(body string, ts time.Time) http.Header {
		t := strconv.FormatInt(ts.Unix(), 10)
		return http.Header{"X-Slack-Request-Timestamp": {t}, "X-Slack-Signature": {"v0=" + hmacHex("v0:", t, ":", body)}}
	},
	"hmac": func(body string, _ time.Time) http.Header {
		m := hmac.New(sha256.New, []byte(webhookSecret))
		io.WriteString(m, body)
		return http.Header{"X-Signature": {base64.StdEncoding.EncodeToString(m.Sum(nil))}}
	},
}

// TestSlackSignerIsSlacks: the Slack signature these tests send is one
// Slack's own SDK verifies (the SDK has no signer).
func TestSlackSignerIsSlacks(t *testing.T) {
	const body = `{"type":"url_verification"}`
	sv, err := slack.NewSecretsVerifier(signers["slack"](body, time.Now()), webhookSecret)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(&sv, body)
	if err := sv.Ensure(); err != nil {
		t.Fatalf("slack's SDK refuses the test's signature: %v", err)
	}
}

// TestVerifyWebhook: a tunnel of each provider's --verify-webhook, on an
// edge of the CLI's defaults. A request signed with the tunnel's secret
// reaches the local service byte for byte; one with a byte changed, no
// signature, an old timestamp, or a body over the edge's bound (10 MiB)
// gets 403 webhook_unverified with the reason, and never reaches it.
func TestVerifyWebhook(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	b := tunneltest.StartBackend(t)
	for provider, sign := range signers {
		t.Run(provider, func(t *testing.T) {
			ac := e.AgentConfig("", b.Addr())
			ac.Subdomain, ac.VerifyWebhook, ac.VerifyWebhookSecret = provider, provider, webhookSecret
			if provider == "hmac" {
				ac.VerifyWebhookHeader = "X-Signature"
			}
			ag := tunneltest.StartAgent(t, ac)
			ag.WaitOnline(t)
			post := func(body string, h http.Header) *http.Response {
				t.Helper()
				req, _ := http.NewRequest(http.MethodPost, tunneltest.URL("https", provider, "/echo"), strings.NewReader(body))
				for k, v := range h {
					req.Header[k] = v
				}
				resp, err := e.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { resp.Body.Close() })
				return resp
			}
			refused := func(what string, resp *http.Response) {
				t.Helper()
				got, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
				if resp.StatusCode != http.StatusForbidden || resp.Header.Get(mux.ErrorHeader) != mux.CodeWebhookUnverified || resp.Header.Get("Ngstone-Webhook-Error") == "" {
					t.Fatalf("%s: %d %s %.200q; want 403 %s with the reason", what, resp.StatusCode, resp.Header.Get(mux.ErrorHeader), got, mux.CodeWebhookUnverified)
				}
			}

			body := fmt.Sprintf(`{"id":"evt_1","provider":%q,"data":"%s"}`, provider, strings.Repeat("x", 100<<10))
			resp := post(body, sign(body, time.Now()))
			if got, _ := io.ReadAll(resp.Body); resp.StatusCode != http.StatusOK || string(got) != body {
				t.Fatalf("signed: %d, %d bytes back; want 200 and the %d bytes sent", resp.StatusCode, len(got), len(body))
			}
			changed := strings.Replace(body, "evt_1", "evt_2", 1)
			refused("a byte changed", post(changed, sign(body, time.Now())))
			refused("unsigned", post(body, nil))
			// The agent's inspector lists it, and why, though it never crossed.
			tunneltest.Eventually(t, 5*time.Second, "the inspector to list the refusal", func() bool {
				for _, c := range ag.Inspector().List() {
					if c.Code == mux.CodeWebhookUnverified && c.Path == "/echo" && c.Status == http.StatusForbidden && c.Refused != "" {
						return true
					}
				}
				return false
			})
			if provider == "stripe" || provider == "slack" {
				refused("signed 6 minutes ago", post(body, sign(body, time.Now().Add(-6*time.Minute))))
			}
			big := strings.Repeat("y", 10<<20+1)
			refused("a body over the bound", post(big, sign(big, time.Now())))
		})
	}
}

// TestVerifyWebhookRefusesRelays: a TCP tunnel cannot ask for webhook
// verification; the agent refuses it before it connects.
func TestVerifyWebhookRefusesRelays(t *testing.T) {
	ac := agent.DefaultConfig()
	ac.Edge, ac.Proto, ac.Local = "127.0.0.1:1", agent.ProtoTCP, "127.0.0.1:1"
	ac.VerifyWebhook, ac.VerifyWebhookSecret = "github", webhookSecret
	if err := ac.Validate(); err == nil || !strings.Contains(err.Error(), "verify-webhook") {
		t.Fatalf("a TCP tunnel with --verify-webhook: %v; want it refused", err)
	}
}

// TestClusterVerifyWebhook: the edge that holds the tunnel checks the
// signature of a request another edge forwarded.
func TestClusterVerifyWebhook(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(t)
	ac := a.AgentConfigShortTimeouts("", backend.Addr())
	ac.Subdomain, ac.VerifyWebhook, ac.VerifyWebhookSecret = "hook", "github", webhookSecret
	waitRouted(t, b, "hook."+tunneltest.Domain, tunneltest.StartAgent(t, ac).WaitOnline(t))
	const body = `{"zen":"Keep it logically awesome."}`
	for _, h := range []http.Header{signers["github"](body, time.Now()), nil} {
		req, _ := http.NewRequest(http.MethodPost, tunneltest.URL("https", "hook", "/echo"), strings.NewReader(body))
		for k, v := range h {
			req.Header[k] = v
		}
		resp, err := b.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case h != nil && (resp.StatusCode != http.StatusOK || string(got) != body):
			t.Fatalf("signed, via b: %d %q", resp.StatusCode, got)
		case h == nil && (resp.StatusCode != http.StatusForbidden || resp.Header.Get(mux.ErrorHeader) != mux.CodeWebhookUnverified):
			t.Fatalf("unsigned, via b: %d %s", resp.StatusCode, resp.Header.Get(mux.ErrorHeader))
		}
	}
}

// TestVerifyWebhookRefusalsBounded: a flood of unsigned requests gets 403
// each, but the agent hears of a few a second at most.
func TestVerifyWebhookRefusalsBounded(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	ac := e.AgentConfig("", tunneltest.StartBackend(t).Addr())
	ac.Subdomain, ac.VerifyWebhook, ac.VerifyWebhookSecret = "flood", "github", webhookSecret
	ag := tunneltest.StartAgent(t, ac)
	ag.WaitOnline(t)
	began := time.Now()
	const n = 200
	for range n {
		resp, err := e.Client().Post(tunneltest.URL("https", "flood", "/echo"), "application/json", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Fatalf("unsigned: %d", resp.StatusCode)
		}
	}
	// The burst, and five a second after it (plus one for the clock).
	bound := 10 + int(5*time.Since(began).Seconds()) + 1
	tunneltest.Eventually(t, 5*time.Second, "the burst's notices", func() bool { return len(ag.Inspector().List()) >= 10 })
	if got := len(ag.Inspector().List()); got > bound || got == n {
		t.Fatalf("the agent listed %d of %d refusals, over the bound %d", got, n, bound)
	}
}
