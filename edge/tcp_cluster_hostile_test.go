package edge_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// Hostile visitors of TCP tunnels on the edge that is not the agent's:
// refused by the tunnel's CIDRs, racing the agent's move to their edge,
// many idle ones, ones that reset mid-transfer, ones relayed to a session
// that moves away, HTTP ones posing as the edge's own TCP exchange. Each
// is held to the bound it would meet on the agent's own edge.

// bannerService is a local service that counts its connections, writes
// "banner\n" and reads until the visitor's end.
func bannerService(t *testing.T, reached *atomic.Int64) string {
	return tunneltest.ServeConns(t, func(c net.Conn) {
		reached.Add(1)
		io.WriteString(c, "banner\n")
		c.SetReadDeadline(time.Now().Add(tcpDeadline))
		io.Copy(io.Discard, c)
	})
}

// refusedWithNothing reads c, whose end must come within 10 s with
// nothing read: a byte fails the test at once.
func refusedWithNothing(t *testing.T, c net.Conn, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if n > 0 || !errors.Is(err, io.EOF) && !errors.Is(err, syscallReset) {
		t.Fatalf("%s: read %q, %v; want the connection closed with nothing", what, buf[:n], err)
	}
}

// TestClusterTCPDeniedOnOtherEdge: a TCP tunnel's agent on edge a lets in
// only 192.0.2.0/24 (or keeps out 127.0.0.0/8); a visitor of edge b from
// 127.0.0.x is closed with nothing read and counted ip_denied on b, as on
// a, and never reaches the local service or the agent.
func TestClusterTCPDeniedOnOtherEdge(t *testing.T) {
	var reached atomic.Int64
	local := bannerService(t, &reached)
	_, a, b, _ := startTCPCluster(t, 2, nil)
	var ports []int
	var agents []*tunneltest.Agent
	for _, access := range []func(*agent.Config){
		func(ac *agent.Config) { ac.AllowCIDR = []string{"192.0.2.0/24"} },
		func(ac *agent.Config) { ac.DenyCIDR = []string{"127.0.0.0/8"} },
	} {
		ac := a.AgentConfigShortTimeouts("", local)
		ac.Proto, ac.Token = agent.ProtoTCP, "token-a"
		access(&ac)
		ag := tunneltest.StartAgent(t, ac)
		st := ag.WaitOnline(t)
		port := tcpPort(t, st)
		waitRouted(t, b, mux.TCPKey(port), st)
		ports, agents = append(ports, port), append(agents, ag)
	}
	const rounds = 3
	for _, port := range ports {
		for _, e := range []*clusterEdge{b, a} {
			for range rounds {
				start := time.Now()
				refusedWithNothing(t, dialTCP(t, e.Edge, port), "via "+e.store.Node())
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("via %s: closed after %s, want at once", e.store.Node(), d)
				}
			}
		}
	}
	want := float64(rounds * len(ports))
	for _, e := range []*clusterEdge{b, a} {
		m := scrape(t, e.Edge, "")
		for name, want := range map[string]float64{
			`ngstone_tcp_connections_total{result="ip_denied"}`: want,
			`ngstone_tcp_connections_total{result="relayed"}`:   0,
			`ngstone_tcp_connections_total{result="failed"}`:    0,
		} {
			if m[name] != want {
				t.Errorf("%s: %s = %v, want %v", e.store.Node(), name, m[name], want)
			}
		}
	}
	// The owner refuses both edges' visitors: its own, and b's forwarded.
	if got := scrape(t, a.Edge, "")[`ngstone_limits_total{limit="ip_denied"}`]; got != 2*want {
		t.Errorf(`a: ngstone_limits_total{limit="ip_denied"} = %v, want %v`, got, 2*want)
	}
	if n := reached.Load(); n != 0 {
		t.Errorf("the local service was reached %d times", n)
	}
	for i, ag := range agents {
		if st := ag.Stats(); st.Total != 0 {
			t.Errorf("agent %d saw %d connections, want none: the owner refuses them", i, st.Total)
		}
	}
}

// TestClusterTCPDeniedAcrossMove: a visitor of edge b, outside the
// tunnel's AllowCIDR, whose connection b forwards to edge a just before
// the agent moves to b. a answers 421 stale; b reads the registry again,
// finds the tunnel on a session of its own, and must still refuse the
// visitor: the CIDRs hold on every path to the agent.
func TestClusterTCPDeniedAcrossMove(t *testing.T) {
	var reached atomic.Int64
	local := bannerService(t, &reached)
	c := newTestCluster(t)
	tcp := tunneltest.FreePorts(t, 1)
	// a's cluster listener behind a proxy that can hold b's forwarded
	// request until the agent has moved.
	link := tunneltest.StartFaultProxy(t, "127.0.0.1:1")
	start := func(name, host, advertise string) *clusterEdge {
		return c.start(name, nil, func(cfg *edge.Config) {
			cfg.HTTPAddr, cfg.HTTPSAddr = host+":0", host+":0"
			cfg.TCPPorts = tcp
			cfg.TokenPolicies = []edge.TokenPolicy{{Token: "token-a"}, {Token: "token-b"}}
			cfg.HeartbeatTimeout = time.Minute // a does not notice the partition
			cfg.Cluster.Advertise = advertise
		})
	}
	a := start("a", "127.0.0.2", link.Addr())
	link.SetTarget(a.Addr("cluster").String())
	b := start("b", "127.0.0.3", "")

	lb := controlProxy(t, a)
	ac := a.AgentConfigShortTimeouts(lb.Addr(), local)
	ac.Proto, ac.Token, ac.InstanceID = agent.ProtoTCP, "token-a", instX
	ac.AllowCIDR = []string{"192.0.2.0/24"}
	ag := tunneltest.StartAgent(t, ac)
	port := tcpPort(t, ag.WaitOnline(t))
	key := mux.TCPKey(port)
	tunneltest.Eventually(t, 5*time.Second, "b to route the port to a", func() bool {
		r, ok := b.store.Lookup(key)
		return ok && r.Node == "a"
	})
	refusedWithNothing(t, dialTCP(t, b.Edge, port), "before the move, via b")

	// An HTTP tunnel on a, visited through b, leaves a connection from b
	// to a idle, which b's next forward takes: held by the proxy, it
	// waits for no TLS handshake timeout.
	startAppVia(t, a, b)
	mustFetch(t, b, tunneltest.URL("http", "app", "/hello"), "hello")

	m := scrape(t, b.Edge, "")
	forwarded, stale := m["ngstone_cluster_forwarded_total"], m["ngstone_cluster_stale_routes_total"]
	link.Block()
	v := dialTCP(t, b.Edge, port)
	tunneltest.Eventually(t, 10*time.Second, "b to forward the visitor to a", func() bool {
		return scrape(t, b.Edge, "")["ngstone_cluster_forwarded_total"] > forwarded
	})
	lb.DelayExisting(time.Hour) // the agent's partition from a
	lb.SetTarget(b.Addr("control").String())
	tunneltest.Eventually(t, 15*time.Second, "the agent to move to b, and a to learn of it", func() bool {
		r, ok := a.store.Lookup(key)
		return ok && r.Node == "b"
	})
	link.Unblock()

	refusedWithNothing(t, v, "forwarded to a while the agent moved to b")
	if got := scrape(t, b.Edge, "")["ngstone_cluster_stale_routes_total"]; got != stale+1 {
		t.Fatalf("b retried %v stale routes, want 1: the test did not race the move", got-stale)
	}
	refusedWithNothing(t, dialTCP(t, b.Edge, port), "after the move, via b")
	if n := reached.Load(); n != 0 {
		t.Errorf("the local service was reached %d times by a visitor outside the tunnel's AllowCIDR", n)
	}
}

// TestClusterTCPIdleVisitorsBounded: TestTCPIdleVisitorsBounded's
// visitors, on the edge that is not the agent's: 1,024 connections from
// four loopback addresses that send nothing, to a tunnel whose session
// may carry 256 at once. b forwards each to a over a connection of its
// own; a relays the first 256 and refuses the rest, which b closes at
// once and counts as limited. The heap holds no more than the relayed
// ones need, another tunnel answers meanwhile, and once the visitors
// leave every exchange ends on both edges and the process's goroutines
// (the connections between the edges among them) are back to their
// number before.
func TestClusterTCPIdleVisitorsBounded(t *testing.T) {
	const (
		visitors = 1024
		limit    = 256
		sources  = 4 // 127.0.0.4 to 127.0.0.7
		// perRelayed bounds the heap of one relayed, idle connection in
		// this process: b's relay and its connection to a, a's handler
		// and stream, the agent's exchange, the local service's side.
		perRelayed = 512 << 10
		// refusedBound bounds the heap of all 768 refused ones: a leak of
		// 10 KiB each would pass it.
		refusedBound = 8 << 20
	)
	var open, peak atomic.Int64
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		n := open.Add(1)
		defer open.Add(-1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		c.SetReadDeadline(time.Now().Add(2 * time.Minute))
		io.Copy(io.Discard, c)
	})
	// Not a test of liveness: the CLI's heartbeats and freshness window,
	// which a heartbeat late on a loaded machine does not outlast.
	_, a, b, _ := startTCPCluster(t, 1, func(cfg *edge.Config) {
		cfg.MaxStreamsPerSession = limit
		cfg.HeartbeatTimeout = edge.DefaultConfig().HeartbeatTimeout
	})
	ac := a.AgentConfig("", local)
	ac.Proto, ac.Token, ac.InstanceID = agent.ProtoTCP, "token-a", instX
	st := tunneltest.StartAgent(t, ac).WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)

	// Another tunnel of a's, visited through b.
	startAppVia(t, a, b)
	client := b.Client()
	t.Cleanup(client.CloseIdleConnections)
	serving := func() time.Duration {
		t.Helper()
		return answerTime(t, client, tunneltest.URL("http", "app", "/hello"))
	}
	serving()

	var (
		mu     sync.Mutex
		held   []net.Conn
		closed []error // how each visitor closed by the edge ended
		wg     sync.WaitGroup
	)
	t.Cleanup(func() {
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	addr := b.TCPAddr(port).String()
	dial := func(n int) {
		t.Helper()
		dialSpread(t, addr, n, sources, 4, func(c net.Conn) {
			c.SetReadDeadline(time.Now().Add(2 * time.Minute))
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
			wg.Go(func() {
				k, err := c.Read(make([]byte, 1))
				if errors.Is(err, net.ErrClosed) {
					return // the test's own close
				}
				if k > 0 {
					err = fmt.Errorf("read %d bytes", k)
				} else if errors.Is(err, io.EOF) || errors.Is(err, syscallReset) {
					err = nil
				}
				c.Close()
				mu.Lock()
				closed = append(closed, err)
				mu.Unlock()
			})
		})
	}
	ended := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(closed)
	}
	settle := settleVisitors(t, 60*time.Second, limit, &open, &peak, ended)

	beforeEdge, beforeAll, beforeClients := peakOf(edgeGoroutines), peakOf(tunneltest.Goroutines), peakOf(clientConns)
	before := liveHeap()
	start := time.Now()
	dial(limit)
	settle("the first visitors relayed", limit)
	relayedHeap := liveHeap()
	dial(visitors - limit)
	settle("the visitors past the limit closed", visitors)
	settled := time.Since(start)
	heldHeap := liveHeap()
	slowestAnswer := slowestWhileHeld(t, serving)
	mu.Lock()
	for _, err := range closed {
		if err != nil {
			t.Errorf("a visitor past the limit: %v; want its connection closed with nothing", err)
			break
		}
	}
	mu.Unlock()
	if got := open.Load(); got != limit || peak.Load() != limit {
		t.Errorf("%d connections relayed (peak %d), want the session's stream limit, %d", got, peak.Load(), limit)
	}
	mb, ma := scrape(t, b.Edge, ""), scrape(t, a.Edge, "")
	// A loaded machine can leave b's route cache unconfirmed for a moment:
	// b then reads each route from etcd and refuses, as offline, a visitor
	// whose read etcd did not answer in time. Every other visitor past
	// the limit is refused for a's stream limit.
	offline := mb[`ngstone_tcp_connections_total{result="offline"}`]
	if unread := mb[`ngstone_cluster_routes_total{source="failed"}`] + mb[`ngstone_cluster_routes_total{source="busy"}`]; offline > unread {
		t.Errorf("b: %v visitors refused as offline, but only %v routes unread from etcd", offline, unread)
	}
	for _, c := range []struct {
		node string
		m    map[string]float64
		name string
		want float64
	}{
		{"b", mb, `ngstone_tcp_connections_total{result="limited"}`, visitors - limit - offline},
		{"b", mb, `ngstone_tcp_connections_total{result="failed"}`, 0},
		{"b", mb, `ngstone_tcp_connections_total{result="relayed"}`, 0},
		{"a", ma, `ngstone_limits_total{limit="session_streams"}`, visitors - limit - offline},
		{"a", ma, `ngstone_streams_active`, limit},
	} {
		if c.m[c.name] != c.want {
			t.Errorf("%s: %s = %v, want %v", c.node, c.name, c.m[c.name], c.want)
		}
	}
	relayedGrowth, refusedGrowth := int64(relayedHeap)-int64(before), int64(heldHeap)-int64(relayedHeap)
	t.Logf("%d visitors settled after %s: %d relayed, %d closed; heap %s before, %+.0f KiB for each relayed, %+.1f MiB for the refused; the other tunnel answered within %s",
		visitors, settled.Round(time.Millisecond), open.Load(), ended(), mib(before),
		float64(relayedGrowth)/1024/limit, float64(refusedGrowth)/(1<<20), slowestAnswer.Round(time.Millisecond))
	if relayedGrowth > limit*perRelayed {
		t.Errorf("the heap grew by %s for %d relayed connections, over the bound of %s", mib(uint64(relayedGrowth)), limit, mib(limit*perRelayed))
	}
	if refusedGrowth > refusedBound {
		t.Errorf("the heap grew by %s for %d refused connections, over the bound of %s", mib(uint64(refusedGrowth)), visitors-limit, mib(refusedBound))
	}

	mu.Lock()
	for _, c := range held {
		c.Close()
	}
	mu.Unlock()
	tunneltest.Eventually(t, 30*time.Second, "every relayed connection to end on both edges", func() bool {
		return open.Load() == 0 && scrape(t, a.Edge, "")["ngstone_streams_active"] == 0 &&
			scrape(t, b.Edge, "")[`ngstone_tcp_connections_total{result="relayed"}`] == limit
	})
	serving()
	waitGoroutines(t, "the edges' goroutines of the visitors gone", beforeEdge, edgeGoroutines, func() string { return strings.Join(edgeStacks(), "\n\n") })
	// The slack: keep-alive connections the other tunnel's visits may
	// have added, on each hop (the client's to b, b's to a), each a
	// server's goroutine and a client's two; a leak of the visitors'
	// would be hundreds.
	waitGoroutines(t, "the process's goroutines", beforeAll+16, tunneltest.Goroutines, tunneltest.Stacks)
	// b's connections to a are net/http's client connections, which
	// neither count above includes.
	waitGoroutines(t, "net/http's client connections (b's to a among them)", beforeClients+8, clientConns, tunneltest.Stacks)
}

// clientConns counts net/http's client connections in this process: the
// forwarding edges', the sessions' streams, the agents' to their local
// services.
func clientConns() int {
	return strings.Count(tunneltest.Stacks(), "net/http.(*persistConn).readLoop(")
}

// TestClusterTCPVisitorReset: visitors of edge b, for a tunnel whose
// agent is on edge a, reset their connections (RST) mid-transfer: while
// the local service sends as fast as it can, while they send faster than
// it reads, and while neither side sends. Each local connection ends; no
// exchange, stream or connection between the edges outlives its visitor
// on either edge, nor in the agent.
func TestClusterTCPVisitorReset(t *testing.T) {
	const each = 4
	var open, ended atomic.Int64
	var reset atomic.Bool // past the resets, the slow service reads at once what is left
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(tcpDeadline))
		mode := make([]byte, 1)
		if _, err := io.ReadFull(c, mode); err != nil {
			return
		}
		open.Add(1)
		defer ended.Add(1)
		defer open.Add(-1)
		c.SetDeadline(time.Now().Add(time.Minute)) // past it, the test fails
		if _, err := io.WriteString(c, "+"); err != nil {
			return
		}
		switch mode[0] {
		case 'd': // download: as fast as the visitor reads
			for {
				if _, err := io.Copy(c, tunneltest.Pattern(1<<20)); err != nil {
					return
				}
			}
		case 'u': // upload: 4 KiB every 10 ms
			buf := make([]byte, 4<<10)
			for !reset.Load() {
				if _, err := c.Read(buf); err != nil {
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			// Megabytes wait in the kernels' buffers on the way, which
			// it must read before their end.
			io.Copy(io.Discard, c)
		default: // quiet
			io.Copy(io.Discard, c)
		}
	})
	_, a, b, _ := startTCPCluster(t, 1, nil)
	ag := startClusterTCPAgent(t, a, local, "token-a", instX, 0)
	st := ag.WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)

	// scrape's connections to the admin listeners, kept alive, counted
	// before and after.
	scrape(t, a.Edge, "")
	scrape(t, b.Edge, "")
	beforeEdge, beforeClients := peakOf(edgeGoroutines), peakOf(clientConns)
	// visit dials a visitor of mode and waits for the local service's
	// '+': the relay is up both ways (a reset before it is not relayed
	// but failed).
	visit := func(mode string) *net.TCPConn {
		t.Helper()
		c := dialTCP(t, b.Edge, port)
		if _, err := io.WriteString(c, mode); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
			t.Fatalf("mode %s: the local service's '+': %v", mode, err)
		}
		return c
	}
	var visitors []*net.TCPConn
	var writers sync.WaitGroup
	for _, mode := range []string{"d", "u", "q"} {
		for range each {
			c := visit(mode)
			switch mode {
			case "d":
				if _, err := io.CopyN(io.Discard, c, 256<<10); err != nil {
					t.Fatalf("download: %v", err)
				}
			case "u":
				writers.Go(func() {
					chunk := make([]byte, 64<<10)
					for {
						if _, err := c.Write(chunk); err != nil {
							return // the reset
						}
					}
				})
			}
			visitors = append(visitors, c)
		}
	}
	n := int64(len(visitors))
	tunneltest.Eventually(t, 10*time.Second, "every visitor relayed to the local service", func() bool { return open.Load() == n })
	// Let the uploads fill every buffer on the way.
	tunneltest.Eventually(t, 10*time.Second, "the uploads to be held up by the local service", func() bool {
		return scrape(t, b.Edge, "")[`ngstone_tcp_bytes_total{direction="in"}`] > 4<<20
	})
	for _, c := range visitors {
		c.SetLinger(0) // the close is a reset
		c.Close()
	}
	writers.Wait()
	reset.Store(true)
	start := time.Now()
	tunneltest.Eventually(t, 15*time.Second, "every local connection to end", func() bool { return ended.Load() == n })
	t.Logf("the local service saw its %d connections end within %s of the resets", n, time.Since(start).Round(time.Millisecond))
	var streams, relayed float64
	var inAgent int64
	deadline := time.Now().Add(15 * time.Second)
	for {
		streams, inAgent = scrape(t, a.Edge, "")["ngstone_streams_active"], ag.Stats().Open
		relayed = scrape(t, b.Edge, "")[`ngstone_tcp_connections_total{result="relayed"}`]
		if streams == 0 && inAgent == 0 && relayed == float64(n) {
			break
		}
		if time.Now().After(deadline) {
			var results []string
			for k, v := range scrape(t, b.Edge, "") {
				if strings.HasPrefix(k, "ngstone_tcp_connections_total") {
					results = append(results, fmt.Sprintf("%s %v", k, v))
				}
			}
			t.Fatalf("15s after the resets: a holds %v exchanges, its agent %d; b counts %v of %d relayed (%v) and holds:\n%s",
				streams, inAgent, relayed, n, results, strings.Join(edgeStacks(), "\n\n"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	waitGoroutines(t, "the edges' goroutines of the visitors gone", beforeEdge, edgeGoroutines, func() string { return strings.Join(edgeStacks(), "\n\n") })
	// The slack: the keep-alive connections scrape may have added, to
	// each admin listener; a leak would be one for each visitor.
	waitGoroutines(t, "net/http's client connections (b's to a among them)", beforeClients+4, clientConns, tunneltest.Stacks)
	if m := scrape(t, b.Edge, ""); m[`ngstone_tcp_connections_total{result="failed"}`] != 0 {
		t.Errorf(`b: ngstone_tcp_connections_total{result="failed"} = %v, want 0`, m[`ngstone_tcp_connections_total{result="failed"}`])
	}
}

// TestClusterTCPMoveEndsForwarded: a visitor of edge b is relayed, over
// the hop, to the agent on edge a when the agent's path to a goes silent
// and it moves to b, its own instance taking the port back. a, which has
// not noticed the partition (its heartbeat timeout is a minute), learns
// of the move from the registry: the old session's exchange ends within
// its drain, and with it the visitor's connection, where it would
// otherwise hang until the idle timeout of an hour. New visitors of
// either edge reach the agent on b.
func TestClusterTCPMoveEndsForwarded(t *testing.T) {
	var reached atomic.Int64
	local := bannerService(t, &reached) // it speaks first: TestClusterTCPUploadCrosses
	_, a, b, _ := startTCPCluster(t, 1, func(cfg *edge.Config) { cfg.HeartbeatTimeout = time.Minute })
	lb := controlProxy(t, a)
	ac := a.AgentConfigShortTimeouts(lb.Addr(), local)
	ac.Proto, ac.Token, ac.InstanceID = agent.ProtoTCP, "token-a", instX
	ag := tunneltest.StartAgent(t, ac)
	port := tcpPort(t, ag.WaitOnline(t))
	key := mux.TCPKey(port)
	routedTo := func(e *clusterEdge, node string) {
		t.Helper()
		tunneltest.Eventually(t, 15*time.Second, e.store.Node()+" to route the port to "+node, func() bool {
			r, ok := e.store.Lookup(key)
			return ok && r.Node == node
		})
	}
	routedTo(b, "a")
	sawBanner := func(c net.Conn, what string) {
		t.Helper()
		buf := make([]byte, 7)
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "banner\n" {
			t.Fatalf("%s: %q, %v", what, buf, err)
		}
	}
	old := dialTCP(t, b.Edge, port)
	sawBanner(old, "via b, before the move")

	lb.DelayExisting(time.Hour) // the partition between the agent and a
	lb.SetTarget(b.Addr("control").String())
	routedTo(a, "b")
	moved := time.Now()
	old.SetReadDeadline(moved.Add(a.Config.DrainTimeout + 10*time.Second))
	n, err := io.Copy(io.Discard, old)
	if err != nil && !errors.Is(err, syscallReset) {
		t.Fatalf("the visitor relayed to the old session: %d bytes, %v; want its connection ended within the drain (%s)", n, err, a.Config.DrainTimeout)
	}
	t.Logf("the visitor relayed to the old session was closed %s after a learned of the move", time.Since(moved).Round(time.Millisecond))
	routedTo(b, "b")
	for _, e := range []*clusterEdge{a, b} {
		sawBanner(dialTCP(t, e.Edge, port), "via "+e.store.Node()+", after the move")
	}
	tunneltest.Eventually(t, 10*time.Second, "a to hold no exchange of the old session", func() bool {
		return scrape(t, a.Edge, "")["ngstone_streams_active"] == 0
	})
}

// TestClusterTCPUploadCrosses: every visitor connection that b forwards
// to a carries the visitor's bytes, 100 one after another: b sends with
// Expect: 100-continue, and its transport sends no body after a final
// answer, so a must send its 100 before the agent's 200 can reach b.
func TestClusterTCPUploadCrosses(t *testing.T) {
	const conns = 100
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(time.Minute))
		io.Copy(c, c)
	})
	_, a, b, _ := startTCPCluster(t, 1, nil)
	st := startClusterTCPAgent(t, a, local, "token-a", instX, 0).WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)
	for i := range conns {
		c := dialTCP(t, b.Edge, port)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 4)
		if _, err := io.WriteString(c, "ping"); err != nil {
			t.Fatalf("visitor %d: %v", i, err)
		}
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("visitor %d of %d: echo %q, %v; its bytes never reached the local service", i, conns, buf, err)
		}
		c.Close()
	}
}

// TestClusterTCPFieldsNotForged: an HTTP visitor cannot pose as the
// edge's own TCP exchange. Ngstone-Tcp-Source and -Destination (which
// the owner passes on for a forwarded TCP connection's PROXY protocol
// header), in any spelling, and X-Forwarded-For never reach a local
// service from a visitor, through the owner or the edge that forwards;
// and Host tcp:PORT, a TCP port's key, names no tunnel on either edge's
// HTTP listener.
func TestClusterTCPFieldsNotForged(t *testing.T) {
	var reached atomic.Int64
	tcpLocal := bannerService(t, &reached)
	_, a, b, _ := startTCPCluster(t, 1, nil)
	st := startClusterTCPAgent(t, a, tcpLocal, "token-a", instX, 0).WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)
	startAppVia(t, a, b)

	forged := [][2]string{
		{"Ngstone-Tcp-Source", "203.0.113.7:4242"},
		{"Ngstone-Tcp-Destination", "203.0.113.8:22"},
		{"Ngstone_Tcp_Source", "203.0.113.7:4242"},
		{"ngstone-tcp-source", "203.0.113.7:4242"},
		{"X-Forwarded-For", "203.0.113.7"},
	}
	for _, e := range []*clusterEdge{b, a} {
		c, err := net.DialTimeout("tcp", e.Addr("http").String(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(tcpDeadline))
		req := "GET /headers HTTP/1.1\r\nHost: app." + tunneltest.Domain + "\r\n"
		for _, f := range forged {
			req += f[0] + ": " + f[1] + "\r\n"
		}
		io.WriteString(c, req+"Connection: close\r\n\r\n")
		raw, err := io.ReadAll(c)
		c.Close()
		if err != nil || !strings.HasPrefix(string(raw), "HTTP/1.1 200 ") {
			t.Fatalf("via %s: %q, %v", e.store.Node(), raw, err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
		if err != nil {
			t.Fatalf("via %s: %v", e.store.Node(), err)
		}
		var seen struct{ Header http.Header }
		if err := json.NewDecoder(resp.Body).Decode(&seen); err != nil {
			t.Fatalf("via %s: %v", e.store.Node(), err)
		}
		for k, v := range seen.Header {
			if mux.ForwardingField(k) && k != "X-Forwarded-For" && k != "X-Forwarded-Host" && k != "X-Forwarded-Proto" {
				t.Errorf("via %s, the local service saw %s: %q", e.store.Node(), k, v)
			}
		}
		if xff := seen.Header["X-Forwarded-For"]; len(xff) != 1 || xff[0] != "127.0.0.1" {
			t.Errorf("via %s, the local service saw X-Forwarded-For %q, want the visitor's own 127.0.0.1", e.store.Node(), xff)
		}

		for _, host := range []string{mux.TCPKey(port), fmt.Sprintf("tcp:%d.%s", port, tunneltest.Domain)} {
			c, err := net.DialTimeout("tcp", e.Addr("http").String(), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(tcpDeadline))
			io.WriteString(c, "POST / HTTP/1.1\r\nHost: "+host+"\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
			raw, _ := io.ReadAll(c)
			c.Close()
			if !strings.HasPrefix(string(raw), "HTTP/1.1 4") {
				t.Errorf("via %s, Host %q: %q; want a 4xx", e.store.Node(), host, raw)
			}
		}
	}
	if n := reached.Load(); n != 0 {
		t.Errorf("the TCP tunnel's local service was reached %d times by HTTP visitors", n)
	}
}

// startAppVia starts an HTTP tunnel "app" (token B) on a, and waits until
// b routes it there.
func startAppVia(t *testing.T, a, b *clusterEdge) {
	t.Helper()
	backend := tunneltest.StartBackend(t)
	ac := a.AgentConfig("", backend.Addr()) // the CLI's: no test here is of its liveness
	ac.Subdomain, ac.Token = "app", "token-b"
	waitRouted(t, b, "app."+tunneltest.Domain, tunneltest.StartAgent(t, ac).WaitOnline(t))
}
