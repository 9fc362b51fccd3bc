package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
)

// TestClusterProcesses runs two `ngstone edge` processes on one etcd, as
// the compose example does: an agent process on edge A is reached by a
// visitor on edge B; killed with SIGKILL, edge A leaves nothing behind once
// its lease expires, and edge B answers 404 for the name.
func TestClusterProcesses(t *testing.T) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "two edges") })
	endpoints := strings.Join(etcdtest.Endpoints(t), ",")
	prefix := etcdtest.Prefix(t)
	data := t.TempDir()
	key := strings.Repeat("k", 40)
	// One token for the whole cluster, limited to one agent.
	tokens := filepath.Join(data, "tokens.yaml")
	if err := os.WriteFile(tokens, []byte("tokens:\n  - token: team\n    max_sessions: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	type edgeProc struct {
		*proc
		ports []string // http, control, admin, cluster
	}
	start := func(name string) edgeProc {
		ports := freePorts(t, 4)
		p := startProc(t, nil, edgeArgs(data, ports,
			"--cluster-etcd", endpoints, "--cluster-prefix", prefix, "--node-name", name,
			"--cluster-addr", "127.0.0.1:"+ports[3], "--cluster-key", key, "--cluster-lease-ttl", "2s",
			"--tokens-file", tokens)...)
		waitHealthy(t, "127.0.0.1:"+ports[2])
		return edgeProc{p, ports}
	}
	a := start("a")
	b := start("b")
	ag := startProc(t, nil, "http", port, "--edge", "localhost:"+a.ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "demo", "--authtoken", "team")
	ag.waitLine(t, regexp.MustCompile(`^Forwarding http://demo\.ngstone\.test:`+a.ports[0]+` -> `))

	visitor := visitorClient(t, "127.0.0.1:"+b.ports[0])
	var code int
	var body string
	waitFor(t, 5*time.Second, "edge b to route demo to edge a", func() bool {
		code, body, _ = get(visitor, "http://demo.ngstone.test/")
		return code == http.StatusOK
	})
	if body != "two edges" {
		t.Fatalf("visitor on b got %q", body)
	}
	resp, err := http.Get("http://127.0.0.1:" + b.ports[2] + "/api/tunnels")
	if err != nil {
		t.Fatal(err)
	}
	var tunnels []struct {
		Hostname, Node string
		Online         bool
	}
	json.NewDecoder(resp.Body).Decode(&tunnels)
	resp.Body.Close()
	if len(tunnels) != 1 || tunnels[0].Hostname != "demo.ngstone.test" || tunnels[0].Node != "a" || !tunnels[0].Online {
		t.Fatalf("b's /api/tunnels = %+v; want demo on node a, online", tunnels)
	}
	// The token's one agent is on edge a: a second one is refused on b.
	second := startProc(t, nil, "http", port, "--edge", "localhost:"+b.ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "other", "--authtoken", "team")
	if code := second.exitCode(t); code != exitRefused || !strings.Contains(second.stderrText(), "limit_exceeded") {
		t.Fatalf("second agent of a one-agent token, on edge b: exit %d, stderr %q", code, second.stderrText())
	}

	a.cmd.Process.Kill()
	killed := time.Now()
	waitFor(t, 10*time.Second, "a's binding to expire with its lease", func() bool {
		code, _, _ = get(visitor, "http://demo.ngstone.test/")
		return code == http.StatusNotFound
	})
	t.Logf("404 on b %v after edge a was killed (lease TTL 2s)", time.Since(killed).Round(time.Millisecond))

	bad := startProc(t, nil, edgeArgs(data, freePorts(t, 3), "--cluster-etcd", endpoints, "--cluster-key", "short")...)
	if code := bad.exitCode(t); code != exitUsage || !strings.Contains(bad.stderrText(), "cluster-key") {
		t.Fatalf("short cluster key: exit %d, stderr %q", code, bad.stderrText())
	}
}

// TestClusterPoolProcesses: a pool across two `ngstone edge` processes,
// its agents `ngstone http PORT --subdomain team --pool`, two on edge A
// and one on edge B. Visitors of either edge are spread over all three;
// edge A killed with SIGKILL, visitors of B see no failure from its death
// on (a request sent to a member of the dead edge goes to another), and once
// A's lease expires B's member serves alone, its place kept throughout.
func TestClusterPoolProcesses(t *testing.T) {
	endpoints := strings.Join(etcdtest.Endpoints(t), ",")
	prefix := etcdtest.Prefix(t)
	data := t.TempDir()
	key := strings.Repeat("k", 40)
	tokens := filepath.Join(data, "tokens.yaml")
	if err := os.WriteFile(tokens, []byte("tokens:\n  - token: team\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start := func(name string) (*proc, []string) {
		ports := freePorts(t, 4) // http, control, admin, cluster
		p := startProc(t, nil, edgeArgs(data, ports,
			"--cluster-etcd", endpoints, "--cluster-prefix", prefix, "--node-name", name,
			"--cluster-addr", "127.0.0.1:"+ports[3], "--cluster-key", key, "--cluster-lease-ttl", "2s",
			"--tokens-file", tokens)...)
		waitHealthy(t, "127.0.0.1:"+ports[2])
		return p, ports
	}
	a, aPorts := start("a")
	_, bPorts := start("b")
	var servers []*backendSwitch
	for i, ports := range [][]string{aPorts, aPorts, bPorts} {
		s := newBackendSwitch(t, fmt.Sprintf("m%d", i))
		servers = append(servers, s)
		ag := startProc(t, nil, "http", s.port, "--edge", "localhost:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
			"--subdomain", "team", "--pool", "--authtoken", "team")
		ag.waitLine(t, regexp.MustCompile(`^Forwarding http://team\.ngstone\.test:`+ports[0]+` -> `))
	}
	visit := func(edge []string, n int) (map[string]int, []string) {
		c := visitorClient(t, "127.0.0.1:"+edge[0])
		counts, errs := map[string]int{}, []string(nil)
		for range n {
			code, body, err := get(c, "http://team.ngstone.test/")
			switch {
			case err != nil:
				errs = append(errs, err.Error())
			case code != http.StatusOK:
				errs = append(errs, fmt.Sprintf("%d %s", code, body))
			default:
				counts[body]++
			}
		}
		return counts, errs
	}
	waitFor(t, 10*time.Second, "edge b to route to every member", func() bool {
		counts, _ := visit(bPorts, 30)
		return len(counts) == 3
	})
	for _, edge := range [][]string{aPorts, bPorts} {
		counts, errs := visit(edge, 600)
		if len(errs) > 0 {
			t.Fatalf("%d of 600 failed, first %s", len(errs), errs[0])
		}
		for _, s := range servers {
			if n := counts[s.name]; n < 170 || n > 230 {
				t.Errorf("via edge port %s, %s served %d of 600, want 200 ± 15%%: %v", edge[0], s.name, n, counts)
			}
		}
	}

	a.cmd.Process.Kill()
	killed := time.Now()
	// A request edge a held as it died fails (tunnel_interrupted); from
	// its death on, none may.
	select {
	case <-a.exited:
	case <-time.After(10 * time.Second):
		t.Fatal("edge a did not exit on SIGKILL")
	}
	for time.Since(killed) < 4*time.Second { // twice the lease: before and after it expires
		counts, errs := visit(bPorts, 20)
		if len(errs) > 0 || counts["m2"] != 20 {
			t.Fatalf("via edge b %v after edge a was killed: %v, errors %v; want every request served by m2", time.Since(killed).Round(time.Millisecond), counts, errs)
		}
	}
	resp, err := http.Get("http://127.0.0.1:" + bPorts[2] + "/api/tunnels/team.ngstone.test")
	if err != nil {
		t.Fatal(err)
	}
	var tn struct {
		Pool    bool
		Members []struct {
			Node   string
			Online bool
		}
	}
	err = json.NewDecoder(resp.Body).Decode(&tn)
	resp.Body.Close()
	if err != nil || !tn.Pool || len(tn.Members) != 1 || tn.Members[0].Node != "b" || !tn.Members[0].Online {
		t.Fatalf("b's admin API after a's lease expired: %+v (%v), want b's member alone, online", tn, err)
	}
}
