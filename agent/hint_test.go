package agent_test

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/conntest"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestHints: each way of pointing an agent at an edge wrongly gets, at the
// first retry, a hint naming what to do, while the agent keeps retrying;
// and a transient failure (an edge that was there and went) gets none but
// the question whether it runs.
func TestHints(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	otherCA := filepath.Join(t.TempDir(), "other-ca.pem")
	other := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t)) // another edge, another CA
	pem, err := os.ReadFile(other.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(otherCA, pem, 0o600); err != nil {
		t.Fatal(err)
	}
	closed := conntest.DeadAddr(t)
	for _, tc := range []struct {
		name string
		set  func(*agent.Config)
		want []string
	}{
		{"untrusted certificate, no --ca-file", func(c *agent.Config) { c.RootCAs = x509.NewCertPool() },
			[]string{"--ca-file", "ca.pem in its --data-dir", "--insecure"}},
		{"untrusted certificate, wrong --ca-file", func(c *agent.Config) { c.RootCAs, c.CAFile = nil, otherCA },
			[]string{"not signed by the CA in --ca-file " + otherCA, "ca.pem in its --data-dir"}},
		{"name mismatch", func(c *agent.Config) { c.ServerName = "tunnels.wrong.example" },
			[]string{"--server-name " + tunneltest.Domain, "not tunnels.wrong.example"}},
		{"nothing listening", func(c *agent.Config) { c.Edge = closed },
			[]string{"is the edge running at " + closed + "?"}},
		{"DNS failure", func(c *agent.Config) { c.Edge = "no-such-edge.invalid:4443" },
			[]string{"the name no-such-edge.invalid did not resolve", "--edge"}},
		{"not TLS", func(c *agent.Config) { c.Edge = e.Addr("http").String() },
			[]string{"not with TLS", "--control-addr"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.AgentConfig("", b.Addr())
			tc.set(&cfg)
			a := tunneltest.StartAgent(t, cfg)
			st := a.WaitStatus(t, 10*time.Second, "the first retry", func(s agent.Status) bool {
				return s.State == agent.StateReconnecting
			})
			if st.Attempt != 1 {
				t.Fatalf("first retry is attempt %d", st.Attempt)
			}
			for _, w := range tc.want {
				if !strings.Contains(st.Hint, w) {
					t.Errorf("hint %q lacks %q (error %v)", st.Hint, w, st.Err)
				}
			}
			// Still retrying, with the same hint.
			st = a.WaitStatus(t, 10*time.Second, "the second retry", func(s agent.Status) bool { return s.Attempt >= 2 })
			if st.State != agent.StateReconnecting || !strings.Contains(st.Hint, tc.want[0]) {
				t.Errorf("second retry: %s, hint %q", st.State, st.Hint)
			}
		})
	}

	// Online: no hint. The edge goes away: the question whether it runs.
	e2 := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	a := tunneltest.StartAgent(t, e2.AgentConfig("", b.Addr()))
	if st := a.WaitOnline(t); st.Hint != "" || st.Err != nil {
		t.Fatalf("online with hint %q, err %v", st.Hint, st.Err)
	}
	e2.Close()
	st := a.WaitStatus(t, 10*time.Second, "a hint after the edge went", func(s agent.Status) bool { return s.Hint != "" })
	if !strings.Contains(st.Hint, "is the edge running at "+e2.Addr("control").String()) {
		t.Errorf("hint after the edge stopped: %q", st.Hint)
	}
}

// TestLatency: the status's latency is the round trip of the heartbeats:
// it grows with a path that delays every byte, and falls back when the
// path is quick again, also while the round trip is longer than the
// heartbeat interval.
func TestLatency(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	p := tunneltest.StartFaultProxy(t, e.Addr("control").String())
	cfg := e.AgentConfigShortTimeouts(p.Addr(), b.Addr())
	cfg.HeartbeatTimeout = 5 * time.Second
	a := tunneltest.StartAgent(t, cfg)
	if st := a.WaitOnline(t); st.Latency <= 0 {
		t.Fatalf("online with no latency measured (the hello's): %+v", st)
	}
	p.DelayExisting(150 * time.Millisecond) // each way: 300 ms, six heartbeat intervals
	tunneltest.Eventually(t, 10*time.Second, "a latency of the delayed path", func() bool {
		return a.Status().Latency >= 300*time.Millisecond
	})
	p.DelayExisting(0)
	tunneltest.Eventually(t, 10*time.Second, "a latency of the quick path", func() bool {
		return a.Status().Latency < 100*time.Millisecond
	})
	if a.Status().State != agent.StateOnline {
		t.Fatalf("the delays cost the session: %+v", a.Status())
	}
}
