package edge_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

const clusterKey = "0123456789abcdef0123456789abcdef-test"

// testCluster is several edges on one etcd, sharing one self-signed CA so
// that one agent configuration trusts them all.
type testCluster struct {
	t       testing.TB
	prefix  string
	dataDir string
}

func newTestCluster(t testing.TB) *testCluster {
	return &testCluster{t: t, prefix: etcdtest.Prefix(t), dataDir: t.TempDir()}
}

type clusterEdge struct {
	*tunneltest.Edge
	store *registry.Etcd
}

// start runs edge name; endpoints are its etcd's (nil: the shared one's).
func (c *testCluster) start(name string, endpoints []string, tune func(*edge.Config)) *clusterEdge {
	c.t.Helper()
	return c.startWith(name, endpoints, nil, tune)
}

// startWith is start with the edge's registry settings changed by etcd.
func (c *testCluster) startWith(name string, endpoints []string, etcd func(*registry.EtcdConfig), tune func(*edge.Config)) *clusterEdge {
	t := c.t
	t.Helper()
	if endpoints == nil {
		endpoints = etcdtest.Endpoints(t)
	}
	// A 6 s lease, as tunneltest.UseStore's: a node gives its lease up
	// after two thirds of it without an answered renewal, which a 2 s
	// lease met on a loaded machine under -race. The tests of a lost
	// lease shorten it themselves.
	ec := registry.EtcdConfig{Endpoints: endpoints, Prefix: c.prefix, Node: name,
		LeaseTTL: 6 * time.Second, RetryInterval: 50 * time.Millisecond, CallTimeout: time.Second, RouteStaleness: time.Second,
		Log: tunneltest.Logger().With("side", name)}
	if etcd != nil {
		etcd(&ec)
	}
	store := registry.NewEtcd(ec)
	cfg := tunneltest.EdgeConfigShortTimeouts(t)
	cfg.TLS.DataDir = c.dataDir
	cfg.Cluster = &edge.ClusterConfig{Store: store, Addr: "127.0.0.1:0", Key: clusterKey}
	if tune != nil {
		tune(&cfg)
	}
	return &clusterEdge{Edge: tunneltest.StartEdge(t, cfg), store: store}
}

// etcdProxy returns a client of the shared etcd through a fault proxy.
func etcdProxy(t *testing.T) ([]string, *tunneltest.FaultProxy) {
	t.Helper()
	p := tunneltest.StartFaultProxy(t, strings.TrimPrefix(etcdtest.Endpoints(t)[0], "http://"))
	return []string{"http://" + p.Addr()}, p
}

func controlProxy(t *testing.T, e *clusterEdge) *tunneltest.FaultProxy {
	return tunneltest.StartFaultProxy(t, e.Addr("control").String())
}

func startClusterAgent(t testing.TB, e *clusterEdge, edgeAddr, local, sub, instance string) *tunneltest.Agent {
	t.Helper()
	ac := e.AgentConfigShortTimeouts(edgeAddr, local)
	ac.Subdomain, ac.InstanceID = sub, instance
	return tunneltest.StartAgent(t, ac)
}

// fetch GETs url through e and returns status and body.
func fetch(t *testing.T, e *clusterEdge, url string) (int, string) {
	t.Helper()
	resp, err := e.Client().Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func mustFetch(t *testing.T, e *clusterEdge, url, want string) {
	t.Helper()
	if code, body := fetch(t, e, url); code != http.StatusOK || body != want {
		t.Fatalf("GET %s via %s = %d %q, want 200 %q", url, e.store.Node(), code, body, want)
	}
}

const (
	instX = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	instY = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

// TestClusterForwarding: an agent on edge A, visitors on edge B get its
// responses over HTTP and HTTPS, bodies stream through, and the forwarded
// request carries the visitor's address, not edge B's claims about it.
func TestClusterForwarding(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(t)
	ag := startClusterAgent(t, a, "", backend.Addr(), "app", instX)
	st := ag.WaitOnline(t)
	tunneltest.Eventually(t, 5*time.Second, "b to learn the route", func() bool {
		r, ok := b.store.Lookup("app." + tunneltest.Domain)
		return ok && r.Generation == st.Generation
	})
	mustFetch(t, b, tunneltest.URL("http", "app", "/hello"), "hello")
	mustFetch(t, b, tunneltest.URL("https", "app", "/hello"), "hello")
	mustFetch(t, a, tunneltest.URL("https", "app", "/hello"), "hello")

	payload := strings.Repeat("ngstone ", 1<<17) // 1 MiB
	resp, err := b.Client().Post(tunneltest.URL("https", "app", "/echo"), "text/plain", strings.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(got) != payload {
		t.Fatalf("echo through b: %d, %d bytes back of %d", resp.StatusCode, len(got), len(payload))
	}

	req, _ := http.NewRequest("GET", tunneltest.URL("http", "app", "/headers"), nil)
	req.Header.Set("X-Forwarded-For", "203.0.113.9")
	req.Header.Set("Ngstone-Generation", "1")
	resp, err = b.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var seen struct {
		Host   string
		Header http.Header
	}
	json.NewDecoder(resp.Body).Decode(&seen)
	resp.Body.Close()
	if xff := seen.Header.Get("X-Forwarded-For"); xff != "127.0.0.1" {
		t.Fatalf("the local service saw X-Forwarded-For %q, want the visitor's 127.0.0.1", xff)
	}
	if seen.Header.Get("Ngstone-Generation") != "" || seen.Header.Get("Ngstone-Forwarded-By") != "" {
		t.Fatalf("cluster headers reached the local service: %v", seen.Header)
	}
	if seen.Host != "app."+tunneltest.Domain {
		t.Fatalf("the local service saw Host %q", seen.Host)
	}
	m := scrape(t, b.Edge, "")
	if m["ngstone_cluster_forwarded_total"] < 4 || m["ngstone_cluster_stale_routes_total"] != 0 || m["ngstone_cluster_lease_ok"] != 1 {
		t.Fatalf("b's cluster metrics: forwarded %v, stale %v, lease %v",
			m["ngstone_cluster_forwarded_total"], m["ngstone_cluster_stale_routes_total"], m["ngstone_cluster_lease_ok"])
	}
	// Unknown names stay 404 on every edge.
	if code, _ := fetch(t, b, tunneltest.URL("http", "nobody", "/")); code != http.StatusNotFound {
		t.Fatalf("unbound name via b = %d, want 404", code)
	}
}

// TestClusterClusterKey: an edge with another cluster key is refused at the
// TLS handshake, so it can neither forward nor be forwarded to.
func TestClusterClusterKey(t *testing.T) {
	c := newTestCluster(t)
	a := c.start("a", nil, nil)
	b := c.start("b", nil, func(cfg *edge.Config) { cfg.Cluster.Key = strings.Repeat("x", 40) })
	backend := tunneltest.StartBackend(t)
	startClusterAgent(t, a, "", backend.Addr(), "app", instX).WaitOnline(t)
	tunneltest.Eventually(t, 5*time.Second, "b to learn the route", func() bool {
		_, ok := b.store.Lookup("app." + tunneltest.Domain)
		return ok
	})
	code, _ := fetch(t, b, tunneltest.URL("http", "app", "/hello"))
	if code == http.StatusOK {
		t.Fatal("an edge with another cluster key forwarded a request")
	}
	if _, err := edge.New(edge.Config{Domain: "x.test", ControlAddr: ":0", Cluster: &edge.ClusterConfig{Store: registry.NewEtcd(registry.EtcdConfig{Node: "n"}), Addr: ":0", Key: "short"}}, nil); err == nil || !strings.Contains(err.Error(), "cluster-key") {
		t.Fatalf("a short cluster key: %v; want an error naming cluster-key", err)
	}
}

// TestClusterReconnectToOtherEdge: the agent's path to edge A goes silent
// while A still believes the session live; the load balancer sends its
// reconnect to edge B, where it takes its name back at once (same
// instance); A is told through the watch and fences its session; visitors
// on both edges reach the agent through B. Another instance is refused on
// B while the holder is live.
func TestClusterReconnectToOtherEdge(t *testing.T) {
	c := newTestCluster(t)
	slow := func(cfg *edge.Config) { cfg.HeartbeatTimeout = time.Minute } // A will not notice
	a, b := c.start("a", nil, slow), c.start("b", nil, slow)
	backend := tunneltest.StartBackend(t)
	lb := controlProxy(t, a)
	ac := a.AgentConfigShortTimeouts(lb.Addr(), backend.Addr())
	ac.Subdomain, ac.InstanceID = "app", instX
	ac.HeartbeatTimeout = 300 * time.Millisecond
	ag := tunneltest.StartAgent(t, ac)
	before := ag.WaitOnline(t)
	host := "app." + tunneltest.Domain

	other := startClusterAgent(t, b, b.Addr("control").String(), backend.Addr(), "app", instY)
	var re *agent.RefusedError
	if err := other.Err(); !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken {
		t.Fatalf("another instance on b: %v; want %s while a's holder is live", err, mux.CodeSubdomainTaken)
	}

	lb.DelayExisting(time.Hour) // the partition: open paths go silent
	lb.SetTarget(b.Addr("control").String())
	cut := time.Now()
	after := ag.WaitStatus(t, 10*time.Second, "online again, through b", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.SessionID != before.SessionID
	})
	t.Logf("online on b %v after the partition began (agent heartbeat timeout 300ms)", time.Since(cut).Round(time.Millisecond))
	if after.InstanceID != before.InstanceID || after.Generation <= before.Generation {
		t.Fatalf("after the move: %+v; before: %+v", after, before)
	}
	tunneltest.Eventually(t, 5*time.Second, "a to learn of the takeover", func() bool {
		r, ok := a.store.Lookup(host)
		return ok && r.Node == "b" && r.Generation == after.Generation
	})
	mustFetch(t, a, tunneltest.URL("http", "app", "/hello"), "hello")
	mustFetch(t, b, tunneltest.URL("http", "app", "/hello"), "hello")
	tn, err := a.Tunnels(context.Background())
	if err != nil || len(tn) != 1 || tn[0].Node != "b" {
		t.Fatalf("a's admin view: %+v, %v; want the tunnel on node b", tn, err)
	}
}

// TestClusterKilledEdge: edge A is cut off from etcd and from its agent, as
// if killed. A declares its lease lost and closes its sessions; once the
// lease expires, a different instance binds the name on B and visitors on B
// reach it.
func TestClusterKilledEdge(t *testing.T) {
	c := newTestCluster(t)
	cli, etcdPath := etcdProxy(t)
	a := c.startWith("a", cli, func(ec *registry.EtcdConfig) { ec.LeaseTTL, ec.CallTimeout = 2*time.Second, 500*time.Millisecond }, nil)
	b := c.start("b", nil, nil)
	t.Cleanup(etcdPath.Unblock) // before a's Close, so it can revoke quickly
	first, second := tunneltest.StartBackend(t), tunneltest.StartBackend(t)
	lb := controlProxy(t, a)
	startClusterAgent(t, a, lb.Addr(), first.Addr(), "app", instX).WaitOnline(t)

	etcdPath.Block()
	lb.Block()
	killed := time.Now()
	var took *tunneltest.Agent
	tunneltest.Eventually(t, 20*time.Second, "another instance to bind app on b", func() bool {
		ag := startClusterAgent(t, b, b.Addr("control").String(), second.Addr(), "app", instY)
		// Each try waits for its agent to be refused or online, 5 s at
		// most: a dial and a bind through etcd can take a second on a
		// loaded machine.
		for deadline := time.Now().Add(5 * time.Second); ag.Status().State != agent.StateOnline; {
			select {
			case <-ag.Done():
				return false // refused: the holder on a is still live
			case <-time.After(10 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				ag.Stop()
				return false
			}
		}
		took = ag
		return true
	})
	t.Logf("bound on b %v after a was cut off (lease TTL 2s)", time.Since(killed).Round(time.Millisecond))
	if a.Sessions() != 0 {
		t.Fatalf("a kept %d sessions after losing its lease", a.Sessions())
	}
	if v := scrape(t, a.Edge, "")["ngstone_cluster_lease_ok"]; v != 0 {
		t.Fatalf("a's ngstone_cluster_lease_ok = %v without a lease", v)
	}
	if got := took.Status(); got.Hostname != "app."+tunneltest.Domain {
		t.Fatalf("the new agent holds %q", got.Hostname)
	}
	resp, err := b.Client().Get(tunneltest.URL("http", "app", "/headers"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("visitor on b after the takeover: %d", resp.StatusCode)
	}
	health, err := http.Get("http://" + a.Addr("admin").String() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	health.Body.Close()
	if health.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("a's /healthz without a lease = %d, want 503", health.StatusCode)
	}
}

// TestClusterStaleRoute: B's route cache still names edge A after the
// agent moved to edge C, within B's staleness bound (B hears from etcd
// 300 ms late, which its bound and call timeout allow). B forwards to A,
// A answers 421 (stale route), B reads the registry and retries once, at
// C: the visitor sees 200, with its request body intact.
func TestClusterStaleRoute(t *testing.T) {
	c := newTestCluster(t)
	a := c.start("a", nil, nil)
	cli, bPath := etcdProxy(t)
	b := c.startWith("b", cli, func(ec *registry.EtcdConfig) {
		ec.LeaseTTL, ec.CallTimeout, ec.RouteStaleness = 10*time.Second, 2*time.Second, 10*time.Second
	}, nil)
	cEdge := c.start("c", nil, nil)
	backend := tunneltest.StartBackend(t)
	lb := controlProxy(t, a)
	ag := startClusterAgent(t, a, lb.Addr(), backend.Addr(), "app", instX)
	before := ag.WaitOnline(t)
	host := "app." + tunneltest.Domain
	tunneltest.Eventually(t, 5*time.Second, "b to learn the route to a", func() bool {
		r, ok := b.store.Lookup(host)
		return ok && r.Node == "a"
	})

	bPath.DelayExisting(300 * time.Millisecond) // b hears of changes late
	lb.SetTarget(cEdge.Addr("control").String())
	lb.Reset()
	after := ag.WaitStatus(t, 10*time.Second, "online on c", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.Generation > before.Generation
	})
	tunneltest.Eventually(t, 5*time.Second, "a to learn of the move", func() bool {
		r, ok := a.store.Lookup(host)
		return ok && r.Node == "c"
	})
	if r, _ := b.store.Lookup(host); r.Node != "a" {
		t.Fatalf("b's route is already %+v: the test needs it stale", r)
	}
	payload := strings.Repeat("x", 64<<10)
	resp, err := b.Client().Post(tunneltest.URL("http", "app", "/echo"), "text/plain", strings.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(got) != payload {
		t.Fatalf("visitor on b: %d, %d bytes back (%s)", resp.StatusCode, len(got), resp.Header.Get("Ngstone-Error"))
	}
	if retried := scrape(t, b.Edge, "")["ngstone_cluster_stale_routes_total"]; retried != 1 {
		t.Fatalf("b retried %v times, want exactly 1", retried)
	}
	if r, _ := b.store.Lookup(host); r.Node != "c" || r.Generation != after.Generation {
		t.Fatalf("b's route after the retry: %+v", r)
	}
}

// TestClusterSixteenEdgesRace: sixteen edges, an agent of another instance
// on each, all bind one name at once: one is online, fifteen are refused.
// Not a test of timing: sixteen binds of one name on one etcd, under -race
// on a loaded machine, take longer than the tests' 1 s agent dial bound (an
// agent that gives up on its bind closes the session that won it, and
// tries again), and sixteen edges' renewals longer than a 2 s lease
// allows; so the agents may take 5 s, and the edges keep a 6 s lease.
func TestClusterSixteenEdgesRace(t *testing.T) {
	c := newTestCluster(t)
	cli := etcdtest.Endpoints(t)
	backend := tunneltest.StartBackend(t)
	const n = 16
	edges := make([]*clusterEdge, n)
	for i := range edges {
		edges[i] = c.startWith(fmt.Sprintf("edge-%d", i), cli, func(ec *registry.EtcdConfig) {
			ec.LeaseTTL, ec.CallTimeout = 6*time.Second, time.Second
		}, func(cfg *edge.Config) {
			cfg.HTTPAddr, cfg.HTTPSAddr, cfg.AdminAddr = "", "", ""
		})
	}
	agents := make([]*tunneltest.Agent, n)
	var wg sync.WaitGroup
	for i, e := range edges {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ac := e.AgentConfigShortTimeouts("", backend.Addr())
			ac.Subdomain, ac.InstanceID, ac.DialTimeout = "race", fmt.Sprintf("%032x", i+1), 5*time.Second
			agents[i] = tunneltest.StartAgent(t, ac)
		}()
	}
	wg.Wait()
	var online, refused int
	for _, ag := range agents {
		ag.WaitStatus(t, 20*time.Second, "online or refused", func(s agent.Status) bool {
			return s.State == agent.StateOnline || s.State == agent.StateFailed
		})
		var re *agent.RefusedError
		switch s := ag.Status(); {
		case s.State == agent.StateOnline:
			online++
		case errors.As(s.Err, &re) && re.Code == mux.CodeSubdomainTaken:
			refused++
		default:
			t.Fatalf("agent ended %+v", s)
		}
	}
	if online != 1 || refused != n-1 {
		t.Fatalf("%d online, %d refused; want 1 and %d", online, refused, n-1)
	}
}

// TestClusterStreams: through a forwarding edge, server-sent events arrive
// one at a time (each only after the client acknowledged the previous
// one), and an Upgrade round trip works.
func TestClusterStreams(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(t)
	st := startClusterAgent(t, a, "", backend.Addr(), "live", instX).WaitOnline(t)
	tunneltest.Eventually(t, 5*time.Second, "b to learn the route", func() bool {
		r, ok := b.store.Lookup("live." + tunneltest.Domain)
		return ok && r.Generation == st.Generation
	})
	client := b.Client()
	resp, err := client.Get(tunneltest.URL("https", "live", "/sse?n=3"))
	if err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := r.ReadString('\n')
		if want := fmt.Sprintf("data: event %d\n", i); err != nil || line != want {
			t.Fatalf("event %d: %q, %v; want %q", i, line, err, want)
		}
		r.ReadString('\n')
		if i < 2 {
			ack, err := client.Get(tunneltest.URL("http", "live", "/sse-ack"))
			if err != nil {
				t.Fatalf("ack %d: %v", i, err)
			}
			ack.Body.Close()
		}
	}
	resp.Body.Close()

	tunneltest.UpgradeRoundTrip(t, b.Addr("http").String(), "live")
}

// TestClusterTokenBindingLimit: a token's max_bindings counts its tunnels
// on every edge of the cluster, not only those of the edge it binds
// through; a takeover of its own name still does not count twice.
func TestClusterTokenBindingLimit(t *testing.T) {
	c := newTestCluster(t)
	limit := func(cfg *edge.Config) { cfg.TokenPolicies = []edge.TokenPolicy{{Token: "one", MaxBindings: 1}} }
	a := c.start("a", nil, limit)
	b := c.start("b", nil, limit)
	first := hello("one")
	r, _ := a.DialRaw(t, first)
	if m, ok := r.Bind(t, &mux.Bind{Subdomain: "first"}).(*mux.BindOK); !ok {
		t.Fatalf("first bind on edge a: %v", m)
	}
	if code := bindCode(t, b.Edge, "one", "second"); code != mux.CodeLimitExceeded {
		t.Fatalf("second tunnel of a token limited to one, through edge b: %s, want %s", code, mux.CodeLimitExceeded)
	}
	// The same instance taking its name over through edge b: still one.
	r2, _ := b.DialRaw(t, first)
	if m, ok := r2.Bind(t, &mux.Bind{Subdomain: "first", Takeover: true}).(*mux.BindOK); !ok {
		t.Fatalf("takeover of its own name through edge b: %v", m)
	}
}

// TestClusterAdminRemoteOnline: the admin API of an edge reports a tunnel
// another edge holds as that edge measures it at the time of the call:
// online with its heartbeat and agent address while its agent beats, and
// offline once the agent falls silent.
func TestClusterAdminRemoteOnline(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(t)
	st := startClusterAgent(t, a, "", backend.Addr(), "app", instX).WaitOnline(t)
	// A raw agent that never sends a heartbeat: live until the freshness
	// window (2 s here) has passed since its hello.
	r, _ := a.DialRaw(t, hello(""))
	if m, ok := r.Bind(t, &mux.Bind{Subdomain: "quiet"}).(*mux.BindOK); !ok {
		t.Fatalf("bind quiet: %v", m)
	}
	list := func() map[string]edge.Tunnel {
		resp, body := adminGet(t, b.Edge, "/api/tunnels", "")
		var ts []edge.Tunnel
		if err := json.Unmarshal([]byte(body), &ts); err != nil || resp.StatusCode != 200 {
			t.Fatalf("b's /api/tunnels: %d %v %s", resp.StatusCode, err, body)
		}
		out := map[string]edge.Tunnel{}
		for _, tn := range ts {
			out[tn.Hostname] = tn
		}
		return out
	}
	app, quiet := "app."+tunneltest.Domain, "quiet."+tunneltest.Domain
	got := list()
	tn := got[app]
	if tn.Node != "a" || !tn.Online || tn.SessionID != st.SessionID || tn.RemoteAddr == "" || time.Since(tn.LastHeartbeat) > 10*time.Second {
		t.Fatalf("b's view of %s (held by a, agent beating): %+v", app, tn)
	}
	if !got[quiet].Online {
		t.Fatalf("b's view of %s right after its hello: %+v, want online", quiet, got[quiet])
	}
	resp, body := adminGet(t, b.Edge, "/api/tunnels/"+app, "")
	var one edge.Tunnel
	if err := json.Unmarshal([]byte(body), &one); err != nil || resp.StatusCode != 200 || !one.Online || one.Node != "a" {
		t.Fatalf("b's /api/tunnels/%s: %d %v %s", app, resp.StatusCode, err, body)
	}
	tunneltest.Eventually(t, 10*time.Second, "b to report the silent agent's tunnel offline", func() bool {
		tn, ok := list()[quiet]
		if !ok {
			t.Fatalf("%s left the registry before b ever reported it offline", quiet)
		}
		return !tn.Online
	})
	if tn := list()[app]; !tn.Online {
		t.Fatalf("b's view of %s after the other agent fell silent: %+v, want still online", app, tn)
	}
}

// TestClusterTokenSessionLimit: a token's max_sessions counts its agents
// on every edge of the cluster; a reconnecting instance's own session
// still does not count against it, on any edge.
func TestClusterTokenSessionLimit(t *testing.T) {
	c := newTestCluster(t)
	limit := func(cfg *edge.Config) { cfg.TokenPolicies = []edge.TokenPolicy{{Token: "one", MaxSessions: 1}} }
	a := c.start("a", nil, limit)
	b := c.start("b", nil, limit)
	first := hello("one")
	if _, m := a.DialRaw(t, first); m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("first agent on edge a: %v", m)
	}
	if _, m := b.DialRaw(t, hello("one")); m.MessageType() != mux.TypeError || m.(*mux.Error).Code != mux.CodeLimitExceeded {
		t.Fatalf("second agent of a token limited to one, on edge b: %v, want %s", m, mux.CodeLimitExceeded)
	}
	if _, m := b.DialRaw(t, first); m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("the first agent reconnecting through edge b: %v", m)
	}
}

// TestOwnHostnameRules: the binding rules hold for a hostname of an
// agent's own as for a subdomain, on one edge and across two edges of a
// cluster (the agents on the second): another instance is refused while
// the holder is live, the same instance takes the name over at once with
// a higher generation, a graceful stop releases it, and the late release
// of a session that ended holding it deletes nothing of the new holder's
// (compare-and-delete; lateRelease). Visitors reach it by its own Host on
// either edge.
func TestOwnHostnameRules(t *testing.T) {
	const host = "app.example.test"
	pol := func(cfg *edge.Config) {
		cfg.TokenPolicies = []edge.TokenPolicy{{Token: "t", Hostnames: []string{"*.example.test"}}}
	}
	for _, cluster := range []bool{false, true} {
		t.Run(map[bool]string{false: "one edge", true: "two edges"}[cluster], func(t *testing.T) {
			var a, b *tunneltest.Edge
			if cluster {
				c := newTestCluster(t)
				a, b = c.start("a", nil, pol).Edge, c.start("b", nil, pol).Edge
			} else {
				cfg := tunneltest.EdgeConfigShortTimeouts(t)
				pol(&cfg)
				a = tunneltest.StartEdge(t, cfg)
				b = a
			}
			backend := tunneltest.StartBackend(t)
			// run starts an agent for host on e, or through a path to it.
			run := func(e *tunneltest.Edge, instance string, path ...string) *tunneltest.Agent {
				ac := e.AgentConfigShortTimeouts(strings.Join(path, ""), backend.Addr())
				ac.Token, ac.Hostname, ac.InstanceID = "t", host, instance
				return tunneltest.StartAgent(t, ac)
			}
			visit := func(e *tunneltest.Edge, scheme ...string) (int, string) {
				url := "https://" + host + "/hello"
				if len(scheme) > 0 {
					url = scheme[0] + "://" + host + "/hello"
				}
				resp, err := e.Client().Get(url)
				if err != nil {
					t.Fatalf("GET %s: %v", url, err)
				}
				defer resp.Body.Close()
				body, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(body)
			}
			bound := func(name string) edge.Tunnel {
				ts, err := a.Tunnels(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				for _, tn := range ts {
					if tn.Hostname == name {
						return tn
					}
				}
				return edge.Tunnel{}
			}
			holder := func() edge.Tunnel { return bound(host) }

			first := run(a, instX)
			s1 := first.WaitOnline(t)
			for _, e := range []*tunneltest.Edge{a, b} {
				if code, body := visit(e); code != http.StatusOK || body != "hello" {
					t.Fatalf("visit through %s = %d %q, want the backend's hello", e.Addr("https"), code, body)
				}
			}

			other := run(b, instY)
			var re *agent.RefusedError
			if err := other.Err(); !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken || !strings.Contains(re.Message, "--hostname") {
				t.Fatalf("another instance: %v; want %s naming --hostname", err, mux.CodeSubdomainTaken)
			}

			second := run(b, instX)
			s2 := second.WaitOnline(t)
			if s2.Generation <= s1.Generation {
				t.Fatalf("takeover at generation %d, after %d: want higher", s2.Generation, s1.Generation)
			}
			if err := first.Err(); !errors.Is(err, agent.ErrEvicted) {
				t.Fatalf("the first session after the takeover: %v, want evicted", err)
			}
			// The first session has ended and released what it held: the
			// name is still the second's.
			tunneltest.Eventually(t, 5*time.Second, "the holder to be the second session on "+a.Addr("https").String(), func() bool {
				h := holder()
				return h.SessionID == s2.SessionID && h.Generation == s2.Generation && h.Online
			})
			if code, body := visit(a); code != http.StatusOK || body != "hello" {
				t.Fatalf("visit after the takeover = %d %q", code, body)
			}

			if err := second.Stop(); err != nil {
				t.Fatal(err)
			}
			tunneltest.Eventually(t, 5*time.Second, "the name released", func() bool { return holder().Hostname == "" })
			// Unbound, the name has no certificate (a handshake for it gets
			// the edge's, which the client refuses) and plain HTTP says 404.
			if _, err := e2eGet(a, "https://"+host+"/hello"); err == nil || !strings.Contains(err.Error(), "not "+host) {
				t.Fatalf("HTTPS after release: %v, want the handshake refused by the client", err)
			}
			if code, _ := visit(a, "http"); code != http.StatusNotFound {
				t.Fatalf("visit after release = %d, want 404", code)
			}

			lateRelease(t, a, b, run, bound, host)
		})
	}
}

func e2eGet(e *tunneltest.Edge, url string) (int, error) {
	resp, err := e.Client().Get(url)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// lateRelease: the holder's link to b is cut, so its session ends holding
// host (b releases such a binding once --heartbeat-timeout has passed), and
// the same instance takes the name back at once on a new session, through
// a (the other edge, in a cluster). The old session's release, when its
// time comes, must delete nothing of the new one's: compare-and-delete. A
// witness, another agent's name whose link to b is cut after that, is
// released by a later pass of the same reaper, so once it is gone the late
// release has run.
func lateRelease(t *testing.T, a, b *tunneltest.Edge, run func(*tunneltest.Edge, string, ...string) *tunneltest.Agent,
	bound func(string) edge.Tunnel, host string) {
	t.Helper()
	link, wlink := tunneltest.StartFaultProxy(t, b.Addr("control").String()), tunneltest.StartFaultProxy(t, b.Addr("control").String())
	wc := b.AgentConfigShortTimeouts(wlink.Addr(), tunneltest.StartBackend(t).Addr())
	wc.Token, wc.Subdomain = "t", "witness"
	tunneltest.StartAgent(t, wc).WaitOnline(t)
	witness := "witness." + tunneltest.Domain

	holder := run(b, instX, link.Addr())
	s1 := holder.WaitOnline(t)
	link.SetTarget(a.Addr("control").String())
	link.Reset()
	s2 := holder.WaitStatus(t, 10*time.Second, "the name back on a new session", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.Generation > s1.Generation
	})
	wlink.Close()
	tunneltest.Eventually(t, 10*time.Second, "the witness released after its session's grace", func() bool {
		return bound(witness).Hostname == ""
	})
	if h := bound(host); h.SessionID != s2.SessionID || h.Generation != s2.Generation || !h.Online {
		t.Fatalf("after the old session's release %s is %+v, want the new session's (%d, generation %d)", host, h, s2.SessionID, s2.Generation)
	}
}
