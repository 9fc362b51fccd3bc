package agent_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// named starts a local service answering name and returns a tunnel to it
// asking for subdomain name.
func named(t *testing.T, base agent.Tunnel, name string) agent.Tunnel {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, name+" "+r.Host)
	}))
	t.Cleanup(srv.Close)
	base.Name, base.Subdomain, base.Local = name, name, srv.URL
	return base
}

func body(t *testing.T, c *http.Client, url string) (int, string) {
	t.Helper()
	resp, b := get(t, c, url)
	return resp.StatusCode, b
}

// TestSeveralTunnels: one agent, three tunnels on one session and one
// instance; each hostname's requests reach its own local service. A name
// another agent holds is refused alone (the others serve, the agent keeps
// running); after the link is cut every name comes back on one new
// session with a higher generation; a stop releases them all.
func TestSeveralTunnels(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	proxy := tunneltest.StartFaultProxy(t, e.Addr("control").String())

	// Another agent holds "taken" first.
	other := e.AgentConfig("", tunneltest.StartBackend(t).Addr())
	other.Subdomain = "taken"
	tunneltest.StartAgent(t, other).WaitOnline(t)

	cfg := e.AgentConfig(proxy.Addr(), "")
	base := cfg.Tunnel
	cfg.Tunnel = agent.Tunnel{}
	cfg.Tunnels = []agent.Tunnel{named(t, base, "web"), named(t, base, "shop"), named(t, base, "taken"), named(t, base, "docs")}
	a := tunneltest.StartAgent(t, cfg)
	st := a.WaitStatus(t, 10*time.Second, "three tunnels online, one refused", func(s agent.Status) bool {
		n := 0
		for _, ts := range s.Tunnels {
			if ts.State == agent.TunnelOnline {
				n++
			}
		}
		return s.State == agent.StateOnline && n == 3
	})
	for _, ts := range st.Tunnels {
		var re *agent.RefusedError
		if ts.Name == "taken" && (ts.State != agent.TunnelRefused || !errors.As(ts.Err, &re) || re.Code != "subdomain_taken") {
			t.Errorf("the tunnel whose name another agent holds: %+v", ts)
		}
	}
	if eps := st.Endpoints(); len(eps) != 6 { // https and http for each of three
		t.Errorf("endpoints: %+v, want the three online tunnels' six URLs", eps)
	}
	c := e.Client()
	for _, name := range []string{"web", "shop", "docs"} {
		if code, got := body(t, c, tunneltest.URL("https", name, "/")); code != 200 || got != name+" "+name+"."+tunneltest.Domain {
			t.Errorf("%s: %d %q, want its own service", name, code, got)
		}
	}
	bound := map[string]uint64{}
	ts, _ := e.Tunnels(context.Background())
	for _, b := range ts {
		if b.InstanceID == st.InstanceID {
			if b.SessionID != st.SessionID {
				t.Errorf("%s on session %d, the agent's is %d", b.Hostname, b.SessionID, st.SessionID)
			}
			bound[b.Hostname] = b.Generation
		}
	}
	if len(bound) != 3 {
		t.Fatalf("the edge holds %v for the agent's instance, want three names", bound)
	}

	// The link drops; every name comes back on one new session.
	proxy.Reset()
	a.WaitStatus(t, 15*time.Second, "back on a new session", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.SessionID != st.SessionID
	})
	tunneltest.Eventually(t, 10*time.Second, "every name on the one new session, a generation higher", func() bool {
		now := a.Status()
		ts, _ := e.Tunnels(context.Background())
		n := 0
		for _, b := range ts {
			if b.InstanceID == st.InstanceID && b.SessionID == now.SessionID && b.Generation > bound[b.Hostname] {
				n++
			}
		}
		return n == 3
	})
	for _, name := range []string{"web", "shop", "docs"} {
		if code, got := body(t, c, tunneltest.URL("https", name, "/")); code != 200 || got != name+" "+name+"."+tunneltest.Domain {
			t.Errorf("%s after the reconnect: %d %q", name, code, got)
		}
	}

	if err := a.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	ts, _ = e.Tunnels(context.Background())
	for _, b := range ts {
		if b.InstanceID == st.InstanceID {
			t.Errorf("%s still bound after the stop", b.Hostname)
		}
	}
}

// TestSeveralTunnelsAllRefused: an agent none of whose names the edge
// gives ends with the refusal, as one tunnel's does.
func TestSeveralTunnelsAllRefused(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", "")
	base := cfg.Tunnel
	for _, name := range []string{"one", "two"} {
		o := e.AgentConfig("", tunneltest.StartBackend(t).Addr())
		o.Subdomain = name
		tunneltest.StartAgent(t, o).WaitOnline(t)
	}
	cfg.Tunnel = agent.Tunnel{}
	cfg.Tunnels = []agent.Tunnel{named(t, base, "one"), named(t, base, "two")}
	a := tunneltest.StartAgent(t, cfg)
	select {
	case <-a.Done():
	case <-time.After(15 * time.Second):
		t.Fatalf("an agent with no name left still runs: %+v", a.Status())
	}
	var re *agent.RefusedError
	if err := a.Err(); !errors.As(err, &re) || re.Code != "subdomain_taken" {
		t.Fatalf("Run: %v, want subdomain_taken", err)
	}
}

// TestSeveralTunnelsValidate: tunnels that cannot all be served by one
// agent are refused before it starts.
func TestSeveralTunnelsValidate(t *testing.T) {
	base := agent.DefaultConfig()
	base.Edge = "localhost:1"
	for name, ts := range map[string][]agent.Tunnel{
		"no name":            {{Local: "1"}, {Name: "b", Local: "2"}},
		"same name":          {{Name: "a", Local: "1"}, {Name: "a", Local: "2"}},
		"same subdomain":     {{Name: "a", Local: "1", Subdomain: "x"}, {Name: "b", Local: "2", Subdomain: "x"}},
		"same hostname":      {{Name: "a", Local: "1", Hostname: "a.example.org"}, {Name: "b", Local: "2", Hostname: "A.example.org"}},
		"a bad local":        {{Name: "a", Local: "1"}, {Name: "b", Local: "ftp://x"}},
		"too many (65 > 64)": func() []agent.Tunnel { var ts []agent.Tunnel; return append(ts, make([]agent.Tunnel, 65)...) }(),
	} {
		cfg := base
		cfg.Tunnels = ts
		if err := cfg.Validate(); err == nil {
			t.Errorf("%s: valid", name)
		}
	}
}
