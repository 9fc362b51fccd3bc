package edge_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

func adminGet(t *testing.T, e *tunneltest.Edge, path, auth string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", "http://"+e.Addr("admin").String()+path, nil)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp, string(body)
}

func TestAdminToken(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.AdminToken = "s3cret"
	e := tunneltest.StartEdge(t, cfg)
	for _, tc := range []struct {
		path, auth string
		want       int
	}{
		{"/healthz", "", 200}, // open, so a container healthcheck needs no secret
		{"/metrics", "", 401},
		{"/metrics", "Bearer wrong", 401},
		{"/metrics", "s3cret", 401},
		{"/metrics", "Bearer s3cret", 200},
		{"/api/tunnels", "", 401},
		{"/api/tunnels", "Bearer s3cret", 200},
		{"/api/tunnels/app." + tunneltest.Domain, "", 401},
		{"/api/tunnels/app." + tunneltest.Domain, "Bearer s3cret", 404},
	} {
		resp, body := adminGet(t, e, tc.path, tc.auth)
		if resp.StatusCode != tc.want {
			t.Errorf("GET %s with %q: status %d, want %d (%s)", tc.path, tc.auth, resp.StatusCode, tc.want, body)
		}
		if resp.StatusCode == 401 && !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("GET %s: 401 without a Bearer WWW-Authenticate challenge", tc.path)
		}
	}
}

func TestAdminAddrNeedsToken(t *testing.T) {
	for name, tc := range map[string]struct {
		addr, token string
		ok          bool
	}{
		"loopback v4":            {"127.0.0.1:9180", "", true},
		"loopback v6":            {"[::1]:9180", "", true},
		"localhost":              {"localhost:9180", "", true},
		"disabled":               {"", "", true},
		"all interfaces":         {":9180", "", false},
		"any v4":                 {"0.0.0.0:9180", "", false},
		"public address":         {"192.0.2.10:9180", "", false},
		"any v4 with token":      {"0.0.0.0:9180", "t", true},
		"all interfaces + token": {":9180", "t", true},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := edge.DefaultConfig()
			cfg.Domain = tunneltest.Domain
			cfg.TLS.DataDir = t.TempDir()
			cfg.AdminAddr, cfg.AdminToken = tc.addr, tc.token
			_, err := edge.New(cfg, nil) // New does no I/O; it validates
			if tc.ok && err != nil {
				t.Fatalf("New: %v", err)
			}
			if !tc.ok {
				if err == nil {
					t.Fatal("New accepted a non-loopback admin-addr without admin-token")
				}
				if !strings.Contains(err.Error(), "admin-addr") || !strings.Contains(err.Error(), "admin-token") {
					t.Errorf("error %q should name admin-addr and admin-token", err)
				}
			}
		})
	}
}

func TestAdminAPI(t *testing.T) {
	e, _, a := startTunnel(t, "app")
	resp, body := adminGet(t, e, "/healthz", "")
	if resp.StatusCode != 200 || body != "ok" {
		t.Errorf("/healthz: %d %q", resp.StatusCode, body)
	}
	resp, _ = adminGet(t, e, "/metrics", "")
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("/metrics: %d %q, want 200 in the Prometheus text format", resp.StatusCode, ct)
	}

	host := "app." + tunneltest.Domain
	resp, body = adminGet(t, e, "/api/tunnels", "")
	var list []map[string]any
	if err := json.Unmarshal([]byte(body), &list); err != nil || resp.StatusCode != 200 || len(list) != 1 {
		t.Fatalf("/api/tunnels: %d %v %s", resp.StatusCode, err, body)
	}
	for _, f := range []string{"hostname", "url", "instance_id", "session_id", "generation", "online", "last_heartbeat", "remote_addr", "bound_at"} {
		if _, ok := list[0][f]; !ok {
			t.Errorf("/api/tunnels: field %s missing in %v", f, list[0])
		}
	}
	st := a.Status()
	if list[0]["hostname"] != host || list[0]["online"] != true || list[0]["instance_id"] != st.InstanceID {
		t.Errorf("/api/tunnels: %v, want %s online for instance %s", list[0], host, st.InstanceID)
	}
	if ts, _ := time.Parse(time.RFC3339Nano, list[0]["last_heartbeat"].(string)); time.Since(ts) > 10*time.Second {
		t.Errorf("last_heartbeat %v is not recent", list[0]["last_heartbeat"])
	}

	resp, body = adminGet(t, e, "/api/tunnels/"+host, "")
	var one map[string]any
	if err := json.Unmarshal([]byte(body), &one); err != nil || resp.StatusCode != 200 || one["hostname"] != host {
		t.Errorf("/api/tunnels/%s: %d %v %s", host, resp.StatusCode, err, body)
	}
	if resp, _ := adminGet(t, e, "/api/tunnels/nobody."+tunneltest.Domain, ""); resp.StatusCode != 404 {
		t.Errorf("/api/tunnels/nobody: status %d, want 404", resp.StatusCode)
	}
}
