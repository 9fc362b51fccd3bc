package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// adminTunnel is what an edge's /api/tunnels says of one tunnel.
type adminTunnel struct {
	Hostname   string `json:"hostname"`
	SessionID  uint64 `json:"session_id"`
	Node       string `json:"node"`
	Generation uint64 `json:"generation"`
	Online     bool   `json:"online"`
}

// tunnelAt reads the tunnel of host from the edge whose admin address is
// admin; ok is false when the edge does not answer or lists no such name.
func tunnelAt(admin, host string) (tn adminTunnel, ok bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+admin+"/api/tunnels", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return tn, false
	}
	defer resp.Body.Close()
	var ts []adminTunnel
	if json.NewDecoder(resp.Body).Decode(&ts) != nil {
		return tn, false
	}
	for _, tn := range ts {
		if tn.Hostname == host {
			return tn, true
		}
	}
	return tn, false
}

// answers reports whether a visitor GET of url through c, given 1 s, gets
// the backend's body.
func answers(c *http.Client, url, body string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	resp, err := c.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return err == nil && resp.StatusCode == http.StatusOK && string(b) == body
}

// firstAnswer sends a visitor GET of url through c every 50 ms, each given
// 3 s, until one gets body or a minute has passed, and returns when the
// first answer came: a request to a name whose route is stale or whose
// session is silent waits, and would otherwise hold up the next.
func firstAnswer(t *testing.T, c *http.Client, url, body string) time.Time {
	t.Helper()
	answered := make(chan time.Time, 1)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(time.Minute)
	for {
		wg.Go(func() {
			rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
			defer rcancel()
			req, _ := http.NewRequestWithContext(rctx, "GET", url, nil)
			resp, err := c.Do(req)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			if b, err := io.ReadAll(resp.Body); err == nil && resp.StatusCode == http.StatusOK && string(b) == body {
				select {
				case answered <- time.Now():
				default:
				}
			}
		})
		select {
		case at := <-answered:
			return at
		case <-deadline:
			t.Fatalf("no answer from %s within a minute", url)
		case <-tick.C:
		}
	}
}

// stopFor stops p (SIGSTOP) for d, the outage itself, and continues it;
// it returns when it was continued.
func stopFor(t *testing.T, p *proc, d time.Duration) time.Time {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(d) // the outage, not a wait for a condition
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	return time.Now()
}

// testEdgeStopped stops a real edge process for 5 s under a real agent
// process started with agentFlags, then checks that the URL answers within
// within of SIGCONT, and returns the tunnel before and after.
func testEdgeStopped(t *testing.T, within time.Duration, agentFlags ...string) (before, after adminTunnel) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "still here") })
	data := t.TempDir()
	ports := freePorts(t, 3)
	admin := "127.0.0.1:" + ports[2]
	e := startProc(t, nil, edgeArgs(data, ports)...)
	waitHealthy(t, admin)
	args := append([]string{"http", port, "--edge", "localhost:" + ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "demo"}, agentFlags...)
	ag := startProc(t, nil, args...)
	ag.waitLine(t, regexp.MustCompile(`^Forwarding http://demo\.ngstone\.test:`+ports[0]+` -> `))
	visitor := visitorClient(t, "127.0.0.1:"+ports[0])
	const url, host = "http://demo.ngstone.test/", "demo.ngstone.test"
	waitFor(t, 10*time.Second, "the URL to answer", func() bool { return answers(visitor, url, "still here") })
	before, _ = tunnelAt(admin, host)

	cont := stopFor(t, e, 5*time.Second)
	took := firstAnswer(t, visitor, url, "still here").Sub(cont)
	after, _ = tunnelAt(admin, host)
	t.Logf("the URL answered %v after SIGCONT; session %d generation %d before, %d and %d after",
		took.Round(time.Millisecond), before.SessionID, before.Generation, after.SessionID, after.Generation)
	if took > within {
		t.Fatalf("the URL answered %v after SIGCONT, want within %v", took.Round(time.Millisecond), within)
	}
	return before, after
}

// TestOutageEdgeStopped: an `ngstone edge` process is stopped for 5 s
// under an `ngstone http` agent on its defaults (heartbeat 15 s, given up
// after 45 s): the agent keeps its session, which carries the URL again
// at once after SIGCONT.
func TestOutageEdgeStopped(t *testing.T) {
	before, after := testEdgeStopped(t, 3*time.Second)
	if after.SessionID != before.SessionID || after.Generation != before.Generation || !after.Online {
		t.Fatalf("after SIGCONT: %+v; before: %+v; want the same session", after, before)
	}
}

// TestOutageEdgeStoppedHeartbeatTimeout2s: the same with the agent's
// heartbeat timeout (2 s, heartbeats every 500 ms) under the outage, so
// that it connects into the stopped edge, whose kernel completes each
// attempt's TCP handshake and then holds it unanswered. After SIGCONT the
// URL answers within a second (3 s allowed on a loaded machine), on a new
// session of the same instance: one attempt bound, the others closed.
func TestOutageEdgeStoppedHeartbeatTimeout2s(t *testing.T) {
	before, after := testEdgeStopped(t, 3*time.Second, "--heartbeat-interval", "500ms", "--heartbeat-timeout", "2s")
	if after.SessionID == before.SessionID || after.Generation <= before.Generation || !after.Online {
		t.Fatalf("after SIGCONT: %+v; before: %+v; want a new session at a higher generation", after, before)
	}
}

// TestOutageClusterEdgeStoppedHeartbeatTimeout2s: two `ngstone edge`
// processes on one etcd behind a round-robin TCP load balancer, the one
// address the agent's --edge names (--edge is one HOST:PORT: the agent
// reaches another edge only through what that address leads to). The edge
// holding the agent's session is stopped (SIGSTOP); its kernel still
// completes the TCP handshake of the connections the balancer sends it,
// every other one, the agent's first reconnect among them.
// The agent, on a heartbeat timeout of 2 s, serves through the other edge
// within that timeout and a second of the stop (3 s more allowed on a
// loaded machine), at a higher generation.
func TestOutageClusterEdgeStoppedHeartbeatTimeout2s(t *testing.T) {
	const hbTimeout = 2 * time.Second
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "either edge") })
	endpoints := strings.Join(etcdtest.Endpoints(t), ",")
	prefix := etcdtest.Prefix(t)
	data := t.TempDir()
	key := strings.Repeat("k", 40)
	type edgeProc struct {
		*proc
		name  string
		ports []string // http, control, admin, cluster
	}
	start := func(name string) edgeProc {
		ports := freePorts(t, 4)
		p := startProc(t, nil, edgeArgs(data, ports,
			"--cluster-etcd", endpoints, "--cluster-prefix", prefix, "--node-name", name,
			"--cluster-addr", "127.0.0.1:"+ports[3], "--cluster-key", key)...)
		waitHealthy(t, "127.0.0.1:"+ports[2])
		return edgeProc{p, name, ports}
	}
	edges := map[string]edgeProc{"a": start("a"), "b": start("b")}
	lb := tunneltest.StartFaultProxy(t, "127.0.0.1:"+edges["a"].ports[1])
	lb.SetTargets("127.0.0.1:"+edges["a"].ports[1], "127.0.0.1:"+edges["b"].ports[1])
	_, lbPort, _ := strings.Cut(lb.Addr(), ":")
	startProc(t, nil, "http", port, "--edge", "localhost:"+lbPort, "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "demo",
		"--heartbeat-interval", "200ms", "--heartbeat-timeout", hbTimeout.String())
	const url, host = "http://demo.ngstone.test/", "demo.ngstone.test"
	var before adminTunnel
	waitFor(t, 20*time.Second, "the agent to be online", func() bool {
		var ok bool
		before, ok = tunnelAt("127.0.0.1:"+edges["a"].ports[2], host)
		return ok && before.Online
	})
	holder, other := edges[before.Node], edges["a"]
	if before.Node == "a" {
		other = edges["b"]
	}
	visitor := visitorClient(t, "127.0.0.1:"+other.ports[0])
	waitFor(t, 10*time.Second, "the URL to answer through the other edge", func() bool { return answers(visitor, url, "either edge") })
	// The balancer's next connection goes to the stopped edge, as half of
	// the reconnects behind a round-robin balancer do.
	lb.SetTargets("127.0.0.1:"+holder.ports[1], "127.0.0.1:"+other.ports[1])

	if err := holder.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	t.Cleanup(func() { holder.cmd.Process.Signal(syscall.SIGCONT) })
	took := firstAnswer(t, visitor, url, "either edge").Sub(stopped)
	after, _ := tunnelAt("127.0.0.1:"+other.ports[2], host)
	t.Logf("served through edge %s %v after edge %s was stopped (agent heartbeat timeout %v)", after.Node, took.Round(time.Millisecond), before.Node, hbTimeout)
	if after.Node != other.name || after.Generation <= before.Generation || !after.Online {
		t.Fatalf("after: %+v; before: %+v", after, before)
	}
	if took > hbTimeout+4*time.Second {
		t.Fatalf("served through the other edge %v after the stop, want within %v", took.Round(time.Millisecond), hbTimeout+time.Second)
	}
}
