package agent_test

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestLocalAPITunnels: /api/tunnels in ngrok's shape, one entry per public
// URL, the HTTPS one first as "command_line"; each by name; none once
// the agent lost its name.
func TestLocalAPITunnels(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", b.Addr())
	cfg.Subdomain, cfg.InspectAddr = "scripts", "127.0.0.1:0"
	ta := tunneltest.StartAgent(t, cfg)
	st := ta.WaitOnline(t)
	if st.InspectURL == "" {
		t.Fatal("no inspector URL in the status")
	}
	c := &http.Client{Timeout: 5 * time.Second}
	var list struct {
		Tunnels []struct {
			Name      string `json:"name"`
			URI       string `json:"uri"`
			PublicURL string `json:"public_url"`
			Proto     string `json:"proto"`
			Config    struct {
				Addr    string `json:"addr"`
				Inspect bool   `json:"inspect"`
			} `json:"config"`
		} `json:"tunnels"`
		URI string `json:"uri"`
	}
	getJSON(t, c, st.InspectURL+"/api/tunnels", 200, &list)
	if len(list.Tunnels) != 2 || list.URI != "/api/tunnels" {
		t.Fatalf("tunnels: %+v", list)
	}
	https, http1 := list.Tunnels[0], list.Tunnels[1]
	if https.Name != "command_line" || https.Proto != "https" || https.PublicURL != st.URLs[0] || https.Config.Addr != "http://"+b.Addr() || !https.Config.Inspect {
		t.Errorf("first tunnel: %+v (status URLs %v)", https, st.URLs)
	}
	if http1.Name != "command_line (http)" || http1.Proto != "http" || http1.PublicURL != st.URLs[1] {
		t.Errorf("second tunnel: %+v", http1)
	}
	var one struct {
		PublicURL string `json:"public_url"`
	}
	getJSON(t, c, st.InspectURL+http1.URI, 200, &one)
	if one.PublicURL != st.URLs[1] {
		t.Errorf("%s: %+v", http1.URI, one)
	}
	getJSON(t, c, st.InspectURL+"/api/tunnels/nope", 404, nil)
}

func getJSON(t *testing.T, c *http.Client, url string, status int, v any) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("GET %s: %d %s, want %d", url, resp.StatusCode, b, status)
	}
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("GET %s: %v: %s", url, err, b)
		}
	}
}

// TestAgentInspectorRange: with every port of its range taken the agent
// runs without an inspector; with a single address taken it stops with
// an error naming --inspect-addr.
func TestAgentInspectorRange(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	port, _ := strconv.Atoi(addr[strings.LastIndex(addr, ":")+1:])
	if port == 65535 {
		t.Skip("the taken port is the last one")
	}
	next, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+1))
	if err != nil {
		t.Skipf("the port after %s is not free: %v", addr, err)
	}
	defer next.Close()
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", b.Addr())
	cfg.InspectAddr, cfg.InspectPorts = addr, 1
	if st := tunneltest.StartAgent(t, cfg).WaitOnline(t); st.InspectURL != "" {
		t.Errorf("the whole range taken, yet inspector at %s", st.InspectURL)
	}
	cfg.InspectPorts = 0
	ta := tunneltest.StartAgent(t, cfg)
	<-ta.Done()
	if err := ta.Err(); err == nil || !strings.Contains(err.Error(), "inspect-addr") {
		t.Errorf("a single address taken: %v", err)
	}
}
