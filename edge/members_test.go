package edge_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// member is a local service of a pool's member that can be stopped and
// started again on its address: it answers every request with its name.
type member struct {
	t    *testing.T
	name string
	addr string

	mu  sync.Mutex
	srv *http.Server
}

func startMember(t *testing.T, name string) *member {
	m := &member{t: t, name: name, addr: "127.0.0.1:0"}
	m.start()
	t.Cleanup(m.stop)
	return m
}

func (m *member) start() {
	ln, err := net.Listen("tcp", m.addr)
	if err != nil {
		m.t.Fatalf("member %s: %v", m.name, err)
	}
	m.addr = ln.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/healthz" {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		io.WriteString(w, m.name)
	})}
	go srv.Serve(ln)
	m.mu.Lock()
	m.srv = srv
	m.mu.Unlock()
}

func (m *member) stop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.srv != nil {
		m.srv.Close()
		m.srv = nil
	}
}

// poolEdgeConfig is what `ngstone edge` runs: its registry in a file of
// --data-dir.
func poolEdgeConfig(t *testing.T) edge.Config {
	cfg := tunneltest.EdgeConfig(t)
	cfg.RegistryFile = filepath.Join(cfg.TLS.DataDir, "registry.db")
	return cfg
}

// poolAgent starts an agent of `ngstone http ADDR --subdomain NAME --pool`.
func poolAgent(t *testing.T, e *tunneltest.Edge, cfg agent.Config, name string) *tunneltest.Agent {
	cfg.Subdomain, cfg.Pool = name, true
	a := tunneltest.StartAgent(t, cfg)
	a.WaitOnline(t)
	return a
}

// visitPool sends n requests (POSTs of a small body when post) at
// concurrency conc and counts the answers by body; any other answer is
// an error.
func visitPool(t *testing.T, c *http.Client, name string, n, conc int, post bool) (map[string]int, []string) {
	t.Helper()
	var mu sync.Mutex
	counts, errs := map[string]int{}, []string(nil)
	jobs := make(chan struct{}, n)
	for range n {
		jobs <- struct{}{}
	}
	close(jobs)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for range jobs {
				var resp *http.Response
				var err error
				if post {
					resp, err = c.Post(tunneltest.URL("https", name, "/hook"), "text/plain", strings.NewReader("payload"))
				} else {
					resp, err = c.Get(tunneltest.URL("https", name, "/"))
				}
				mu.Lock()
				if err != nil {
					errs = append(errs, err.Error())
				} else {
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						errs = append(errs, fmt.Sprintf("%d %s: %s", resp.StatusCode, resp.Header.Get(mux.ErrorHeader), b))
					} else {
						counts[string(b)]++
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return counts, errs
}

// poolTunnel reads the pool of host from the edge's admin API.
func poolTunnel(t *testing.T, e *tunneltest.Edge, host string) edge.Tunnel {
	t.Helper()
	resp, err := http.Get("http://" + e.Addr("admin").String() + "/api/tunnels/" + host)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var tn edge.Tunnel
	if err := json.NewDecoder(resp.Body).Decode(&tn); err != nil {
		t.Fatal(err)
	}
	return tn
}

// Three agents behind one name share its visitors evenly; when one's local
// service stops, no request without a body fails (each is sent to another
// member), the member is taken out once its agent sees it, requests with a
// body then never reach it; it rejoins when its service is back.
func TestPoolSpreadsAndSurvivesAMember(t *testing.T) {
	e := tunneltest.StartEdge(t, poolEdgeConfig(t))
	var ms []*member
	for i := range 3 {
		m := startMember(t, fmt.Sprintf("m%d", i))
		ms = append(ms, m)
		poolAgent(t, e, e.AgentConfig("", m.addr), "team")
	}
	c := e.Client()
	host := "team." + tunneltest.Domain

	counts, errs := visitPool(t, c, "team", 3000, 8, false)
	if len(errs) > 0 {
		t.Fatalf("%d of 3000 requests failed, first: %s", len(errs), errs[0])
	}
	for _, m := range ms {
		if n := counts[m.name]; n < 850 || n > 1150 {
			t.Errorf("member %s served %d of 3000 requests, want 1000 ± 15%%: %v", m.name, n, counts)
		}
	}
	tn := poolTunnel(t, e, host)
	var given uint64
	for _, m := range tn.Members {
		given += m.Requests
	}
	if !tn.Pool || !tn.Online || len(tn.Members) != 3 || given != 3000 {
		t.Fatalf("admin API: %+v (requests %d), want an online pool of 3 given 3000", tn, given)
	}

	ms[0].stop()
	counts, errs = visitPool(t, c, "team", 300, 4, false)
	if len(errs) > 0 || counts["m0"] > 0 {
		t.Fatalf("with m0 stopped: %d of 300 GETs failed (first %v), m0 served %d", len(errs), errs, counts["m0"])
	}
	tunneltest.Eventually(t, 10*time.Second, "m0 to be out of the pool", func() bool {
		tn := poolTunnel(t, e, host)
		return len(tn.Members) == 3 && tn.Members[0].Down != ""
	})
	counts, errs = visitPool(t, c, "team", 100, 4, true)
	if len(errs) > 0 || counts["m0"] > 0 {
		t.Fatalf("with m0 out: %d of 100 POSTs failed (first %v), m0 served %d", len(errs), errs, counts["m0"])
	}

	ms[0].start()
	tunneltest.Eventually(t, 10*time.Second, "m0 to serve again", func() bool {
		counts, _ := visitPool(t, c, "team", 30, 3, false)
		return counts["m0"] > 0
	})
	if tn := poolTunnel(t, e, host); tn.Members[0].Down != "" {
		t.Fatalf("m0 serves, but the admin API says it is down: %+v", tn.Members[0])
	}
}

// When every member's local service is down, visitors are told why.
func TestPoolAllDown(t *testing.T) {
	e := tunneltest.StartEdge(t, poolEdgeConfig(t))
	m := startMember(t, "m0")
	cfg := e.AgentConfig("", m.addr)
	cfg.PoolHealthPath, cfg.PoolHealthInterval = "/healthz", 20*time.Millisecond
	a := poolAgent(t, e, cfg, "down")
	m.stop()
	a.WaitStatus(t, 5*time.Second, "the agent to see its service down", func(s agent.Status) bool {
		return len(s.Tunnels) == 1 && s.Tunnels[0].Down != ""
	})
	c := e.Client()
	tunneltest.Eventually(t, 5*time.Second, "503 tunnel_offline naming the cause", func() bool {
		resp, err := c.Get(tunneltest.URL("https", "down", "/"))
		if err != nil {
			return false
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get(mux.ErrorHeader) == mux.CodeTunnelOffline &&
			strings.Contains(string(b), "reports its local service down")
	})
	m.start()
	tunneltest.Eventually(t, 5*time.Second, "the member to serve again", func() bool {
		resp, err := c.Get(tunneltest.URL("https", "down", "/"))
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// Rule 3 holds for every bind without --pool, and a pool is joined only
// by --pool and its own token.
func TestPoolRuleThree(t *testing.T) {
	cfg := poolEdgeConfig(t)
	cfg.Tokens = []string{"alpha", "beta"}
	e := tunneltest.StartEdge(t, cfg)
	m := startMember(t, "m")
	with := func(token, name string, pool bool) agent.Config {
		c := e.AgentConfig("", m.addr)
		c.Token, c.Subdomain, c.Pool = token, name, pool
		return c
	}
	refused := func(cfg agent.Config, want string) {
		t.Helper()
		a := tunneltest.StartAgent(t, cfg)
		select {
		case <-a.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("bind %s (pool %v, token %s): the agent still runs, want it refused", cfg.Subdomain, cfg.Pool, cfg.Token)
		}
		err := a.Err()
		var re *agent.RefusedError
		if !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken || !strings.Contains(re.Message, want) {
			t.Fatalf("bind %s (pool %v, token %s): %v, want subdomain_taken saying %q", cfg.Subdomain, cfg.Pool, cfg.Token, err, want)
		}
	}
	tunneltest.StartAgent(t, with("alpha", "solo", false)).WaitOnline(t)
	refused(with("alpha", "solo", true), "not in a pool")
	refused(with("alpha", "solo", false), "in use by another agent")

	tunneltest.StartAgent(t, with("alpha", "team", true)).WaitOnline(t)
	tunneltest.StartAgent(t, with("alpha", "team", true)).WaitOnline(t)
	refused(with("alpha", "team", false), "pass --pool to join it")
	refused(with("beta", "team", true), "cannot join")
	if tn := poolTunnel(t, e, "team."+tunneltest.Domain); len(tn.Members) != 2 {
		t.Fatalf("refused binds changed the pool: %+v", tn)
	}
}

// A member cut off and back is replaced by its own instance (rule 1 on its
// member alone); the other members keep their generations throughout.
func TestPoolMemberPartitioned(t *testing.T) {
	e := tunneltest.StartEdge(t, func() edge.Config {
		cfg := tunneltest.EdgeConfigShortTimeouts(t)
		cfg.RegistryFile = filepath.Join(cfg.TLS.DataDir, "registry.db")
		return cfg
	}())
	p := tunneltest.StartFaultProxy(t, e.Addr("control").String())
	m0, m1 := startMember(t, "m0"), startMember(t, "m1")
	cut := poolAgent(t, e, e.AgentConfigShortTimeouts(p.Addr(), m0.addr), "part")
	kept := poolAgent(t, e, e.AgentConfigShortTimeouts("", m1.addr), "part")

	partitionMember(t, p, cut, kept, "m0", "m1", e.Client(), func() bool {
		// A request sent to the silent member before the edge sees it
		// dead (its heartbeat timeout) waits for it: the edge cannot tell.
		tn := poolTunnel(t, e, "part."+tunneltest.Domain)
		return len(tn.Members) == 2 && !tn.Members[0].Online
	})
	if tn := poolTunnel(t, e, "part."+tunneltest.Domain); len(tn.Members) != 2 {
		t.Fatalf("pool after the partition: %+v, want 2 members", tn)
	}
}

// partitionMember cuts cut's agent off at p until out says its edge sees
// it gone; meanwhile every request through c goes to keptName. Back, the
// cut agent takes its member again on a new session at a higher
// generation and serves visitors of c, while kept's session and
// generation never changed.
func partitionMember(t *testing.T, p *tunneltest.FaultProxy, cut, kept *tunneltest.Agent, cutName, keptName string, c *http.Client, out func() bool) {
	t.Helper()
	before, cutBefore := kept.Status(), cut.Status()
	p.Block()
	cut.WaitStatus(t, 5*time.Second, "the cut agent to notice", func(s agent.Status) bool { return s.State == agent.StateReconnecting })
	tunneltest.Eventually(t, 10*time.Second, "the edges to see "+cutName+"'s agent gone", out)
	counts, errs := visitPool(t, c, "part", 50, 2, false)
	if len(errs) > 0 || counts[keptName] != 50 {
		t.Fatalf("while %s's agent is cut off: %v %v, want all 50 from %s", cutName, counts, errs, keptName)
	}
	p.Unblock()
	back := cut.WaitStatus(t, 10*time.Second, "the cut agent back", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.SessionID != cutBefore.SessionID
	})
	if back.Tunnels[0].Generation <= cutBefore.Tunnels[0].Generation {
		t.Fatalf("the member came back at generation %d, not above %d", back.Tunnels[0].Generation, cutBefore.Tunnels[0].Generation)
	}
	tunneltest.Eventually(t, 10*time.Second, cutName+" to serve again", func() bool {
		counts, _ := visitPool(t, c, "part", 20, 2, false)
		return counts[cutName] > 0
	})
	now := kept.Status()
	if now.State != agent.StateOnline || now.SessionID != before.SessionID || now.Tunnels[0].Generation != before.Tunnels[0].Generation {
		t.Fatalf("the member that stayed changed: %+v, was %+v", now.Tunnels[0], before.Tunnels[0])
	}
}

// A pool needs an edge that keeps its members (one that runs alone) and a
// name of its own.
func TestPoolBindRefusals(t *testing.T) {
	e := tunneltest.StartEdge(t, poolEdgeConfig(t))
	r, _ := e.DialRaw(t, &mux.Hello{Version: mux.Version, InstanceID: agent.NewInstanceID()})
	for _, b := range []*mux.Bind{{Pool: true}, {Pool: true, Proto: mux.ProtoTLS}, {Pool: true, Proto: mux.ProtoTCP}} {
		be, ok := r.Bind(t, b).(*mux.BindError)
		if !ok || be.Code != mux.CodeBadRequest {
			t.Fatalf("bind %+v: %+v, want bad_request", b, be)
		}
	}
}

// nameServer is a TCP local service that writes its name and closes.
func nameServer(t *testing.T, name string) (addr string, stop func()) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, name)
			c.Close()
		}
	})
	var once sync.Once
	stop = func() { once.Do(func() { ln.Close(); wg.Wait() }) }
	t.Cleanup(stop)
	return ln.Addr().String(), stop
}

// A TCP port shared by two agents (`ngstone tcp ADDR --remote-port P
// --pool`): connections are spread over both, and once one's local
// service stops and its agent's check sees it, every connection goes to
// the other.
func TestPoolTCP(t *testing.T) {
	cfg := poolEdgeConfig(t)
	cfg.TCPPorts = tunneltest.FreePorts(t, 1)
	port := cfg.TCPPorts[0].Lo
	e := tunneltest.StartEdge(t, cfg)
	addr0, stop0 := nameServer(t, "t0")
	addr1, _ := nameServer(t, "t1")
	for _, addr := range []string{addr0, addr1} {
		c := e.TCPAgentConfig(addr, port)
		c.Pool, c.PoolHealthInterval = true, 20*time.Millisecond
		tunneltest.StartAgent(t, c).WaitOnline(t)
	}
	visit := func(n int) map[string]int {
		counts := map[string]int{}
		for range n {
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			b, _ := io.ReadAll(c)
			c.Close()
			counts[string(b)]++
		}
		return counts
	}
	if counts := visit(200); counts["t0"] < 60 || counts["t1"] < 60 {
		t.Fatalf("200 connections spread %v, want each member at least 60", counts)
	}
	stop0()
	tunneltest.Eventually(t, 5*time.Second, "t0 to be out of the pool", func() bool {
		list, err := e.Tunnels(context.Background())
		return err == nil && len(list) == 1 && len(list[0].Members) == 2 && list[0].Members[0].Down != ""
	})
	if counts := visit(50); counts["t1"] != 50 {
		t.Fatalf("with t0 out: %v, want all 50 from t1", counts)
	}
}
