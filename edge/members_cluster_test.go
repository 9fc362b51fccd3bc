package edge_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// clusterPool starts the members' local services and an agent of each on
// the edge at the same index, `ngstone http ADDR --subdomain NAME --pool`,
// with the cluster edges' short heartbeats.
func clusterPool(t *testing.T, on []*clusterEdge, name string) []*member {
	var ms []*member
	for i, e := range on {
		m := startMember(t, fmt.Sprintf("m%d", i))
		ms = append(ms, m)
		poolAgent(t, e.Edge, e.AgentConfigShortTimeouts("", m.addr), name)
	}
	return ms
}

// waitPool waits until every edge's registry shows n members of host.
func waitPool(t *testing.T, host string, n int, edges ...*clusterEdge) {
	t.Helper()
	tunneltest.Eventually(t, 10*time.Second, fmt.Sprintf("every edge to see %d members", n), func() bool {
		for _, e := range edges {
			if b, ok := e.store.Lookup(host); !ok || len(b.Owners()) != n {
				return false
			}
		}
		return true
	})
}

// Three agents behind one name on two edges of a cluster share its
// visitors evenly, whichever edge they come to; when one's local service
// stops, no request without a body fails, the member is out on both
// edges once its agent sees it (its edge records that in the registry),
// requests with a body then never reach it, and it rejoins when back.
// The admin API of either edge shows every member, with its own edge's
// count and health.
func TestPoolAcrossEdges(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	ms := clusterPool(t, []*clusterEdge{a, a, b}, "team")
	host := "team." + tunneltest.Domain
	waitPool(t, host, 3, a, b)

	total := map[string]int{}
	for _, e := range []*clusterEdge{a, b} {
		counts, errs := visitPool(t, e.Client(), "team", 1500, 8, false)
		if len(errs) > 0 {
			t.Fatalf("%d of 1500 requests via %s failed, first: %s", len(errs), e.store.Node(), errs[0])
		}
		for k, n := range counts {
			total[k] += n
		}
	}
	for _, m := range ms {
		if n := total[m.name]; n < 850 || n > 1150 {
			t.Errorf("member %s served %d of 3000 requests, want 1000 ± 15%%: %v", m.name, n, total)
		}
	}
	for _, e := range []*clusterEdge{a, b} {
		tn := poolTunnel(t, e.Edge, host)
		var given uint64
		for _, m := range tn.Members {
			given += m.Requests
		}
		if !tn.Pool || !tn.Online || len(tn.Members) != 3 || given != 3000 {
			t.Fatalf("admin API of %s: %+v (requests %d), want an online pool of 3 given 3000", e.store.Node(), tn, given)
		}
	}

	// m2's service, behind edge b, stops: visitors of edge a find out.
	ms[2].stop()
	for _, e := range []*clusterEdge{a, b} {
		counts, errs := visitPool(t, e.Client(), "team", 150, 4, false)
		if len(errs) > 0 || counts["m2"] > 0 {
			t.Fatalf("with m2 stopped, via %s: %d of 150 GETs failed (first %v), m2 served %d", e.store.Node(), len(errs), errs, counts["m2"])
		}
	}
	tunneltest.Eventually(t, 10*time.Second, "edge a to see m2 down", func() bool {
		tn := poolTunnel(t, a.Edge, host)
		return len(tn.Members) == 3 && tn.Members[2].Down != ""
	})
	counts, errs := visitPool(t, a.Client(), "team", 100, 4, true)
	if len(errs) > 0 || counts["m2"] > 0 {
		t.Fatalf("with m2 out: %d of 100 POSTs via a failed (first %v), m2 served %d", len(errs), errs, counts["m2"])
	}
	ms[2].start()
	tunneltest.Eventually(t, 15*time.Second, "m2 to serve visitors of edge a again", func() bool {
		counts, _ := visitPool(t, a.Client(), "team", 30, 3, false)
		return counts["m2"] > 0
	})
}

// Rule 3 holds across the edges: a bind without --pool, or of another
// token, is refused on any edge while a member lives on another.
func TestPoolAcrossEdgesRuleThree(t *testing.T) {
	c := newTestCluster(t)
	tokens := func(cfg *edge.Config) { cfg.Tokens = []string{"alpha", "beta"} }
	a, b := c.start("a", nil, tokens), c.start("b", nil, tokens)
	m := startMember(t, "m")
	with := func(e *clusterEdge, token string, pool bool) agent.Config {
		cfg := e.AgentConfigShortTimeouts("", m.addr)
		cfg.Token, cfg.Subdomain, cfg.Pool = token, "team", pool
		return cfg
	}
	tunneltest.StartAgent(t, with(a, "alpha", true)).WaitOnline(t)
	refused := func(cfg agent.Config, want string) {
		t.Helper()
		ag := tunneltest.StartAgent(t, cfg)
		select {
		case <-ag.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("bind (pool %v, token %s): the agent still runs, want it refused", cfg.Pool, cfg.Token)
		}
		var re *agent.RefusedError
		if err := ag.Err(); !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken || !strings.Contains(re.Message, want) {
			t.Fatalf("bind (pool %v, token %s): %v, want subdomain_taken saying %q", cfg.Pool, cfg.Token, err, want)
		}
	}
	refused(with(b, "alpha", false), "pass --pool to join it")
	refused(with(b, "beta", true), "cannot join")
	tunneltest.StartAgent(t, with(b, "alpha", true)).WaitOnline(t)
	waitPool(t, "team."+tunneltest.Domain, 2, a, b)
}

// A member behind edge b cut off and back is replaced by its own instance
// (rule 1 on its member alone); the member behind edge a keeps its
// session and generation throughout, and visitors of edge a are served
// by it meanwhile.
func TestPoolAcrossEdgesPartitioned(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	p := controlProxy(t, b)
	m0, m1 := startMember(t, "m0"), startMember(t, "m1")
	kept := poolAgent(t, a.Edge, a.AgentConfigShortTimeouts("", m0.addr), "part")
	cut := poolAgent(t, b.Edge, b.AgentConfigShortTimeouts(p.Addr(), m1.addr), "part")
	host := "part." + tunneltest.Domain
	waitPool(t, host, 2, a, b)
	partitionMember(t, p, cut, kept, "m1", "m0", a.Client(), func() bool {
		for _, e := range []*clusterEdge{a, b} {
			if b, ok := e.store.Lookup(host); !ok || len(b.Owners()) != 1 {
				return false
			}
		}
		return true
	})
	waitPool(t, host, 2, a, b)
}

// A TCP port's pool across the edges: members on edge a and on edge b,
// the visitors of either edge reach both; the port's reservation holds
// for the token while any member is bound, and the name is released when
// the last leaves.
func TestPoolTCPAcrossEdges(t *testing.T) {
	var port int
	_, a, b, _ := startTCPCluster(t, 1, func(cfg *edge.Config) { port = cfg.TCPPorts[0].Lo })
	addrs := map[string]string{}
	for _, n := range []string{"t0", "t1"} {
		addrs[n], _ = nameServer(t, n)
	}
	var agents []*tunneltest.Agent
	for i, e := range []*clusterEdge{a, b} {
		cfg := e.AgentConfigShortTimeouts("", addrs[fmt.Sprintf("t%d", i)])
		cfg.Proto, cfg.Token, cfg.Pool, cfg.RemotePort = agent.ProtoTCP, "token-a", true, port
		ag := tunneltest.StartAgent(t, cfg)
		ag.WaitOnline(t)
		agents = append(agents, ag)
	}
	waitPool(t, mux.TCPKey(port), 2, a, b)
	for _, e := range []*clusterEdge{a, b} {
		host, _, _ := net.SplitHostPort(e.Addr("http").String())
		counts := map[string]int{}
		for range 100 {
			c, err := net.DialTimeout("tcp", net.JoinHostPort(host, fmt.Sprint(port)), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			got, _ := io.ReadAll(c)
			c.Close()
			counts[string(got)]++
		}
		if counts["t0"] < 25 || counts["t1"] < 25 {
			t.Fatalf("100 connections via %s spread %v, want each member at least 25", e.store.Node(), counts)
		}
	}
	// Another token cannot take the port from the pool on either edge.
	for _, e := range []*clusterEdge{a, b} {
		cfg := e.AgentConfigShortTimeouts("", addrs["t0"])
		cfg.Proto, cfg.Token, cfg.Pool, cfg.RemotePort = agent.ProtoTCP, "token-b", true, port
		ag := tunneltest.StartAgent(t, cfg)
		select {
		case <-ag.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("token-b's pool bind of port %d via %s still runs, want it refused", port, e.store.Node())
		}
		var re *agent.RefusedError
		if !errors.As(ag.Err(), &re) || re.Code != mux.CodeSubdomainTaken {
			t.Fatalf("token-b's pool bind of port %d via %s: %v, want subdomain_taken", port, e.store.Node(), ag.Err())
		}
	}
	for _, ag := range agents {
		ag.Stop()
	}
	tunneltest.Eventually(t, 10*time.Second, "the port to be released", func() bool {
		_, ok, err := a.store.Get(t.Context(), mux.TCPKey(port))
		return err == nil && !ok
	})
	if r, ok, err := a.store.Reservation(t.Context(), mux.TCPKey(port)); err != nil || !ok || r.TokenID == "" || r.Until.IsZero() {
		t.Fatalf("the port's reservation after its last member left: %+v %v %v, want token-a's, running", r, ok, err)
	}
}
