package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/oauth2-proxy/mockoidc"
)

// TestOAuthCLI: `ngstone edge` with a provider in its config file's
// oauth-providers: section, and `ngstone http PORT --oauth corp
// --oauth-allow-domain example.com`: a visitor signs in at the provider
// and reaches the local service, which learns the visitor's address; over
// plain HTTP the visitor is sent to HTTPS first; /api/tunnels names the
// provider; an agent asking for a provider the edge does not offer exits
// saying which it does.
func TestOAuthCLI(t *testing.T) {
	m, err := mockoidc.Run()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Shutdown() })
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s", r.Header.Get("Ngstone-Auth-Email"))
	})
	data, dir := t.TempDir(), t.TempDir()
	ports := freePorts(t, 5)
	write(t, filepath.Join(dir, "corp.secret"), m.ClientSecret+"\n")
	write(t, filepath.Join(dir, "edge.yaml"), fmt.Sprintf(`oauth-provider: [corp]
oauth-providers:
  corp:
    issuer: %s
    client-id: %s
    client-secret-file: %s
`, m.Issuer(), m.ClientID, filepath.Join(dir, "corp.secret")))
	startProc(t, nil, edgeArgs(data, ports[:3], "--https-addr", "127.0.0.1:"+ports[3], "--config", filepath.Join(dir, "edge.yaml"))...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	agentArgs := []string{"--edge", "127.0.0.1:" + ports[1], "--server-name", "localhost", "--ca-file", filepath.Join(data, "ca.pem")}
	startProc(t, nil, append([]string{"http", port, "--subdomain", "app", "--oauth", "corp", "--oauth-allow-domain", "example.com",
		"--inspect-addr", "127.0.0.1:" + ports[4]}, agentArgs...)...).
		waitLine(t, regexp.MustCompile(`^Forwarding https://app\.ngstone\.test:`))

	jar, _ := cookiejar.New(nil)
	d := &net.Dialer{Timeout: 2 * time.Second}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if host, p, _ := net.SplitHostPort(addr); strings.HasSuffix(host, ".test") {
				addr = "127.0.0.1:" + p
			}
			return d.DialContext(ctx, network, addr)
		},
		TLSClientConfig: &tls.Config{RootCAs: dataDirCA(t, data)},
	}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr, Jar: jar, Timeout: 20 * time.Second}

	m.QueueUser(&mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true})
	resp, err := c.Get("http://app.ngstone.test:" + ports[0] + "/x")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "hello alice@example.com" || resp.Request.URL.String() != "https://app.ngstone.test:"+ports[3]+"/x" {
		t.Fatalf("sign-in from plain HTTP: %d %q at %s", resp.StatusCode, b, resp.Request.URL)
	}

	resp, err = http.Get("http://127.0.0.1:" + ports[4] + "/api/tunnels")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Tunnels []struct {
			Config struct {
				OAuth string `json:"oauth"`
			} `json:"config"`
		} `json:"tunnels"`
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil || len(list.Tunnels) == 0 || list.Tunnels[0].Config.OAuth != "corp" {
		t.Fatalf("/api/tunnels: %+v, %v; want oauth corp", list, err)
	}

	p := startProc(t, nil, append([]string{"http", port, "--oauth", "google", "--inspect=false"}, agentArgs...)...)
	if code := p.exitCode(t); code == 0 || !strings.Contains(p.stderrText(), "this edge offers corp") {
		t.Fatalf("--oauth google on an edge offering corp: exit %d, %s", code, p.stderrText())
	}
}
