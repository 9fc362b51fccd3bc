package edge_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// Attacks on pools across the edges of a cluster (edge/members.go,
// edge/cluster.go, registry/etcdpool.go): a hostile member agent, a
// hostile visitor and a member with other visitor rules on another edge
// each try to break what a pool promises there.

// rawCluster starts edges a and b of one cluster for raw agents (which
// send no heartbeats) of token "alpha".
func rawCluster(t *testing.T) (c *testCluster, a, b *clusterEdge) {
	c = newTestCluster(t)
	tune := func(cfg *edge.Config) {
		cfg.HeartbeatTimeout = time.Minute
		cfg.Tokens = []string{"alpha"}
	}
	return c, c.start("a", nil, tune), c.start("b", nil, tune)
}

// answerStale is a member's forgery of the owner's refusal of a stale
// route (421 with Ngstone-Route: stale), which would have the first edge
// send the request elsewhere if it reached it.
func answerStale(w io.Writer, name string) {
	fmt.Fprintf(w, "HTTP/1.1 421 Misdirected Request\r\nNgstone-Route: stale\r\nContent-Length: %d\r\n\r\n%s", len(name), name)
}

// pending waits until neither edge counts a pool exchange in flight nor
// holds a health write.
func pending(t *testing.T, what string, edges ...*clusterEdge) {
	t.Helper()
	tunneltest.Eventually(t, 10*time.Second, what, func() bool {
		for _, e := range edges {
			if f, h := edge.ClusterPending(e.Edge.Edge); f != 0 || h != 0 {
				return false
			}
		}
		return true
	})
}

// scrapeForwarded is the edge's ngstone_cluster_forwarded_total.
func scrapeForwarded(t *testing.T, e *clusterEdge) float64 {
	t.Helper()
	return scrape(t, e.Edge, "")["ngstone_cluster_forwarded_total"]
}

// Members on both edges whose agents answer every request 502
// upstream_unreachable with a forged Ngstone-Unsent: a GET is sent to
// each member exactly once, whichever edge the visitor came to, and is
// forwarded between the edges only by the visitor's edge, once per member
// of the other (the owner never forwards); a request with a body reaches
// one member once; no visitor sees Ngstone-Unsent. A member forging the
// owner's stale refusal (421 Ngstone-Route: stale) has its answer taken
// as the member's: the visitor gets it, and the request goes nowhere
// else. Afterwards neither edge counts an exchange in flight.
func TestClusterHostileForgedUnsent(t *testing.T) {
	_, a, b := rawCluster(t)
	host := "forge." + tunneltest.Domain
	ra, _ := joinPool(t, a.Edge, hello("alpha"), "forge", mux.Bind{})
	rb1, _ := joinPool(t, b.Edge, hello("alpha"), "forge", mux.Bind{})
	rb2, _ := joinPool(t, b.Edge, hello("alpha"), "forge", mux.Bind{})
	ms := []*rawMember{serveMember(ra, "fa", answerUnsent), serveMember(rb1, "fb1", answerUnsent), serveMember(rb2, "fb2", answerUnsent)}
	waitPool(t, host, 3, a, b)

	const n = 20
	for round, via := range []*clusterEdge{a, b} {
		other := b
		if via == b {
			other = a
		}
		fwdVia, fwdOther := scrapeForwarded(t, via), scrapeForwarded(t, other)
		c := via.Client()
		for range n {
			got := getPool(t, c, "forge")
			if got.status != http.StatusBadGateway || got.code != mux.CodeUpstreamUnreachable || got.unsent {
				t.Fatalf("GET via %s: %+v, want the 502 upstream_unreachable without %s", via.store.Node(), got, mux.UnsentHeader)
			}
		}
		for _, m := range ms {
			if got := m.served(host); got != n*(round+1) {
				t.Fatalf("after %d GETs via %s, member %s was sent %d in all, want each GET once: %d", n, via.store.Node(), m.name, got, n*(round+1))
			}
		}
		// Members of the other edge: two of a's, one of b's.
		remote := 2
		if via == b {
			remote = 1
		}
		if d := scrapeForwarded(t, via) - fwdVia; d != float64(remote*n) {
			t.Fatalf("%d GETs via %s were forwarded %v times, want once per member of the other edge: %d", n, via.store.Node(), d, remote*n)
		}
		if d := scrapeForwarded(t, other) - fwdOther; d != 0 {
			t.Fatalf("%d GETs via %s: the other edge forwarded %v of them on, want none", n, via.store.Node(), d)
		}
	}

	before := 0
	for _, m := range ms {
		before += m.total()
	}
	for _, via := range []*clusterEdge{a, b} {
		c := via.Client()
		for range n {
			req, _ := http.NewRequest(http.MethodPost, tunneltest.URL("http", "forge", "/"), strings.NewReader("payload"))
			if got := ask(t, c, req); got.status != http.StatusBadGateway || got.unsent {
				t.Fatalf("POST via %s: %+v, want the 502 without %s", via.store.Node(), got, mux.UnsentHeader)
			}
		}
	}
	after, bodies := 0, 0
	for _, m := range ms {
		after += m.total()
		m.mu.Lock()
		bodies += m.bodies
		m.mu.Unlock()
	}
	if after-before != 2*n || bodies != 2*n {
		t.Fatalf("%d POSTs reached the members %d times (%d with the body), want once each", 2*n, after-before, bodies)
	}

	// The forged stale refusal.
	stale := "stale." + tunneltest.Domain
	rs, _ := joinPool(t, a.Edge, hello("alpha"), "stale", mux.Bind{})
	rf, _ := joinPool(t, b.Edge, hello("alpha"), "stale", mux.Bind{})
	honest, forger := serveMember(rs, "honest", nil), serveMember(rf, "forger", answerStale)
	waitPool(t, stale, 2, a, b)
	c := a.Client()
	oks, refused := 0, 0
	for range 40 {
		switch got := getPool(t, c, "stale"); {
		case got.status == http.StatusOK && got.body == "honest":
			oks++
		case got.status == http.StatusMisdirectedRequest && got.body == "forger":
			refused++
		default:
			t.Fatalf("GET stale via a: %+v", got)
		}
	}
	if forger.served(stale) == 0 {
		t.Fatal("no GET went to the forging member: the test checks nothing")
	}
	if refused != forger.served(stale) || oks != honest.served(stale) {
		t.Fatalf("the forger was sent %d GETs and %d of its 421s reached the visitor; the honest member %d, %d answered: a forged stale refusal sent requests on", forger.served(stale), refused, honest.served(stale), oks)
	}
	pending(t, "no pool exchange in flight on either edge", a, b)
}

// A member with visitor rules on one edge is never reached by a visitor
// they exclude, whichever edge the visitor comes to, also when the
// request is first sent to a member of the other edge whose agent answers
// it unsent: the owner checks a forwarded request's address, the first
// edge retries on a member of its own only when it checked that member's
// rules (not an address the visitor claims, nor a webhook's signature it
// did not verify).
func TestClusterHostilePoolRetryKeepsRules(t *testing.T) {
	_, a, b := rawCluster(t)
	doc := []string{"203.0.113.0/24"} // the documentation range: not the visitor's 127.0.0.1
	hook := &mux.Webhook{Provider: "hmac", Secret: "s1", Header: "X-Sig"}
	for _, tc := range []struct {
		name     string
		guarded  mux.Bind
		onA      bool // the guarded member is on edge a; the failing one on b
		signWith string
	}{
		{"cidr-on-a", mux.Bind{AllowCIDR: doc}, true, ""},
		{"cidr-on-b", mux.Bind{AllowCIDR: doc}, false, ""},
		{"webhook-on-a", mux.Bind{Webhook: hook}, true, "wrong"},
		{"webhook-on-b", mux.Bind{Webhook: hook}, false, "wrong"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			host := tc.name + "." + tunneltest.Domain
			ge, fe := a, b
			if !tc.onA {
				ge, fe = b, a
			}
			rg, _ := joinPool(t, ge.Edge, hello("alpha"), tc.name, tc.guarded)
			rf, _ := joinPool(t, fe.Edge, hello("alpha"), tc.name, mux.Bind{})
			guarded, failing := serveMember(rg, "guarded", nil), serveMember(rf, "failing", answerUnsent)
			waitPool(t, host, 2, a, b)
			for _, via := range []*clusterEdge{a, b} {
				c := via.Client()
				for range 20 {
					req, _ := http.NewRequest(http.MethodGet, tunneltest.URL("http", tc.name, "/"), nil)
					// Claims the guarded member's range.
					req.Header.Set("X-Forwarded-For", "203.0.113.9")
					req.Header.Set("X-Real-IP", "203.0.113.9")
					req.Header.Set("Forwarded", "for=203.0.113.9")
					if tc.signWith != "" {
						req.Header.Set("X-Sig", hmacSig(tc.signWith, ""))
					}
					got := ask(t, c, req)
					if got.unsent || got.status == http.StatusOK {
						t.Fatalf("GET via %s: %+v: reached a member that excludes the visitor, or %s reached the visitor", via.store.Node(), got, mux.UnsentHeader)
					}
				}
			}
			if failing.served(host) == 0 {
				t.Fatal("no request went to the failing member first: the test checks nothing")
			}
			if n := guarded.served(host); n != 0 {
				t.Fatalf("%d requests reached the member whose rules exclude the visitor", n)
			}
		})
	}
	pending(t, "no pool exchange in flight on either edge", a, b)
}

// headerMember is a raw agent's pool member that records the cluster's
// own fields and X-Forwarded-For of what reaches it.
type headerMember struct {
	name string
	mu   sync.Mutex
	n    int
	bad  []string // Ngstone-* fields seen, or an X-Forwarded-For not the visitor's
}

func serveHeaders(r *tunneltest.RawSession, name string) *headerMember {
	m := &headerMember{name: name}
	serveMemberSeeing(r, name, nil, m.see)
	return m
}

func (m *headerMember) see(req *http.Request) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.n++
	for k, v := range req.Header {
		if strings.HasPrefix(strings.ToLower(k), "ngstone-") {
			m.bad = append(m.bad, k+": "+strings.Join(v, ","))
		}
	}
	if xff := req.Header.Values("X-Forwarded-For"); len(xff) != 1 || xff[0] != "127.0.0.1" {
		m.bad = append(m.bad, "X-Forwarded-For: "+strings.Join(xff, ","))
	}
}

// A visitor's forged cluster fields (the generation of a member of the
// other edge, the forwarding edge, a stale route, Unsent) steer nothing:
// requests to either edge still go to both members, and no member sees
// any Ngstone-* field or another X-Forwarded-For than the visitor's.
func TestClusterHostileForgedGeneration(t *testing.T) {
	_, a, b := rawCluster(t)
	host := "gen." + tunneltest.Domain
	ra, _ := joinPool(t, a.Edge, hello("alpha"), "gen", mux.Bind{})
	rb, _ := joinPool(t, b.Edge, hello("alpha"), "gen", mux.Bind{})
	ma, mb := serveHeaders(ra, "ga"), serveHeaders(rb, "gb")
	waitPool(t, host, 2, a, b)
	tn := poolTunnel(t, a.Edge, host)
	if len(tn.Members) != 2 {
		t.Fatalf("pool %+v", tn)
	}
	for _, via := range []*clusterEdge{a, b} {
		c := via.Client()
		counts := map[string]int{}
		for range 40 {
			req, _ := http.NewRequest(http.MethodGet, tunneltest.URL("http", "gen", "/"), nil)
			// Each edge's visitor names the other edge's member.
			gen, node := tn.Members[1].Generation, "b"
			if via == b {
				gen, node = tn.Members[0].Generation, "a"
			}
			req.Header.Set("Ngstone-Generation", fmt.Sprint(gen))
			req.Header.Set("Ngstone-Forwarded-By", node)
			req.Header.Set("Ngstone-Route", "stale")
			req.Header.Set(mux.UnsentHeader, "1")
			req.Header.Set("X-Forwarded-For", "203.0.113.9")
			got := ask(t, c, req)
			if got.status != http.StatusOK {
				t.Fatalf("GET via %s: %+v", via.store.Node(), got)
			}
			counts[got.body]++
		}
		if counts["ga"] == 0 || counts["gb"] == 0 {
			t.Fatalf("40 GETs via %s naming one member's generation spread %v: the forged field steered them", via.store.Node(), counts)
		}
	}
	for _, m := range []*headerMember{ma, mb} {
		m.mu.Lock()
		bad := m.bad
		m.mu.Unlock()
		if len(bad) > 0 {
			t.Fatalf("member %s saw %d fields a visitor forged or the cluster's own, first: %v", m.name, len(bad), bad[:min(len(bad), 4)])
		}
	}
}

// memberKeys reads every key of the cluster's names (hosts/ and
// members/) under prefix, with its version.
func memberKeys(t *testing.T, cli *clientv3.Client, prefix string) map[string]int64 {
	t.Helper()
	resp, err := cli.Get(t.Context(), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, kv := range resp.Kvs {
		k := strings.TrimPrefix(string(kv.Key), prefix)
		if strings.HasPrefix(k, "hosts/") || strings.HasPrefix(k, "members/") {
			out[k] = kv.Version
		}
	}
	return out
}

// A hostile agent flips its pool member's health as fast as it can: its
// edge writes the member's key in etcd at most once each healthGap (the
// key's version counts the writes), and ends with the last word recorded.
// Its health messages for a name it holds without --pool, for another
// session's pool on the other edge, and for a name no one holds write
// nothing. Once the agents leave, neither edge holds a health write or
// counts an exchange in flight.
func TestClusterHostileHealthFlood(t *testing.T) {
	c, a, b := rawCluster(t)
	flap := "flap." + tunneltest.Domain
	x, sx := joinPool(t, a.Edge, hello("alpha"), "flap", mux.Bind{})
	if m, ok := x.Bind(t, &mux.Bind{Subdomain: "solo"}).(*mux.BindOK); !ok {
		t.Fatalf("bind solo: %+v", m)
	}
	y, _ := joinPool(t, b.Edge, hello("alpha"), "flap", mux.Bind{})
	if m, ok := y.Bind(t, &mux.Bind{Subdomain: "yonly", Pool: true}).(*mux.BindOK); !ok {
		t.Fatalf("bind yonly: %+v", m)
	}
	serveMember(x, "x", nil)
	serveMember(y, "y", nil)
	waitPool(t, flap, 2, a, b)
	waitPool(t, "yonly."+tunneltest.Domain, 1, a, b)

	cli := etcdtest.Client(t)
	own := fmt.Sprintf("members/%s/a/%d", flap, sx)
	before := memberKeys(t, cli, c.prefix)
	if before[own] == 0 {
		t.Fatalf("no key %s in %v", own, before)
	}
	send := func(m *mux.Health) {
		t.Helper()
		if err := mux.Write(x.Ctrl, m); err != nil {
			t.Fatalf("write health: %v", err)
		}
	}
	t0 := time.Now()
	flips := 0
	for ; flips < 5000 && time.Since(t0) < 1200*time.Millisecond; flips++ {
		send(&mux.Health{Hostname: flap, Down: flips%2 == 0, Reason: fmt.Sprint("flip ", flips)})
		send(&mux.Health{Hostname: "solo." + tunneltest.Domain, Down: flips%2 == 0})
		send(&mux.Health{Hostname: "yonly." + tunneltest.Domain, Down: flips%2 == 0})
		send(&mux.Health{Hostname: "nobody." + tunneltest.Domain, Down: flips%2 == 0})
	}
	send(&mux.Health{Hostname: flap, Down: true, Reason: "final"})
	if err := mux.Write(x.Ctrl, &mux.Heartbeat{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	readUntil(t, x, "heartbeat_ack", func(m mux.Message) bool {
		ack, ok := m.(*mux.HeartbeatAck)
		return ok && ack.Seq == 1
	})
	tunneltest.Eventually(t, 10*time.Second, "the last health recorded in etcd", func() bool {
		resp, err := cli.Get(t.Context(), c.prefix+own)
		if err != nil || len(resp.Kvs) == 0 {
			return false
		}
		var rec struct{ Down string }
		return json.Unmarshal(resp.Kvs[0].Value, &rec) == nil && rec.Down == "final"
	})
	pending(t, "a's health writer to end", a)
	elapsed := time.Since(t0)
	after := memberKeys(t, cli, c.prefix)

	writes := after[own] - before[own]
	bound := int64(elapsed/edge.HealthGap) + 1
	if writes < 1 || writes > bound {
		t.Fatalf("%d health changes over %v were written to etcd %d times, want 1 to %d (one each %v)", flips+1, elapsed.Round(time.Millisecond), writes, bound, edge.HealthGap)
	}
	if int64(flips) <= 2*bound {
		t.Fatalf("only %d flips sent in %v: the test checks nothing", flips, elapsed)
	}
	for k, v := range after {
		if k != own && before[k] != v {
			t.Errorf("key %s: version %d, was %d: another name's record was written", k, v, before[k])
		}
	}
	if tn := poolTunnel(t, b.Edge, "yonly."+tunneltest.Domain); len(tn.Members) != 1 || tn.Members[0].Down != "" {
		t.Fatalf("the other session's pool seen from b: %+v", tn)
	}
	tunneltest.Eventually(t, 10*time.Second, "b to see x's member down", func() bool {
		tn := poolTunnel(t, b.Edge, flap)
		for _, m := range tn.Members {
			if m.SessionID == sx {
				return m.Down == "final"
			}
		}
		return false
	})

	// Traffic while x flips again, then both leave.
	var visits sync.WaitGroup
	for _, via := range []*clusterEdge{a, b} {
		visits.Go(func() {
			cl := via.Client()
			for range 30 {
				resp, err := cl.Get(tunneltest.URL("http", "flap", "/"))
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}
	for i := range 200 {
		send(&mux.Health{Hostname: flap, Down: i%2 == 1})
	}
	visits.Wait()
	for _, u := range []struct {
		r    *tunneltest.RawSession
		host string
	}{{x, flap}, {x, "solo." + tunneltest.Domain}, {y, flap}, {y, "yonly." + tunneltest.Domain}} {
		if err := exchange(u.r, &mux.Unbind{Hostname: u.host}, func(m mux.Message) bool {
			_, ok := m.(*mux.Unbound)
			return ok
		}); err != nil {
			t.Fatalf("unbind %s: %v", u.host, err)
		}
	}
	x.YS.Close()
	y.YS.Close()
	tunneltest.Eventually(t, 10*time.Second, "the pool gone on both edges", func() bool {
		_, onA := a.store.Lookup(flap)
		_, onB := b.store.Lookup(flap)
		return !onA && !onB
	})
	pending(t, "no health write nor pool exchange held after the agents left", a, b)
}

// A visitor's Upgrade to a pool's member on another edge is relayed as to
// one of its own edge, and counts in flight until it ends.
func TestPoolAcrossEdgesUpgrade(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(t)
	poolAgent(t, b.Edge, b.AgentConfigShortTimeouts("", backend.Addr()), "up")
	waitPool(t, "up."+tunneltest.Domain, 1, a, b)
	for _, via := range []*clusterEdge{b, a} {
		tunneltest.UpgradeRoundTrip(t, via.Addr("http").String(), "up")
	}
	pending(t, "no pool exchange in flight after the upgrade ended", a, b)
}
