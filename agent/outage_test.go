package agent_test

import (
	"context"
	"io"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestSilentPathReturns: the path to the edge goes silent for 3 s, as a
// load balancer whose backend stopped does (open connections and new ones
// complete their handshake and carry nothing, ever), then carries new
// connections again. The agent declares its session dead meanwhile and
// connects into the silence; once the path is back, its URL answers
// within a second (median of ten outages), through a new session of the
// same instance at a higher generation. The dial timeout is the default
// 10 s: a connect that waited on its silent connection would take it all.
func TestSilentPathReturns(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	p := tunneltest.StartFaultProxy(t, e.Addr("control").String())
	ac := e.AgentConfig(p.Addr(), b.Addr())
	ac.Subdomain = "silent"
	ac.HeartbeatInterval, ac.HeartbeatTimeout = 100*time.Millisecond, time.Second
	d := agent.DefaultConfig() // whatever AgentConfig shortens
	ac.DialTimeout, ac.BackoffBase, ac.BackoffCap = d.DialTimeout, d.BackoffBase, d.BackoffCap
	a := tunneltest.StartAgent(t, ac)
	before := a.WaitOnline(t)
	const outage, trials = 3 * time.Second, 10
	var took []time.Duration
	for i := range trials {
		p.Freeze()
		frozen := time.Now()
		a.WaitStatus(t, 10*time.Second, "the agent to reconnect", func(s agent.Status) bool { return s.State == agent.StateReconnecting })
		time.Sleep(time.Until(frozen.Add(outage))) // the outage itself, not a wait for a condition
		p.Thaw()
		back := time.Now()
		after := a.WaitStatus(t, 15*time.Second, "online on a new session", func(s agent.Status) bool {
			return s.State == agent.StateOnline && s.SessionID != before.SessionID
		})
		if code := get200(t, e.Client(), tunneltest.URL("https", "silent", "/hello")); code != http.StatusOK {
			t.Fatalf("trial %d: the URL answered %d once online again", i, code)
		}
		d := time.Since(back)
		took = append(took, d)
		if after.InstanceID != before.InstanceID || after.Generation <= before.Generation {
			t.Fatalf("trial %d: after: %+v; before: %+v", i, after, before)
		}
		tn := tunnel(t, e, "silent."+tunneltest.Domain)
		if tn.InstanceID != mux.InstanceDigest(a.InstanceID()) || tn.SessionID != after.SessionID || !tn.Online {
			t.Fatalf("trial %d: the edge's view %+v, want the agent's session %d", i, tn, after.SessionID)
		}
		if d > 3*time.Second {
			t.Fatalf("trial %d: the URL answered %v after the path returned, want within 1 s (3 s on a loaded machine)", i, d.Round(time.Millisecond))
		}
		before = after
	}
	sorted := slices.Sorted(slices.Values(took))
	t.Logf("the path's return to the URL's answer: median %v of %d trials, each %v", sorted[len(sorted)/2].Round(time.Millisecond), trials, roundAll(took))
}

// get200 GETs url once, within 10 s, and returns its status (0: no answer).
func get200(t *testing.T, c *http.Client, url string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Logf("GET %s: %v", url, err)
		return 0
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}
