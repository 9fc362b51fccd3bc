package main

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestVerifyWebhookCLI: `ngstone http PORT --verify-webhook github
// --verify-webhook-secret-file F` against an edge process: a delivery
// signed as GitHub signs reaches the local service, an unsigned one gets
// 403 webhook_unverified and does not.
func TestVerifyWebhookCLI(t *testing.T) {
	reached := make(chan string, 4)
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		reached <- string(b)
		io.WriteString(w, "delivered")
	})
	data := t.TempDir()
	ports := freePorts(t, 4)
	startProc(t, nil, edgeArgs(data, ports[:3])...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	secret := filepath.Join(t.TempDir(), "github.secret")
	write(t, secret, "It's a Secret to Everybody\n")
	startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--server-name", "localhost", "--ca-file", filepath.Join(data, "ca.pem"),
		"--subdomain", "hooks", "--verify-webhook", "github", "--verify-webhook-secret-file", secret, "--inspect-addr", "127.0.0.1:"+ports[3]).
		waitLine(t, regexp.MustCompile(`^Forwarding http://hooks\.ngstone\.test:`))

	const body = "Hello, World!"
	// GitHub's documented example: this secret and body give this digest.
	const sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
	m := hmac.New(sha256.New, []byte("It's a Secret to Everybody"))
	io.WriteString(m, body)
	if got := "sha256=" + hex.EncodeToString(m.Sum(nil)); got != sig {
		t.Fatalf("HMAC-SHA256 of GitHub's example: %s, want %s", got, sig)
	}
	c := visitorClient(t, "127.0.0.1:"+ports[0])
	post := func(sig string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, "http://hooks.ngstone.test/payload", strings.NewReader(body))
		if sig != "" {
			req.Header.Set("X-Hub-Signature-256", sig)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	if resp := post(sig); resp.StatusCode != http.StatusOK || <-reached != body {
		t.Fatalf("signed delivery: %d", resp.StatusCode)
	}
	if resp := post(""); resp.StatusCode != http.StatusForbidden || resp.Header.Get("Ngstone-Error") != "webhook_unverified" {
		t.Fatalf("unsigned delivery: %d %s", resp.StatusCode, resp.Header.Get("Ngstone-Error"))
	}
	select {
	case got := <-reached:
		t.Fatalf("the unsigned delivery reached the local service: %q", got)
	default:
	}
	resp, err := http.Get("http://127.0.0.1:" + ports[3] + "/api/tunnels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Tunnels []struct {
			Config struct {
				VerifyWebhook string `json:"verify_webhook"`
			} `json:"config"`
		} `json:"tunnels"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || len(list.Tunnels) == 0 || list.Tunnels[0].Config.VerifyWebhook != "github" {
		t.Fatalf("/api/tunnels: %+v, %v; want verify_webhook github", list, err)
	}
}
